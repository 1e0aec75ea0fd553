// The host device's communicator for several ranks: Gloo (Debian's
// libgloo-dev) over TCP. Every multi-rank path of the engine runs with it on
// machines without a GPU, one process per rank.
//
// What each collective is in Gloo (no algorithm is written here):
//   AllGather     gloo::allgather (ring over unbound buffers)
//   AllReduce     gloo::allreduce (ring)
//   Broadcast     gloo::broadcast
//   Reduce        gloo::reduce
//   Barrier       gloo::barrier
//   ReduceScatter gloo::allreduce of a scratch copy, of which each rank keeps
//                 its slice. This Gloo version's one reduce-scatter
//                 (ReduceScatterHalvingDoubling, an older-style algorithm)
//                 reads with the timeout its pairs had when they connected,
//                 the rendezvous' short one, so a peer slower than that
//                 ended the run; the allreduce waits timeout_s as every
//                 other collective. It moves twice the bytes of a
//                 reduce-scatter.
// Data types: gather and broadcast move bytes, so every DType. Reductions
// (sum, max, min, avg) run in fp32: fp32 data directly; fp16 and bf16 data
// are widened to fp32, reduced in fp32 and rounded back once (Gloo has no
// bf16, and fp32 partial sums are at least as accurate as fp16 ones). Avg is
// the sum times 1/world_size.
//
// Rendezvous: through CommOptions::store when the caller gives one (the
// Python frontend: torch.distributed's TCPStore at MASTER_ADDR:MASTER_PORT,
// so several machines need nothing but the network), else Gloo's FileStore
// in CommOptions::rendezvous_dir (this Gloo version has no TCP store of its
// own, so without a caller's store several machines need a shared
// filesystem). Every rank writes its listening addresses there and reads
// the others'. Once all ranks are connected (a Gloo barrier) each removes
// the entries it wrote (the store) or its store touched (the directory), so
// either can serve the next run; entries left by a run that crashed during
// the rendezvous would be read by the next one (use a fresh directory or
// port then). Each rank listens on the address of its route to
// MASTER_ADDR (GlooListenAddress), not on what its host name resolves to.
//
// Gloo's TCP transport takes whatever connects to its listening port as a
// peer, and a stranger's bytes there ended the start-up of every rank. So
// the rendezvous runs in attempts, each on fresh listening ports under its
// own key prefix ("attempt-N/"). In an attempt every rank writes a random
// 32-byte secret to the store (the directory is this user's alone: 0700),
// connects the mesh, and all-gathers the secrets over it: a peer that
// returns another secret than the store's did not read the directory. Each
// rank then writes its verdict (ok/failed) for the attempt and reads every
// other's; all ok ends the rendezvous, anything else starts the next attempt
// (a rank that failed closes its sockets, so its peers fail fast too). The
// attempts share ConnectTimeoutS(options) (CommOptions::connect_timeout_s,
// else timeout_s), and each may block for a quarter of it (10 to 60 s): a
// rank connected to a stranger, or to a peer that has left the attempt, may
// see no error, and the others wait for its verdict. The collectives then
// wait timeout_s. The data itself is neither encrypted nor authenticated.
//
// Stream ordering: each collective is a host function on the stream
// (Stream::EnqueueHostCallback): it runs after the stream's earlier work and
// later work waits for it, and the caller does not block. Host functions run
// on the host device's one callback thread, so the collectives of one rank run
// one at a time in the order their streams reach them (every rank must issue
// them in the same order, as with NCCL). A collective blocks that thread until
// its peers take part or CommOptions::timeout_s passes; the host device's
// deadlock check (DeviceOptions::host_deadlock_timeout_s) does not count that
// wait (internal::HostFunctionWaitsOnPeers), so a slow peer is waited for and
// a lost one is reported by the collective's own timeout error.
// Destroying the communicator waits for its collectives still queued.
//
// Failures: a failed collective (peer closed the connection, timeout) sets a
// sticky error naming the collective, its size, this rank, the timeout and
// Gloo's message; AsyncError() and every later call return it, and the
// collectives queued behind it do nothing.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "src/common/log.h"
#include "src/common/private_fs.h"
#include "src/common/status_util.h"
#include "src/common/thread_annotations.h"
#include "src/gpu/comm_internal.h"
#include "src/gpu/device.h"
#include "src/gpu/host_kernels.h"

namespace strata::gpu::internal {
namespace {

const char* DTypeLabel(DType t) {
  switch (t) {
    case DType::kFp32:
      return "fp32";
    case DType::kFp16:
      return "fp16";
    case DType::kBf16:
      return "bf16";
  }
  return "?";
}

const char* OpLabel(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "?";
}

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

ReduceFn Fp32Reduce(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax:
      return &gloo::max<float>;
    case ReduceOp::kMin:
      return &gloo::min<float>;
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return &gloo::sum<float>;
  }
  return &gloo::sum<float>;
}

class GlooCommunicator final : public Communicator {
 public:
  // `hosts[r]`: the address rank r listens on (every rank's), for the errors.
  GlooCommunicator(Device& device, const CommOptions& o,
                   std::shared_ptr<gloo::rendezvous::Context> context,
                   std::vector<std::string> hosts)
      : device_(device),
        rank_(o.rank),
        world_(o.world_size),
        timeout_s_(o.timeout_s),
        hosts_(std::move(hosts)),
        context_(std::move(context)) {}

  // Waits for the collectives still queued on streams (each ends within the
  // timeout once its stream reaches it): they refer to this object.
  ~GlooCommunicator() override EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    while (pending_ > 0) done_cv_.Wait(&mu_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  Status AllGather(const void* send, void* recv, size_t count, DType type,
                   Stream& stream) override {
    const size_t bytes = count * DTypeSize(type);
    RETURN_IF_ERROR(Check("AllGather", send, bytes, recv, bytes * world_));
    if (count == 0) return Status::Ok();
    return Enqueue(stream, Describe("AllGather", count, type), [=, this](uint32_t tag) {
      auto* out = static_cast<char*>(recv);
      gloo::AllgatherOptions opts(context_);
      // In place when send is this rank's slot of recv.
      if (send != out + rank_ * bytes)
        opts.setInput(const_cast<char*>(static_cast<const char*>(send)), bytes);
      opts.setOutput(out, bytes * world_);
      opts.setTag(tag);
      gloo::allgather(opts);
    });
  }

  Status ReduceScatter(const void* send, void* recv, size_t count, DType type, ReduceOp op,
                       Stream& stream) override {
    const size_t esize = DTypeSize(type);
    RETURN_IF_ERROR(Check("ReduceScatter", send, count * esize * world_, recv, count * esize));
    const size_t total = count * world_;
    if (count == 0) return Status::Ok();
    return Enqueue(stream, Describe("ReduceScatter", count, type, op), [=, this](uint32_t tag) {
      // Uninitialized: the all-reduce (fp32 input) or the cast writes all.
      std::unique_ptr<float[]> scratch(new float[total]);
      gloo::AllreduceOptions opts(context_);
      opts.setReduceFunction(Fp32Reduce(op));
      opts.setTag(tag);
      if (type == DType::kFp32)
        opts.setInput(const_cast<float*>(static_cast<const float*>(send)), total);
      else
        host::Cast(send, type, scratch.get(), DType::kFp32, total);
      opts.setOutput(scratch.get(), total);
      gloo::allreduce(opts);
      Finish(scratch.get() + static_cast<size_t>(rank_) * count, recv, count, type, op);
    });
  }

  Status AllReduce(const void* send, void* recv, size_t count, DType type, ReduceOp op,
                   Stream& stream) override {
    const size_t bytes = count * DTypeSize(type);
    RETURN_IF_ERROR(Check("AllReduce", send, bytes, recv, bytes));
    if (count == 0) return Status::Ok();
    return Enqueue(stream, Describe("AllReduce", count, type, op), [=, this](uint32_t tag) {
      gloo::AllreduceOptions opts(context_);
      opts.setReduceFunction(Fp32Reduce(op));
      opts.setTag(tag);
      if (type == DType::kFp32) {
        if (send != recv) opts.setInput(const_cast<float*>(static_cast<const float*>(send)), count);
        opts.setOutput(static_cast<float*>(recv), count);
        gloo::allreduce(opts);
        Finish(static_cast<float*>(recv), recv, count, type, op);
        return;
      }
      std::vector<float> scratch(count);
      host::Cast(send, type, scratch.data(), DType::kFp32, count);
      opts.setOutput(scratch.data(), count);
      gloo::allreduce(opts);
      Finish(scratch.data(), recv, count, type, op);
    });
  }

  Status Reduce(const void* send, void* recv, size_t count, DType type, ReduceOp op, int root,
                Stream& stream) override {
    if (root < 0 || root >= world_)
      return InvalidArgumentError(
          fmt::format("Reduce: root {} is not a rank of world size {}", root, world_));
    const size_t bytes = count * DTypeSize(type);
    RETURN_IF_ERROR(Check("Reduce", send, bytes, rank_ == root ? recv : send, bytes));
    if (count == 0) return Status::Ok();
    return Enqueue(stream, Describe("Reduce", count, type, op), [=, this](uint32_t tag) {
      // In fp32 on a scratch copy (gloo::reduce uses its output as a work
      // buffer on every rank); the root's result goes to recv.
      std::vector<float> in(count), out(count);
      host::Cast(send, type, in.data(), DType::kFp32, count);
      gloo::ReduceOptions opts(context_);
      opts.setInput(in.data(), count);
      opts.setOutput(out.data(), count);
      opts.setRoot(root);
      opts.setReduceFunction(Fp32Reduce(op));
      opts.setTag(tag);
      gloo::reduce(opts);
      if (rank_ == root) Finish(out.data(), recv, count, type, op);
    });
  }

  Status Broadcast(const void* send, void* recv, size_t count, DType type, int root,
                   Stream& stream) override {
    if (root < 0 || root >= world_)
      return InvalidArgumentError(
          fmt::format("Broadcast: root {} is not a rank of world size {}", root, world_));
    const size_t bytes = count * DTypeSize(type);
    // Only the root's send buffer is read.
    RETURN_IF_ERROR(Check("Broadcast", rank_ == root ? send : recv, bytes, recv, bytes));
    if (count == 0) return Status::Ok();
    return Enqueue(stream, Describe("Broadcast", count, type), [=, this](uint32_t tag) {
      gloo::BroadcastOptions opts(context_);
      if (rank_ == root && send != recv)
        opts.setInput(const_cast<char*>(static_cast<const char*>(send)), bytes);
      opts.setOutput(static_cast<char*>(recv), bytes);
      opts.setRoot(root);
      opts.setTag(tag);
      gloo::broadcast(opts);
    });
  }

  Status Barrier() override {
    RETURN_IF_ERROR(AsyncError());
    const uint32_t tag = NextTag();
    return Run("Barrier", [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      gloo::barrier(opts);
    });
  }

  Status AsyncError() override EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return error_;
  }

 private:
  // Arguments are checked synchronously (nothing is enqueued on error).
  Status Check(const char* what, const void* send, size_t send_bytes, const void* recv,
               size_t recv_bytes) {
    RETURN_IF_ERROR(AsyncError());
    if (send_bytes == 0 && recv_bytes == 0) return Status::Ok();
    if (send == nullptr || recv == nullptr)
      return InvalidArgumentError(fmt::format("{}: null buffer", what));
    if (!device_.Contains(send, send_bytes))
      return InvalidArgumentError(
          fmt::format("{}: send buffer ({} bytes) is not in the device arena", what, send_bytes));
    if (!device_.Contains(recv, recv_bytes))
      return InvalidArgumentError(fmt::format(
          "{}: receive buffer ({} bytes) is not in the device arena", what, recv_bytes));
    return Status::Ok();
  }

  std::string Describe(const char* what, size_t count, DType type) const {
    return fmt::format("{} of {} {} elements", what, count, DTypeLabel(type));
  }
  std::string Describe(const char* what, size_t count, DType type, ReduceOp op) const {
    return fmt::format("{} ({}) of {} {} elements", what, OpLabel(op), count, DTypeLabel(type));
  }

  // The reduced fp32 values `acc` (count of them) → recv in `type`, averaged
  // for kAvg. acc may alias recv (fp32).
  void Finish(float* acc, void* recv, size_t count, DType type, ReduceOp op) const {
    if (op == ReduceOp::kAvg) {
      const float inv = 1.0f / static_cast<float>(world_);
      for (size_t i = 0; i < count; ++i) acc[i] *= inv;
    }
    if (static_cast<void*>(acc) != recv) host::Cast(acc, DType::kFp32, recv, type, count);
  }

  uint32_t NextTag() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return next_tag_++;
  }

  // Enqueues `body(tag)` on the stream. The tag is taken here, in issue
  // order, which every rank shares.
  template <typename Body>
  Status Enqueue(Stream& stream, std::string what, Body body) EXCLUDES(mu_) {
    uint32_t tag;
    {
      MutexLock lock(&mu_);
      tag = next_tag_++;
      ++pending_;
    }
    Status enqueued = stream.EnqueueHostCallback([this, tag, what = std::move(what), body]() {
      // Bounded by timeout_s, and not a wait on this process: no deadlock.
      internal::HostFunctionWaitsOnPeers();
      Status s;
      if (AsyncError().ok()) {  // else an earlier collective failed: skip
        s = Run(what, [&] { body(tag); });
        if (!s.ok()) STRATA_LOG_ERROR("{}", s.message());
      }
      MutexLock lock(&mu_);
      if (error_.ok() && !s.ok()) error_ = std::move(s);
      --pending_;
      done_cv_.NotifyAll();
    });
    if (!enqueued.ok()) {  // the callback will never run
      MutexLock lock(&mu_);
      --pending_;
    }
    return enqueued;
  }

  // Runs a Gloo call, turning its exceptions into a Status that names the
  // peer (its rank and address) when Gloo's message does.
  template <typename Fn>
  Status Run(const std::string& what, Fn fn) {
    const auto start = std::chrono::steady_clock::now();
    try {
      fn();
      return Status::Ok();
    } catch (const std::exception& e) {
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return UnavailableError(fmt::format(
          "gloo communicator rank {} of {} ({}): {} failed after {:.1f} s: {} exited, stopped "
          "or became unreachable and did not take part within the collective timeout ({:g} s, "
          "STRATA_COMM_TIMEOUT_S); Gloo: {}",
          rank_, world_, hosts_[rank_], what, waited, internal::NamePeer(hosts_, rank_, e.what()),
          timeout_s_, e.what()));
    }
  }

  Device& device_;
  const int rank_;
  const int world_;
  const double timeout_s_;
  const std::vector<std::string> hosts_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  Mutex mu_;
  CondVar done_cv_;
  uint32_t next_tag_ GUARDED_BY(mu_) = 1;  // tag 0: the rendezvous barrier
  int pending_ GUARDED_BY(mu_) = 0;        // collectives enqueued, not yet run
  Status error_ GUARDED_BY(mu_);
};

}  // namespace

std::string GlooRendezvousDir(const CommOptions& options) {
  if (!options.rendezvous_dir.empty()) return options.rendezvous_dir;
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  std::string a = addr ? addr : "localhost";
  for (char& c : a)
    if (c == '/') c = '_';
  return fmt::format("/tmp/strata-gloo-{}-{}", a, port ? port : "0");
}

namespace {

// The local address of the route to `addr`: a UDP socket connected there
// (no packet is sent) is bound by the kernel to the source address it would
// use, the one a peer on that route reaches.
StatusOr<std::string> AddressTowards(const std::string& addr) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(addr.c_str(), "9", &hints, &res); rc != 0)
    return UnavailableError(
        fmt::format("MASTER_ADDR {}: cannot resolve it ({})", addr, gai_strerror(rc)));
  std::string out;
  int err = 0;
  for (addrinfo* a = res; a != nullptr && out.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      err = errno;
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {};
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* bytes =
          local.ss_family == AF_INET6
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
              : &reinterpret_cast<sockaddr_in*>(&local)->sin_addr;
      if (inet_ntop(local.ss_family, bytes, text, sizeof(text)) != nullptr) out = text;
    } else {
      err = errno;
    }
    close(fd);
  }
  freeaddrinfo(res);
  if (out.empty())
    return ErrnoError(fmt::format("MASTER_ADDR {}: no route to it from this machine", addr), err);
  return out;
}

}  // namespace

StatusOr<GlooListen> GlooListenAddress(const CommOptions& options) {
  if (!options.listen_host.empty()) return GlooListen{options.listen_host, ""};
  if (!options.listen_iface.empty()) {
    if (if_nametoindex(options.listen_iface.c_str()) == 0)
      return InvalidArgumentError(fmt::format(
          "gloo: network interface \"{}\" (STRATA_GLOO_IFNAME or GLOO_SOCKET_IFNAME) does not "
          "exist on this machine",
          options.listen_iface));
    return GlooListen{"", options.listen_iface};
  }
  const char* addr = std::getenv("MASTER_ADDR");
  const std::string a = addr ? addr : "";
  if (IsLoopbackName(a)) return GlooListen{"127.0.0.1", ""};
  ASSIGN_OR_RETURN(std::string local, AddressTowards(a));
  return GlooListen{local, ""};
}

std::string GlooListen::Describe() const {
  return iface.empty() ? host : fmt::format("interface {}", iface);
}

std::string GlooListen::Address() const {
  if (iface.empty()) return host;
  ifaddrs* list = nullptr;
  std::string found;
  if (getifaddrs(&list) == 0) {
    for (const ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
      if (a->ifa_addr == nullptr || iface != a->ifa_name) continue;
      char text[INET6_ADDRSTRLEN] = {};
      if (a->ifa_addr->sa_family == AF_INET)
        inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, text,
                  sizeof(text));
      else if (a->ifa_addr->sa_family == AF_INET6)
        inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr, text,
                  sizeof(text));
      found = text;
    }
    freeifaddrs(list);
  }
  return found.empty() ? iface : fmt::format("{} ({})", found, iface);
}

std::string NamePeer(const std::vector<std::string>& hosts, int self, const std::string& error) {
  // Gloo's pair errors end with the peer's address as "[host]:port".
  int match = -1;
  int matches = 0;
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    if (r == self) continue;
    const std::string bare = hosts[r].substr(0, hosts[r].find(' '));
    if (error.find("[" + bare + "]") != std::string::npos) {
      match = r;
      ++matches;
    }
  }
  if (matches != 1 && hosts.size() == 2 && self >= 0 && self < 2) {
    match = 1 - self;  // the only peer
    matches = 1;
  }
  if (matches == 1) return fmt::format("rank {} at {}", match, hosts[match]);
  std::string peers;
  int listed = 0;
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    if (r == self) continue;
    if (listed == 8) {
      peers += ", ...";
      break;
    }
    peers += fmt::format("{}rank {} at {}", listed++ > 0 ? ", " : "", r, hosts[r]);
  }
  return fmt::format("a peer rank ({})", peers);
}

namespace {

// Gloo's store interface over a RendezvousStore, every key under `prefix`.
// Gloo's calls throw; the keys this rank set are removed by RemoveOwnKeys
// once every rank has read them.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(RendezvousStore& store, std::string prefix, double timeout_s)
      : store_(store), prefix_(std::move(prefix)), timeout_s_(timeout_s) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    const std::string k = prefix_ + key;
    Status st = store_.Set(k, std::string(data.begin(), data.end()));
    if (!st.ok()) throw std::runtime_error("rendezvous store: set " + k + ": " + st.ToString());
    own_.insert(k);
  }
  std::vector<char> get(const std::string& key) override {
    const std::string v = Fetch(key, timeout_s_);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override {
    for (const std::string& k : keys) Fetch(k, timeout_s_);
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    for (const std::string& k : keys) Fetch(k, static_cast<double>(timeout.count()) / 1e3);
  }
  void RemoveOwnKeys() {
    for (const std::string& k : own_) store_.Remove(k).IgnoreError();
    own_.clear();
  }

 private:
  std::string Fetch(const std::string& key, double timeout_s) {
    const std::string k = prefix_ + key;
    StatusOr<std::string> v = store_.Get(k, timeout_s);
    if (!v.ok())
      throw std::runtime_error("rendezvous store: get " + k + ": " + v.status().ToString());
    return *std::move(v);
  }

  RendezvousStore& store_;
  const std::string prefix_;
  const double timeout_s_;
  std::set<std::string> own_;
};

}  // namespace

// A write to the socket of a peer that has died raises SIGPIPE, whose
// default action ends this process silently; the collective must fail with
// its error instead. The default disposition is replaced by SIG_IGN (once,
// logged); a handler the program installed is left alone.
static void IgnoreSigpipe() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) != 0 || old.sa_handler != SIG_DFL) return;
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  if (sigaction(SIGPIPE, &ign, nullptr) == 0)
    STRATA_LOG_INFO(
        "gloo communicator: SIGPIPE ignored (a dead peer's socket fails the collective instead of "
        "ending this process)");
}

StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(Device& device,
                                                               const CommOptions& options) {
  if (!(options.timeout_s > 0))
    return InvalidArgumentError(
        fmt::format("communicator: timeout_s {} must be positive", options.timeout_s));
  if (!(options.connect_timeout_s >= 0))
    return InvalidArgumentError(
        fmt::format("communicator: connect_timeout_s {} must be positive (or 0: timeout_s)",
                    options.connect_timeout_s));
  const double connect_s = ConnectTimeoutS(options);
  // Each rendezvous through a caller's store has keys of its own: every
  // rank creates its communicators in the same order, so the n-th one of
  // each rank meets under the same prefix.
  static std::atomic<int> store_rendezvous{0};
  const bool use_store = options.store != nullptr;
  const std::string prefix =
      use_store ? fmt::format("strata/gloo/{}/", store_rendezvous.fetch_add(1)) : std::string();
  const std::string dir = use_store ? std::string() : GlooRendezvousDir(options);
  const std::string through =
      use_store ? fmt::format("the rendezvous store (keys {}*)", prefix) : dir;
  ASSIGN_OR_RETURN(const GlooListen listen, GlooListenAddress(options));
  const std::string host = listen.Describe();
  const std::string address = listen.Address();  // published for the peers' errors
  if (!use_store) {
    // The store's files name the peers every rank connects to: the
    // directory must be this user's alone (not a symlink, not writable by
    // others), or another user could plant an address. The default one
    // under /tmp is created with mode 0700; a directory given is created
    // the same way when missing and checked either way.
    Status private_dir = options.rendezvous_dir.empty()
                             ? MakePrivateDir(dir, "gloo rendezvous directory").status()
                             : MakeDirs(dir, "STRATA_GLOO_DIR");
    if (private_dir.ok() && !options.rendezvous_dir.empty())
      private_dir = CheckPrivateDir(dir, "STRATA_GLOO_DIR");
    if (!private_dir.ok()) return private_dir.WithContext("gloo rendezvous");
  }
  IgnoreSigpipe();
  using Clock = std::chrono::steady_clock;
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(connect_s * 1e3));
  auto until = [](Clock::time_point end) {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()));
  };
  auto left = [&] { return until(deadline); };
  // One attempt may block at most this long (connecting, the secrets'
  // exchange): a rank whose connection went to a stranger, or to a peer that
  // has left the attempt, can wait on it without an error, and the others
  // wait for its verdict, so without a bound one such rank holds every rank
  // until the deadline instead of starting the next attempt.
  const auto per_attempt =
      std::chrono::milliseconds(static_cast<int64_t>(std::clamp(connect_s / 4, 10.0, 60.0) * 1e3));
  std::string last_error;
  int attempts = 0;
  try {
    // One store for every attempt, so that the entries of all of them are
    // removed at the end.
    std::unique_ptr<gloo::rendezvous::FileStore> files;
    std::unique_ptr<StoreAdapter> adapter;
    if (use_store)
      adapter = std::make_unique<StoreAdapter>(*options.store, prefix, connect_s);
    else
      files = std::make_unique<gloo::rendezvous::FileStore>(dir);
    gloo::rendezvous::Store& base =
        use_store ? static_cast<gloo::rendezvous::Store&>(*adapter) : *files;
    std::random_device entropy;
    for (int attempt = 0; Clock::now() < deadline; ++attempt) {
      attempts = attempt + 1;
      gloo::rendezvous::PrefixStore store(fmt::format("attempt-{}", attempt), base);
      const Clock::time_point attempt_end = std::min(deadline, Clock::now() + per_attempt);
      std::shared_ptr<gloo::rendezvous::Context> context;
      bool ok = false;
      try {
        gloo::transport::tcp::attr attr;
        attr.hostname = listen.host;
        attr.iface = listen.iface;
        auto dev = gloo::transport::tcp::CreateDevice(attr);
        store.set(fmt::format("host-{}", options.rank),
                  std::vector<char>(address.begin(), address.end()));
        std::vector<char> secret(32);
        for (char& c : secret) c = static_cast<char>(entropy());
        store.set(fmt::format("secret-{}", options.rank), secret);
        context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
        // Gloo waits up to 5 times the context's timeout for a pair to
        // connect (tcp/pair.h), once that for the store and the exchange.
        context->setTimeout(std::max(std::chrono::milliseconds(1), until(attempt_end) / 5));
        context->connectFullMesh(store, dev);
        // Identity: every peer sends the secret it wrote to the directory.
        std::vector<char> all(secret.size() * static_cast<size_t>(options.world_size));
        gloo::AllgatherOptions gather(context);
        gather.setInput(secret.data(), secret.size());
        gather.setOutput(all.data(), all.size());
        gather.setTag(1);
        gloo::allgather(gather);
        ok = true;
        for (int r = 0; r < options.world_size && ok; ++r) {
          const std::string key = fmt::format("secret-{}", r);
          store.wait({key}, until(attempt_end));
          const std::vector<char> want = store.get(key);
          if (!std::equal(want.begin(), want.end(), all.begin() + r * secret.size(),
                          all.begin() + (r + 1) * secret.size())) {
            ok = false;
            last_error = fmt::format(
                "the peer connected as rank {} did not send the secret rank {} wrote to the "
                "rendezvous directory (a stranger's connection): connections dropped",
                r, r);
          }
        }
      } catch (const std::exception& e) {
        last_error = e.what();
      }
      if (!ok) {
        // Close this attempt's sockets at once: the peers still inside it
        // then fail fast instead of waiting out the timeout.
        context.reset();
        STRATA_LOG_WARN(
            "gloo rendezvous: rank {} of {}, attempt {} failed ({}); trying again on new ports",
            options.rank, options.world_size, attempt + 1, last_error);
      }
      store.set(fmt::format("verdict-{}", options.rank), std::vector<char>{ok ? 'y' : 'n'});
      bool all_ok = ok;
      for (int r = 0; r < options.world_size; ++r) {
        const std::string key = fmt::format("verdict-{}", r);
        store.wait({key}, left());
        if (store.get(key) != std::vector<char>{'y'}) all_ok = false;
      }
      if (!all_ok) continue;
      std::vector<std::string> hosts;
      for (int r = 0; r < options.world_size; ++r) {
        const std::vector<char> h = store.get(fmt::format("host-{}", r));
        hosts.emplace_back(h.begin(), h.end());
      }
      // Everyone has read every entry once all are past this barrier; then
      // each rank removes the entries its store wrote or read (a peer may
      // have removed one already).
      gloo::BarrierOptions barrier(context);
      barrier.setTag(0);
      gloo::barrier(barrier);
      std::error_code ec;
      if (files != nullptr)
        for (const std::string& path : files->getAllKeyFilePaths())
          std::filesystem::remove(path, ec);
      if (adapter != nullptr) adapter->RemoveOwnKeys();
      STRATA_LOG_INFO(
          "gloo communicator: rank {} of {} connected (listening on {}, rendezvous through {}{})",
          options.rank, options.world_size, host, through,
          attempt > 0 ? fmt::format(", attempt {}", attempt + 1) : std::string());
      context->setTimeout(std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1e3)));
      return std::unique_ptr<Communicator>(std::make_unique<GlooCommunicator>(
          device, options, std::move(context), std::move(hosts)));
    }
  } catch (const std::exception& e) {
    last_error = e.what();
  }
  return UnavailableError(fmt::format(
      "gloo rendezvous: rank {} of {} could not connect to its peers within {:g} s through {} "
      "(listening on {}, {} attempt(s); are all ranks started with the same "
      "MASTER_ADDR/MASTER_PORT or STRATA_GLOO_DIR, and do the peers reach this address? "
      "STRATA_GLOO_HOST or STRATA_GLOO_IFNAME choose it): {}",
      options.rank, options.world_size, connect_s, through, host, attempts,
      last_error.empty() ? "timed out" : last_error));
}

}  // namespace strata::gpu::internal
