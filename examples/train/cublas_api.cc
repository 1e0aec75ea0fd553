// dlopen of cuBLAS for the example's CUDA backend. See cublas_api.h.
#include "examples/train/cublas_api.h"

#include <dlfcn.h>
#include <sys/resource.h>

#include <memory>
#include <string>

namespace strata::example {
namespace {

#define STRATA_EXAMPLE_STR2(x) #x
#define STRATA_EXAMPLE_STR(x) STRATA_EXAMPLE_STR2(x)

std::string LastDlError() {
  const char* e = dlerror();
  return e != nullptr ? std::string(e) : std::string("unknown error");
}

// Binds `*fn` to `symbol` (a name with cublas_v2.h's macros expanded).
template <typename F>
Status Bind(void* lib, const std::string& path, F** fn, const char* symbol) {
  dlerror();
  void* p = dlsym(lib, symbol);
  if (p == nullptr)
    return UnavailableError("cuBLAS: " + path + " has no symbol " + symbol + ": " + LastDlError());
  *fn = reinterpret_cast<F*>(p);
  return Status();
}

StatusOr<CublasApi> Open(const std::string& soname, const std::string& fallback_dir) {
  std::string errors;
  bool unmappable = false;
  void* lib = nullptr;
  std::string path;
  for (const std::string& p : {soname, fallback_dir.empty() ? "" : fallback_dir + "/" + soname}) {
    if (p.empty()) continue;
    dlerror();
    lib = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) {
      path = p;
      break;
    }
    const std::string e = LastDlError();
    // The loader's words for a mapping the kernel refused (ENOMEM).
    unmappable = unmappable || e.find("failed to map segment") != std::string::npos ||
                 e.find("annot allocate memory") != std::string::npos;
    errors += (errors.empty() ? "" : "; ") + ("dlopen(\"" + p + "\"): " + e);
  }
  if (lib == nullptr) {
    rlimit rl{};
    if (unmappable && getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
      return ResourceExhaustedError("cuBLAS could not be loaded: " + errors +
                                    "; RLIMIT_AS (`ulimit -v`) is " + std::to_string(rl.rlim_cur) +
                                    " bytes: raise the limit to use the CUDA backend");
    return UnavailableError("cuBLAS could not be loaded: " + errors);
  }
  // Never dlclose'd: cuBLAS keeps threads and exit handlers of its own.
  CublasApi a;
  STRATA_RETURN_IF_ERROR(Bind(lib, path, &a.Create, STRATA_EXAMPLE_STR(cublasCreate)));
  STRATA_RETURN_IF_ERROR(Bind(lib, path, &a.Destroy, STRATA_EXAMPLE_STR(cublasDestroy)));
  STRATA_RETURN_IF_ERROR(Bind(lib, path, &a.SetStream, STRATA_EXAMPLE_STR(cublasSetStream)));
  STRATA_RETURN_IF_ERROR(Bind(lib, path, &a.SetMathMode, STRATA_EXAMPLE_STR(cublasSetMathMode)));
  STRATA_RETURN_IF_ERROR(Bind(lib, path, &a.GemmEx, STRATA_EXAMPLE_STR(cublasGemmEx)));
  return a;
}

}  // namespace

std::string CublasSoname() { return "libcublas.so." STRATA_EXAMPLE_STR(CUBLAS_VER_MAJOR); }

StatusOr<const CublasApi*> Cublas() {
  // Opened once per process (a function-local static: thread-safe), kept
  // until exit.
  static const StatusOr<CublasApi>* const api =
      new StatusOr<CublasApi>(Open(CublasSoname(), STRATA_CUDA_LIBRARY_DIR));
  if (!api->ok()) return api->status();
  return &**api;
}

Status ProbeCublasLibrary(const std::string& soname) { return Open(soname, "").status(); }

}  // namespace strata::example
