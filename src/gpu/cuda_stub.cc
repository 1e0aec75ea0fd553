// CPU-only build (no nvcc at configure time): the CUDA factories say so.
// NCCL's net_ib_stub.cc pattern — the interface exists, the backend does not.
#include "src/gpu/device.h"

namespace strata::gpu {

StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const DeviceOptions&) {
  return NotSupportedError(
      "CUDA device: this build of Strata has no CUDA support (nvcc was not "
      "found at configure time; set CUDA_HOME and rebuild)");
}

CudaDeviceList ListCudaDevices() { return {{}, "built without CUDA"}; }

}  // namespace strata::gpu
