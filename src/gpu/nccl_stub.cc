// Builds without NCCL: multi-rank communicators are NotSupported.
#include "src/gpu/comm_internal.h"

namespace strata::gpu::internal {

bool HaveNccl() { return false; }

Status LoadNcclLibrary() {
  return NotSupportedError("NCCL communicator: this build of Strata has no NCCL");
}
Status ProbeNcclLibrary(const std::string&) { return LoadNcclLibrary(); }

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Device&, const CommOptions&) {
  return NotSupportedError("NCCL communicator: this build of Strata has no NCCL");
}

}  // namespace strata::gpu::internal
