// The TCP rendezvous store (tcp_store.h): a server thread that polls its
// connections and a blocking client. The server keeps every connection's
// unread bytes and answers each complete message in order; a WAIT whose
// keys are missing is parked until a SET or ADD makes them all exist.
#include "src/gpu/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/gpu/comm_internal.h"
#include "src/gpu/device.h"

namespace strata::gpu {
namespace {

constexpr uint32_t kMagic = 0x3C85F7CE;
constexpr uint64_t kMaxBytes = 16u << 20;  // a key or value; more closes the connection
enum Query : uint8_t {
  kValidate = 0,
  kSet = 1,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kDeleteKey = 8,
  kCancelWait = 12,
  kPing = 13,
};
constexpr uint8_t kStopWaiting = 0, kWaitCanceled = 1, kReady = 0, kNotReady = 1;

using Clock = std::chrono::steady_clock;

// Appends values in the wire layout.
struct Writer {
  std::string out;
  template <typename T>
  Writer& Value(T v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(v));
    return *this;
  }
  Writer& Bytes(const std::string& s) {
    Value<uint64_t>(s.size());
    out += s;
    return *this;
  }
};

// Reads values from the front of a buffer; nullopt while incomplete,
// `bad` for a length over the limit.
struct Reader {
  const std::string& in;
  size_t at = 0;
  bool bad = false;
  template <typename T>
  std::optional<T> Value() {
    if (in.size() - at < sizeof(T)) return std::nullopt;
    T v;
    std::memcpy(&v, in.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::optional<std::string> Bytes() {
    auto n = Value<uint64_t>();
    if (!n) return std::nullopt;
    if (*n > kMaxBytes) {
      bad = true;
      return std::nullopt;
    }
    if (in.size() - at < *n) return std::nullopt;
    std::string s = in.substr(at, *n);
    at += *n;
    return s;
  }
};

bool SendAll(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

class Server {
 public:
  static StatusOr<std::unique_ptr<Server>> Listen(int port) {
    int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool v6 = fd >= 0;
    if (!v6) fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ErrnoError("rendezvous store: socket", errno);
    const int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc;
    if (v6) {
      setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));  // IPv4 too
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    }
    if (rc != 0 || listen(fd, 128) != 0) {
      const int err = errno;
      close(fd);
      return ErrnoError(
          fmt::format("rendezvous store: rank 0 cannot listen on port {} (MASTER_PORT; another "
                      "job's, or a store already open there?)",
                      port),
          err);
    }
    const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake < 0) {
      close(fd);
      return ErrnoError("rendezvous store: eventfd", errno);
    }
    return std::unique_ptr<Server>(new Server(fd, wake));
  }

  ~Server() {
    const uint64_t one = 1;
    if (write(wake_, &one, sizeof(one)) < 0) {
    }  // the thread polls this fd; it cannot be full
    thread_.join();
    for (auto& [fd, conn] : conns_) close(fd);
    close(listen_);
    close(wake_);
  }

 private:
  struct Conn {
    std::string in;
    bool validated = false;
    std::vector<std::string> waiting;  // a parked WAIT's keys (empty: none)
  };

  Server(int listen_fd, int wake) : listen_(listen_fd), wake_(wake) {
    thread_ = std::thread([this] { Run(); });
  }

  void Run() {
    for (;;) {
      std::vector<pollfd> fds = {{wake_, POLLIN, 0}, {listen_, POLLIN, 0}};
      for (auto& [fd, conn] : conns_) fds.push_back({fd, POLLIN, 0});
      if (poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        STRATA_LOG_ERROR("rendezvous store: poll failed ({}); the store stops", strerror(errno));
        return;
      }
      if (fds[0].revents != 0) return;
      if (fds[1].revents & POLLIN) {
        const int c = accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c >= 0) {
          const int one = 1;
          setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          conns_[c] = Conn{};
        }
      }
      for (size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        const int fd = fds[i].fd;
        if (!conns_.count(fd)) continue;  // dropped by a Wake in this round
        char buf[65536];
        const ssize_t n = recv(fd, buf, sizeof(buf), 0);
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (n <= 0 || !Serve(fd, std::string_view(buf, static_cast<size_t>(n)))) Drop(fd);
      }
    }
  }

  void Drop(int fd) {
    if (conns_.erase(fd) != 0) close(fd);
  }

  bool AllExist(const std::vector<std::string>& keys) const {
    for (const std::string& k : keys)
      if (!data_.count(k)) return false;
    return true;
  }

  // After a SET or ADD: the parked waits whose keys now all exist return.
  // Connections whose reply fails are dropped, except `current` (its
  // caller drops it): false when that one failed.
  bool Wake(int current) {
    std::vector<int> dead;
    bool current_ok = true;
    for (auto& [fd, conn] : conns_) {
      if (conn.waiting.empty() || !AllExist(conn.waiting)) continue;
      conn.waiting.clear();
      if (SendAll(fd, Writer().Value(kStopWaiting).out)) continue;
      if (fd == current)
        current_ok = false;
      else
        dead.push_back(fd);
    }
    for (int fd : dead) Drop(fd);
    return current_ok;
  }

  // Appends bytes to the connection and answers every complete message;
  // false closes it (a protocol violation or a failed reply).
  bool Serve(int fd, std::string_view bytes) {
    Conn& c = conns_[fd];
    c.in.append(bytes);
    for (;;) {
      Reader r{c.in};
      auto q = r.Value<uint8_t>();
      if (!q) return true;
      if (!c.validated && *q != kValidate) return false;
      std::string reply;
      bool changed = false;
      switch (*q) {
        case kValidate: {
          auto m = r.Value<uint32_t>();
          if (!m) return true;
          if (*m != kMagic) return false;
          c.validated = true;
          break;
        }
        case kSet: {
          auto k = r.Bytes();
          auto v = k ? r.Bytes() : std::nullopt;
          if (!v) return !r.bad;
          data_[*k] = *v;
          changed = true;
          break;
        }
        case kGet: {
          auto k = r.Bytes();
          if (!k) return !r.bad;
          auto it = data_.find(*k);
          if (it == data_.end()) return false;  // a client waits before it gets
          reply = Writer().Bytes(it->second).out;
          break;
        }
        case kAdd: {
          auto k = r.Bytes();
          auto d = k ? r.Value<int64_t>() : std::nullopt;
          if (!d) return !r.bad;
          const auto it = data_.find(*k);
          const int64_t v = (it == data_.end() ? 0 : std::atoll(it->second.c_str())) + *d;
          data_[*k] = std::to_string(v);
          reply = Writer().Value(v).out;
          changed = true;
          break;
        }
        case kCheck:
        case kWait: {
          auto n = r.Value<uint64_t>();
          if (!n) return true;
          if (*n > 4096) return false;
          std::vector<std::string> keys;
          for (uint64_t i = 0; i < *n; ++i) {
            auto k = r.Bytes();
            if (!k) return !r.bad;
            keys.push_back(*std::move(k));
          }
          const bool ready = AllExist(keys);
          if (*q == kCheck)
            reply = Writer().Value(ready ? kReady : kNotReady).out;
          else if (ready)
            reply = Writer().Value(kStopWaiting).out;
          else if (!keys.empty())
            c.waiting = std::move(keys);
          break;
        }
        case kDeleteKey: {
          auto k = r.Bytes();
          if (!k) return !r.bad;
          reply = Writer().Value<int64_t>(static_cast<int64_t>(data_.erase(*k))).out;
          break;
        }
        case kCancelWait:
          c.waiting.clear();
          reply = Writer().Value(kWaitCanceled).out;
          break;
        case kPing: {
          auto nonce = r.Value<uint32_t>();
          if (!nonce) return true;
          reply = Writer().Value(*nonce).out;
          break;
        }
        default:
          return false;
      }
      c.in.erase(0, r.at);
      if (!reply.empty() && !SendAll(fd, reply)) return false;
      if (changed && !Wake(fd)) return false;
    }
  }

  const int listen_, wake_;
  std::map<int, Conn> conns_;  // only the thread touches these
  std::map<std::string, std::string> data_;
  std::thread thread_;
};

class Client final : public RendezvousStore {
 public:
  Client(int fd, std::string where, std::unique_ptr<Server> server)
      : fd_(fd), where_(std::move(where)), server_(std::move(server)) {}
  ~Client() override {
    close(fd_);
    server_.reset();  // after the client: its thread may still answer it
  }

  Status Set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    return Send(Writer().Value(kSet).Bytes(Wire(key)).Bytes(value).out, "set " + key);
  }

  StatusOr<std::string> Get(const std::string& key, double timeout_s) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string what = "get " + key;
    RETURN_IF_ERROR(Send(Writer().Value(kWait).Value<uint64_t>(1).Bytes(Wire(key)).out, what));
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
    std::string b;
    Status st = Recv(&b, 1, deadline, what);
    if (!st.ok() && st.code() == StatusCode::kUnavailable && timed_out_) {
      // Take the wait back, so that the connection serves the next call:
      // the server answers WAIT_CANCELED, after a STOP_WAITING that may
      // already be on its way.
      RETURN_IF_ERROR(Send(Writer().Value(kCancelWait).out, what));
      const auto grace = Clock::now() + std::chrono::seconds(30);
      for (;;) {
        RETURN_IF_ERROR(Recv(&b, 1, grace, what));
        if (static_cast<uint8_t>(b[0]) == kWaitCanceled) break;
      }
      return UnavailableError(
          fmt::format("rendezvous store {}: key {} not set within {:g} s", where_, key, timeout_s));
    }
    RETURN_IF_ERROR(st);
    if (static_cast<uint8_t>(b[0]) != kStopWaiting)
      return DataLossError(fmt::format("rendezvous store {}: unexpected reply to wait", where_));
    RETURN_IF_ERROR(Send(Writer().Value(kGet).Bytes(Wire(key)).out, what));
    const auto later = Clock::now() + std::chrono::seconds(60);
    RETURN_IF_ERROR(Recv(&b, 8, later, what));
    uint64_t n;
    std::memcpy(&n, b.data(), 8);
    if (n > kMaxBytes)
      return DataLossError(
          fmt::format("rendezvous store {}: a {}-byte value for {}", where_, n, key));
    RETURN_IF_ERROR(Recv(&b, n, later, what));
    return b;
  }

  Status Remove(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string what = "remove " + key;
    RETURN_IF_ERROR(Send(Writer().Value(kDeleteKey).Bytes(Wire(key)).out, what));
    std::string b;
    return Recv(&b, 8, Clock::now() + std::chrono::seconds(60), what);
  }

  Status Validate(Clock::time_point deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(Send(Writer().Value(kValidate).Value(kMagic).out, "validate"));
    // A ping proves the server took the validation (it closes otherwise).
    RETURN_IF_ERROR(Send(Writer().Value(kPing).Value<uint32_t>(0x5717a).out, "ping"));
    std::string b;
    RETURN_IF_ERROR(Recv(&b, 4, deadline, "ping"));
    uint32_t nonce;
    std::memcpy(&nonce, b.data(), 4);
    if (nonce != 0x5717a)
      return DataLossError(
          fmt::format("rendezvous store {}: not a store (bad ping reply)", where_));
    return Status::Ok();
  }

 private:
  // torch's TCPStore client puts "/" before every key on the wire: the
  // same, so that a key is one entry whichever client names it.
  static std::string Wire(const std::string& key) { return "/" + key; }

  Status Send(const std::string& bytes, const std::string& what) {
    if (!SendAll(fd_, bytes))
      return UnavailableError(fmt::format("rendezvous store {}: {}: the connection failed ({})",
                                          where_, what, strerror(errno)));
    return Status::Ok();
  }
  // Exactly n bytes into *out by the deadline; timed_out_ tells a timeout
  // from a closed connection.
  Status Recv(std::string* out, size_t n, Clock::time_point deadline, const std::string& what) {
    out->assign(n, '\0');
    size_t done = 0;
    timed_out_ = false;
    while (done < n) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        timed_out_ = true;
        return UnavailableError(
            fmt::format("rendezvous store {}: {}: no reply in time", where_, what));
      }
      pollfd p{fd_, POLLIN, 0};
      const int rc = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
      if (rc < 0 && errno == EINTR) continue;
      if (rc == 0) continue;
      const ssize_t got = recv(fd_, out->data() + done, n - done, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        return UnavailableError(fmt::format(
            "rendezvous store {}: {}: the server closed the connection (rank 0 exited?)", where_,
            what));
      done += static_cast<size_t>(got);
    }
    return Status::Ok();
  }

  std::mutex mu_;
  const int fd_;
  const std::string where_;
  std::unique_ptr<Server> server_;
  bool timed_out_ = false;
};

// A connected socket to host:port, retrying until the deadline (the server
// may start after this rank).
StatusOr<int> ConnectTo(const std::string& host, int port, Clock::time_point deadline) {
  std::string last = "timed out";
  for (;;) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string service = std::to_string(port);
    if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0) {
      last = fmt::format("cannot resolve {} ({})", host, gai_strerror(rc));
    } else {
      for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          freeaddrinfo(res);
          const int one = 1;
          setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          return fd;
        }
        last = strerror(errno);
        close(fd);
      }
      freeaddrinfo(res);
    }
    if (Clock::now() >= deadline)
      return UnavailableError(fmt::format(
          "rendezvous store {}:{}: could not connect ({}); is rank 0 started with the same "
          "MASTER_ADDR/MASTER_PORT, and is the port open?",
          host, port, last));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace

StatusOr<std::shared_ptr<RendezvousStore>> OpenTcpStore(const std::string& host, int port,
                                                        bool serve, double timeout_s) {
  if (port <= 0 || port > 65535)
    return InvalidArgumentError(fmt::format("rendezvous store: port {} is not in 1..65535", port));
  std::unique_ptr<Server> server;
  if (serve) {
    ASSIGN_OR_RETURN(server, Server::Listen(port));
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  // The server runs in this process when `serve`: connect to it locally,
  // whatever host resolves to here.
  ASSIGN_OR_RETURN(int fd, ConnectTo(serve ? "127.0.0.1" : host, port, deadline));
  auto client = std::make_shared<Client>(fd, fmt::format("{}:{}", host, port), std::move(server));
  RETURN_IF_ERROR(client->Validate(deadline));
  return std::shared_ptr<RendezvousStore>(std::move(client));
}

StatusOr<std::shared_ptr<RendezvousStore>> DefaultRendezvousStore(const CommOptions& options) {
  if (options.world_size < 2 || options.store != nullptr) return options.store;
  for (const char* named : {"STRATA_GLOO_DIR", "STRATA_NCCL_ID_FILE", "STRATA_NCCL_UNIQUE_ID"})
    if (const char* v = std::getenv(named); v != nullptr && *v != '\0') return nullptr;
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr == nullptr || internal::IsLoopbackName(addr)) return nullptr;
  const char* port_text = std::getenv("MASTER_PORT");
  char* end = nullptr;
  const long port = port_text ? std::strtol(port_text, &end, 10) : 0;
  if (port_text == nullptr || *port_text == '\0' || *end != '\0' || port <= 0 || port > 65535)
    return InvalidArgumentError(fmt::format(
        "environment MASTER_PORT=\"{}\" is not a port (1..65535): ranks on several machines "
        "meet at MASTER_ADDR:MASTER_PORT",
        port_text ? port_text : ""));
  const double timeout_s =
      options.connect_timeout_s > 0 ? options.connect_timeout_s : options.timeout_s;
  // A second engine of this process meets its peers through the store the
  // first one opened (rank 0 cannot listen on the port twice); each
  // rendezvous has keys of its own.
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<RendezvousStore>> open;
  std::lock_guard<std::mutex> lock(mu);
  const std::string key = fmt::format("{}:{}", addr, port);
  if (std::shared_ptr<RendezvousStore> same = open[key].lock()) return same;
  // Under torchrun with TORCHELASTIC_USE_AGENT_STORE=true its agent
  // already serves a TCPStore there (as torch's env:// rendezvous assumes).
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_serves = agent != nullptr && std::string_view(agent) == "true";
  const bool serve = options.rank == 0 && !agent_serves;
  StatusOr<std::shared_ptr<RendezvousStore>> store =
      OpenTcpStore(addr, static_cast<int>(port), serve, timeout_s);
  if (store.ok()) open[key] = *store;
  if (store.ok())
    STRATA_LOG_INFO("rendezvous: rank {} of {} meets the others through the TCP store at {}:{}{}",
                    options.rank, options.world_size, addr, port,
                    serve          ? " (served by this rank)"
                    : agent_serves ? " (served by torchrun's agent)"
                                   : "");
  return store;
}

}  // namespace strata::gpu
