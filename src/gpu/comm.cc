// Communicator selection (NCCL on a CUDA device, Gloo on the host device with
// several ranks, else the one-rank local communicator), torchrun-style
// environment parsing, the unique-id exchange through a file.
#include <fmt/format.h>
#include <net/if.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <thread>

#include "src/common/log.h"
#include "src/common/rank_env.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/gpu/comm_internal.h"
#include "src/gpu/device.h"

namespace strata::gpu {
namespace {

// world_size == 1: every collective is a copy (or nothing) on the stream.
class LocalCommunicator final : public Communicator {
 public:
  explicit LocalCommunicator(Device& d) : device_(d) {}
  int rank() const override { return 0; }
  int world_size() const override { return 1; }

  Status AllGather(const void* send, void* recv, size_t count, DType type,
                   Stream& stream) override {
    return Copy(send, recv, count, type, stream, "AllGather");
  }
  Status ReduceScatter(const void* send, void* recv, size_t count, DType type, ReduceOp,
                       Stream& stream) override {
    return Copy(send, recv, count, type, stream, "ReduceScatter");  // sum/avg/min/max of one
  }
  Status AllReduce(const void* send, void* recv, size_t count, DType type, ReduceOp,
                   Stream& stream) override {
    return Copy(send, recv, count, type, stream, "AllReduce");
  }
  Status Reduce(const void* send, void* recv, size_t count, DType type, ReduceOp, int root,
                Stream& stream) override {
    if (root != 0)
      return InvalidArgumentError(fmt::format("Reduce: root {} but world size is 1", root));
    return Copy(send, recv, count, type, stream, "Reduce");
  }
  Status Broadcast(const void* send, void* recv, size_t count, DType type, int root,
                   Stream& stream) override {
    if (root != 0)
      return InvalidArgumentError(fmt::format("Broadcast: root {} but world size is 1", root));
    return Copy(send, recv, count, type, stream, "Broadcast");
  }

 private:
  Status Copy(const void* send, void* recv, size_t count, DType type, Stream& stream,
              const char* what) {
    if (count == 0) return Status::Ok();
    if (send == recv) {
      // In place: nothing moves, but the arguments are still checked.
      if (!device_.Contains(send, count * DTypeSize(type)))
        return InvalidArgumentError(fmt::format("{}: buffer is not in the device arena", what));
      return Status::Ok();
    }
    return device_.CopyD2D(recv, send, count * DTypeSize(type), stream).WithContext(what);
  }
  Device& device_;
};

}  // namespace

StatusOr<CommOptions> CommOptionsFromEnv() {
  CommOptions o;
  ASSIGN_OR_RETURN(const RankEnv ranks, ReadRankEnv());
  o.rank = ranks.rank;
  o.world_size = ranks.world_size;
  o.local_rank = ranks.local_rank;
  o.local_world_size = ranks.local_world_size;
  if (const char* v = std::getenv("STRATA_NCCL_ID_FILE"); v != nullptr) o.unique_id_file = v;
  o.unique_id_file = internal::UniqueIdPath(o);
  if (const char* v = std::getenv("STRATA_GLOO_DIR"); v != nullptr) o.rendezvous_dir = v;
  if (const char* v = std::getenv("STRATA_GLOO_HOST"); v != nullptr) o.listen_host = v;
  // The interface, as torch's Gloo and NCCL users name it. NCCL's variable
  // also takes prefixes and lists ("eth", "^docker", "=eth0,eth1"): only a
  // value that names one interface exactly is taken from it.
  for (const char* name : {"STRATA_GLOO_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    const bool nccl = std::string_view(name) == "NCCL_SOCKET_IFNAME";
    if (nccl && if_nametoindex(v) == 0) continue;
    if (std::string_view(v).find_first_of(",^=") != std::string_view::npos)
      return InvalidArgumentError(fmt::format(
          "environment {}=\"{}\": Strata's Gloo listens on one interface; name it exactly "
          "(no list or prefix)",
          name, v));
    o.listen_iface = v;
    break;
  }
  for (auto [name, field] : {std::pair{"STRATA_COMM_TIMEOUT_S", &o.timeout_s},
                             std::pair{"STRATA_COMM_CONNECT_TIMEOUT_S", &o.connect_timeout_s}}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    char* end = nullptr;
    errno = 0;
    const double t = std::strtod(v, &end);
    if (errno != 0 || *end != '\0' || !(t > 0) || t > 1e6)
      return InvalidArgumentError(fmt::format(
          "environment {}=\"{}\" is not a positive number of seconds (at most 1e6)", name, v));
    *field = t;
  }
  return o;
}

StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(Device& device,
                                                           const CommOptions& options) {
  if (options.world_size < 1)
    return InvalidArgumentError(
        fmt::format("communicator: CommOptions.world_size (WORLD_SIZE) is {}, must be at least 1",
                    options.world_size));
  if (options.rank < 0 || options.rank >= options.world_size)
    return InvalidArgumentError(
        fmt::format("communicator: CommOptions.rank (RANK) is {}, must be in [0, world_size {})",
                    options.rank, options.world_size));
  if (!device.is_host() && internal::HaveNccl()) {
    // One rank needs no NCCL: when libnccl cannot be loaded (logged once
    // with the reason), its collectives are local copies, as in a build
    // without NCCL. Several ranks fail with the loader's Status.
    if (options.world_size > 1 || internal::LoadNcclLibrary().ok())
      return internal::CreateNcclCommunicator(device, options);
    return std::unique_ptr<Communicator>(std::make_unique<LocalCommunicator>(device));
  }
  if (options.world_size == 1) {
    if (!device.is_host())
      STRATA_WARN_ONCE("gpu.comm_local",
                       "communicator: built without NCCL; one rank, collectives are local copies");
    return std::unique_ptr<Communicator>(std::make_unique<LocalCommunicator>(device));
  }
  if (device.is_host()) return internal::CreateGlooCommunicator(device, options);
  return NotSupportedError(fmt::format(
      "communicator: world size {} on {} needs NCCL (NCCL in this build: {}), or the host device "
      "(Gloo)",
      options.world_size, device.Describe(), internal::HaveNccl() ? "yes" : "no"));
}

namespace internal {

std::string UniqueIdPath(const CommOptions& options) {
  if (!options.unique_id_file.empty()) return options.unique_id_file;
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  std::string a = addr ? addr : "localhost";
  for (char& c : a)
    if (c == '/') c = '_';
  return fmt::format("/tmp/strata-nccl-{}-{}.id", a, port ? port : "0");
}

Status WriteUniqueId(const std::string& path, const UniqueId& id) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return ErrnoError("writing the NCCL unique id to " + tmp, errno);
    f.write(id.data(), static_cast<std::streamsize>(id.size()));
    f.flush();
    if (!f) return ErrnoError("writing the NCCL unique id to " + tmp, errno);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return ErrnoError(fmt::format("renaming {} to {}", tmp, path), errno);
  return Status::Ok();
}

StatusOr<UniqueId> ReadUniqueId(const std::string& path, double timeout_s) {
  Stopwatch sw;
  for (;;) {
    std::ifstream f(path, std::ios::binary);
    if (f) {
      UniqueId id{};
      f.read(id.data(), static_cast<std::streamsize>(id.size()));
      if (f.gcount() == static_cast<std::streamsize>(id.size())) return id;
    }
    if (sw.Seconds() > timeout_s)
      return UnavailableError(fmt::format(
          "waited {:.0f} s for rank 0 to write the NCCL unique id to {} (shared filesystem? same "
          "MASTER_ADDR/MASTER_PORT on every rank?)",
          timeout_s, path));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string UniqueIdToHex(const UniqueId& id) {
  std::string s;
  s.reserve(id.size() * 2);
  for (char c : id) s += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return s;
}

StatusOr<std::optional<UniqueId>> UniqueIdFromEnv() {
  const char* v = std::getenv("STRATA_NCCL_UNIQUE_ID");
  if (v == nullptr || *v == '\0') return std::optional<UniqueId>();
  const std::string hex(v);
  if (hex.size() != 2 * kUniqueIdBytes)
    return InvalidArgumentError(
        fmt::format("environment STRATA_NCCL_UNIQUE_ID has {} characters, expected {} hex digits",
                    hex.size(), 2 * kUniqueIdBytes));
  UniqueId id{};
  for (size_t i = 0; i < kUniqueIdBytes; ++i) {
    unsigned byte = 0;
    if (std::sscanf(hex.c_str() + 2 * i, "%2x", &byte) != 1 ||
        !std::isxdigit(static_cast<unsigned char>(hex[2 * i])) ||
        !std::isxdigit(static_cast<unsigned char>(hex[2 * i + 1])))
      return InvalidArgumentError(
          fmt::format("environment STRATA_NCCL_UNIQUE_ID: not a hex digit at position {}", 2 * i));
    id[i] = static_cast<char>(byte);
  }
  return std::optional<UniqueId>(id);
}

}  // namespace internal
}  // namespace strata::gpu
