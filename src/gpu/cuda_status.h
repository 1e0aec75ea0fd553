// Internal to src/gpu: the cudaError_t → Status mapping of cuda_device.cc and
// the "is there a GPU at all" classification of device=auto, exposed with ints
// so that they can be tested without <cuda_runtime.h> and without a GPU
// (cudaGetErrorName/String need no driver). CUDA builds only.
#pragma once

#include <string_view>

#include "strata/status.h"

namespace strata::gpu::internal {

// `err` is a cudaError_t value. OK for cudaSuccess (0). Unavailable only for
// cudaErrorNoDevice; a driver that is too old or mismatched is
// FailedPrecondition (a GPU is there, this process cannot use it).
Status CudaErrorToStatus(int err, std::string_view call);

// What cudaGetDeviceCount's answer means for device selection.
enum class CudaPresence {
  kPresent,   // at least one device (count > 0)
  kNoDevice,  // no GPU on this machine: device=auto may use the host device
  kUnusable,  // a GPU or a driver is there but this process cannot use it
};
// Pure: `err` is cudaGetDeviceCount's cudaError_t, `count` what it returned,
// `driver_version` cudaDriverGetVersion's answer (0 when no driver library is
// installed). No device is cudaErrorNoDevice, a count of 0, or
// cudaErrorInsufficientDriver with no driver at all (driver version 0: what a
// machine without the NVIDIA driver answers). Every other error —
// cudaErrorInsufficientDriver with a driver older than the runtime,
// cudaErrorSystemDriverMismatch, cudaErrorInitializationError, ... — is
// kUnusable: falling back would report host numbers as GPU numbers.
CudaPresence ClassifyCudaPresence(int err, int count, int driver_version);

}  // namespace strata::gpu::internal
