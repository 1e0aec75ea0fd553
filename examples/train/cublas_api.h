// cuBLAS for the example's CUDA backend, opened at run time: libcublas (with
// libcublasLt, which it needs, about 700 MiB of address space together) is
// not linked, so that a process that never runs a GEMM on a GPU does not map
// it. It is opened with dlopen when the first CUDA backend is created, and
// the handful of functions the backend calls are bound from it. Built when
// STRATA_HAVE_CUDA. (examples/ uses the public API alone, so this is its own
// small loader rather than src/common/shared_library.h.)
#pragma once

#include <cublas_v2.h>

#include <string>
#include <type_traits>

#include "strata/status.h"

namespace strata::example {

// The cuBLAS functions the backend calls. cublas_v2.h maps cublasCreate and
// friends to their _v2 symbols; these are bound by those names.
struct CublasApi {
  decltype(&cublasCreate) Create = nullptr;
  decltype(&cublasDestroy) Destroy = nullptr;
  decltype(&cublasSetStream) SetStream = nullptr;
  decltype(&cublasSetMathMode) SetMathMode = nullptr;
  // cublasGemmEx with a cublasComputeType_t (C++ also sees an inline
  // overload taking a cudaDataType, which calls this one).
  using GemmExFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int,
                                      int, int, const void*, const void*, cudaDataType, int,
                                      const void*, cudaDataType, int, const void*, void*,
                                      cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
  GemmExFn GemmEx = nullptr;
};
// The header declares that overload with exactly this type (unevaluated: no
// reference to the symbol).
static_assert(
    std::is_same_v<CublasApi::GemmExFn, decltype(static_cast<CublasApi::GemmExFn>(&cublasGemmEx))>);

// The soname of the cuBLAS these headers are from ("libcublas.so.13").
std::string CublasSoname();

// The process's cuBLAS: opened on the first call (thread-safe), never
// closed; later calls return the first answer. On failure, Unavailable (or
// ResourceExhausted when RLIMIT_AS is finite and the loader could not map
// the library) naming the library and dlerror(), the same Status for every
// caller (the example logs nothing; `strata train` prints it once, as it ends).
StatusOr<const CublasApi*> Cublas();

// What Cublas() does, for `soname` and without caching: for tests.
Status ProbeCublasLibrary(const std::string& soname);

}  // namespace strata::example
