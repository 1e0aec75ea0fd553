// NCCL communicator (built when STRATA_HAVE_NCCL). Rank 0 creates the unique
// id and publishes it through a file (or every rank reads it from
// STRATA_NCCL_UNIQUE_ID); ncclCommInitRank joins. Collectives are enqueued on
// the given CUDA stream. ncclResult_t becomes a Status in NcclStatus.
//
// libnccl is not linked: it is opened with dlopen at the first NCCL
// communicator (NcclLibrary), and every call goes through the table of the
// functions used here. nccl.h is included for its types only; a direct call
// of an nccl* function would not link.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include "src/common/log.h"
#include "src/common/shared_library.h"
#include "src/common/status_util.h"
#include "src/gpu/comm_internal.h"

namespace strata::gpu::internal {
namespace {

static_assert(sizeof(ncclUniqueId) == kUniqueIdBytes, "NCCL unique id size changed");

#define STRATA_STR2(x) #x
#define STRATA_STR(x) STRATA_STR2(x)
// The soname of the NCCL these headers are from: "libnccl.so.2".
constexpr const char* kNcclSoname = "libnccl.so." STRATA_STR(NCCL_MAJOR);

// The NCCL functions this file calls, bound by name from the library.
struct NcclApi {
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRank) CommInitRank = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclAllGather) AllGather = nullptr;
  decltype(&ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&ncclAllReduce) AllReduce = nullptr;
  decltype(&ncclReduce) Reduce = nullptr;
  decltype(&ncclBroadcast) Broadcast = nullptr;
};

StatusOr<NcclApi> BindNccl(const std::string& soname, const std::string& fallback_dir) {
  ASSIGN_OR_RETURN(SharedLibrary lib, SharedLibrary::Open("NCCL", soname, fallback_dir));
  NcclApi a;
  RETURN_IF_ERROR(lib.Bind(&a.GetErrorString, "ncclGetErrorString"));
  RETURN_IF_ERROR(lib.Bind(&a.GetUniqueId, "ncclGetUniqueId"));
  RETURN_IF_ERROR(lib.Bind(&a.CommInitRank, "ncclCommInitRank"));
  RETURN_IF_ERROR(lib.Bind(&a.CommDestroy, "ncclCommDestroy"));
  RETURN_IF_ERROR(lib.Bind(&a.AllGather, "ncclAllGather"));
  RETURN_IF_ERROR(lib.Bind(&a.ReduceScatter, "ncclReduceScatter"));
  RETURN_IF_ERROR(lib.Bind(&a.AllReduce, "ncclAllReduce"));
  RETURN_IF_ERROR(lib.Bind(&a.Reduce, "ncclReduce"));
  RETURN_IF_ERROR(lib.Bind(&a.Broadcast, "ncclBroadcast"));
  return a;
}

// The process's NCCL, opened on the first call (thread-safe); a failure is
// logged once and returned to every caller.
const StatusOr<NcclApi>& Nccl() {
  static const StatusOr<NcclApi>* api = [] {
    auto* a = new StatusOr<NcclApi>(BindNccl(kNcclSoname, STRATA_NCCL_LIBRARY_DIR));
    if (!a->ok())
      STRATA_WARN_ONCE("gpu.nccl_load", "NCCL communicators are unavailable: {}",
                       a->status().message());
    return a;
  }();
  return *api;
}

// REQUIRES: Nccl().ok() (every NcclCommunicator was made after it loaded).
const NcclApi& Api() { return *Nccl(); }

Status NcclStatus(ncclResult_t r, std::string_view call) {
  if (r == ncclSuccess) return Status::Ok();
  std::string msg = fmt::format("{}: {}", call, Api().GetErrorString(r));
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return InvalidArgumentError(std::move(msg));
    case ncclInProgress:
      return UnavailableError(std::move(msg));
    default:
      return IOError(std::move(msg));
  }
}

StatusOr<ncclDataType_t> NcclType(DType t) {
  switch (t) {
    case DType::kFp32:
      return ncclFloat32;
    case DType::kFp16:
      return ncclFloat16;
    case DType::kBf16:
      return ncclBfloat16;
  }
  return InvalidArgumentError("NCCL: unknown dtype");
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kAvg:
      return ncclAvg;
  }
  return ncclSum;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Device& d, ncclComm_t c, int rank, int world, std::string id_file)
      : device_(d), comm_(c), rank_(rank), world_(world), id_file_(std::move(id_file)) {}
  ~NcclCommunicator() override {
    cudaSetDevice(device_.ordinal());
    Api().CommDestroy(comm_);
    if (rank_ == 0 && !id_file_.empty()) std::remove(id_file_.c_str());
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  Status AllGather(const void* send, void* recv, size_t count, DType type,
                   Stream& stream) override {
    RETURN_IF_ERROR(Check(send, count * DTypeSize(type), "AllGather send"));
    RETURN_IF_ERROR(Check(recv, count * DTypeSize(type) * world_, "AllGather recv"));
    ASSIGN_OR_RETURN(ncclDataType_t t, NcclType(type));
    return NcclStatus(Api().AllGather(send, recv, count, t, comm_, Native(stream)),
                      "ncclAllGather");
  }
  Status ReduceScatter(const void* send, void* recv, size_t count, DType type, ReduceOp op,
                       Stream& stream) override {
    RETURN_IF_ERROR(Check(send, count * DTypeSize(type) * world_, "ReduceScatter send"));
    RETURN_IF_ERROR(Check(recv, count * DTypeSize(type), "ReduceScatter recv"));
    ASSIGN_OR_RETURN(ncclDataType_t t, NcclType(type));
    return NcclStatus(Api().ReduceScatter(send, recv, count, t, NcclOp(op), comm_, Native(stream)),
                      "ncclReduceScatter");
  }
  Status AllReduce(const void* send, void* recv, size_t count, DType type, ReduceOp op,
                   Stream& stream) override {
    RETURN_IF_ERROR(Check(send, count * DTypeSize(type), "AllReduce send"));
    RETURN_IF_ERROR(Check(recv, count * DTypeSize(type), "AllReduce recv"));
    ASSIGN_OR_RETURN(ncclDataType_t t, NcclType(type));
    return NcclStatus(Api().AllReduce(send, recv, count, t, NcclOp(op), comm_, Native(stream)),
                      "ncclAllReduce");
  }
  Status Reduce(const void* send, void* recv, size_t count, DType type, ReduceOp op, int root,
                Stream& stream) override {
    if (root < 0 || root >= world_)
      return InvalidArgumentError(fmt::format("Reduce: root {} not in [0, {})", root, world_));
    RETURN_IF_ERROR(Check(send, count * DTypeSize(type), "Reduce send"));
    if (rank_ == root) RETURN_IF_ERROR(Check(recv, count * DTypeSize(type), "Reduce recv"));
    ASSIGN_OR_RETURN(ncclDataType_t t, NcclType(type));
    return NcclStatus(Api().Reduce(send, recv, count, t, NcclOp(op), root, comm_, Native(stream)),
                      "ncclReduce");
  }
  Status Broadcast(const void* send, void* recv, size_t count, DType type, int root,
                   Stream& stream) override {
    if (root < 0 || root >= world_)
      return InvalidArgumentError(fmt::format("Broadcast: root {} not in [0, {})", root, world_));
    if (rank_ == root) RETURN_IF_ERROR(Check(send, count * DTypeSize(type), "Broadcast send"));
    RETURN_IF_ERROR(Check(recv, count * DTypeSize(type), "Broadcast recv"));
    ASSIGN_OR_RETURN(ncclDataType_t t, NcclType(type));
    return NcclStatus(Api().Broadcast(send, recv, count, t, root, comm_, Native(stream)),
                      "ncclBroadcast");
  }

 private:
  Status Check(const void* p, size_t bytes, const char* what) {
    if (bytes == 0) return Status::Ok();
    if (!device_.Contains(p, bytes))
      return InvalidArgumentError(
          fmt::format("{}: [{}, +{} bytes) is not in the device arena", what, p, bytes));
    if (cudaSetDevice(device_.ordinal()) != cudaSuccess)
      return IOError(fmt::format("{}: cudaSetDevice({}) failed", what, device_.ordinal()));
    return Status::Ok();
  }
  static cudaStream_t Native(Stream& s) { return static_cast<cudaStream_t>(s.native_handle()); }

  Device& device_;
  ncclComm_t comm_;
  const int rank_, world_;
  const std::string id_file_;
};

}  // namespace

bool HaveNccl() { return true; }

Status LoadNcclLibrary() { return Nccl().status(); }

Status ProbeNcclLibrary(const std::string& soname) { return BindNccl(soname, "").status(); }

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Device& device,
                                                               const CommOptions& options) {
  if (device.is_host()) return NotSupportedError("NCCL communicator needs a CUDA device");
  RETURN_IF_ERROR(LoadNcclLibrary());
  ASSIGN_OR_RETURN(std::optional<UniqueId> env_id, UniqueIdFromEnv());
  UniqueId id{};
  std::string id_file;
  // Through a caller's store, the n-th communicator of every rank meets
  // under the same key (each rank creates them in the same order).
  static std::atomic<int> store_ids{0};
  const std::string store_key =
      options.store != nullptr ? fmt::format("strata/nccl/{}/id", store_ids.fetch_add(1)) : "";
  if (env_id) {
    id = *env_id;
  } else if (options.store != nullptr && options.world_size > 1 && options.rank != 0) {
    ASSIGN_OR_RETURN(std::string bytes, options.store->Get(store_key, ConnectTimeoutS(options)));
    if (bytes.size() != kUniqueIdBytes)
      return DataLossError(fmt::format("rendezvous store key {}: {} bytes, an NCCL id has {}",
                                       store_key, bytes.size(), kUniqueIdBytes));
    std::memcpy(id.data(), bytes.data(), kUniqueIdBytes);
  } else if (options.rank == 0) {
    ncclUniqueId nid;
    RETURN_IF_ERROR(NcclStatus(Api().GetUniqueId(&nid), "ncclGetUniqueId"));
    std::memcpy(id.data(), &nid, kUniqueIdBytes);
    if (options.world_size > 1 && options.store != nullptr) {
      RETURN_IF_ERROR(options.store->Set(store_key, std::string(id.data(), id.size())));
    } else if (options.world_size > 1) {
      id_file = UniqueIdPath(options);
      RETURN_IF_ERROR(WriteUniqueId(id_file, id));
    }
  } else {
    ASSIGN_OR_RETURN(id, ReadUniqueId(UniqueIdPath(options), ConnectTimeoutS(options)));
  }
  ncclUniqueId nid;
  std::memcpy(&nid, id.data(), kUniqueIdBytes);
  if (cudaSetDevice(device.ordinal()) != cudaSuccess)
    return IOError(fmt::format("NCCL init: cudaSetDevice({}) failed", device.ordinal()));
  ncclComm_t comm = nullptr;
  RETURN_IF_ERROR(
      NcclStatus(Api().CommInitRank(&comm, options.world_size, nid, options.rank),
                 fmt::format("ncclCommInitRank(rank {} of {})", options.rank, options.world_size)));
  return std::unique_ptr<Communicator>(
      std::make_unique<NcclCommunicator>(device, comm, options.rank, options.world_size, id_file));
}

}  // namespace strata::gpu::internal
