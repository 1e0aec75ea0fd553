// Builds without CUDA: the example model has only its host backend.
#include "examples/train/model.h"

namespace strata::example {

StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const ModelShape&, DType, void*, WorkspaceFn) {
  return NotSupportedError("the example model's CUDA backend is not built (configure with CUDA to use a GPU)");
}

}  // namespace strata::example
