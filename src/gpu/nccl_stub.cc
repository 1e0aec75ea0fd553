// Builds without NCCL: multi-rank communicators are NotSupported.
#include "src/gpu/comm_internal.h"

namespace strata::gpu::internal {

bool HaveNccl() { return false; }

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Device&, const CommOptions&) {
  return NotSupportedError("NCCL communicator: this build of Strata has no NCCL");
}

}  // namespace strata::gpu::internal
