// Internal to src/gpu: the cudaError_t → Status mapping of cuda_device.cc,
// exposed with an int so that it can be tested without <cuda_runtime.h> and
// without a GPU (cudaGetErrorName/String need no driver). CUDA builds only.
#pragma once

#include <string_view>

#include "strata/status.h"

namespace strata::gpu::internal {

// `err` is a cudaError_t value. OK for cudaSuccess (0).
Status CudaErrorToStatus(int err, std::string_view call);

}  // namespace strata::gpu::internal
