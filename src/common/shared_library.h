// Opening a shared library at run time (dlopen) and binding its functions
// (dlsym), for the GPU libraries that are loaded at their first use instead
// of at process start: libraries of hundreds of MiB mapped before `main`
// would stop even `strata --version` under a low `ulimit -v`, and a missing
// one would stop the loader with exit 127 before any Status could be printed.
//
// A library opened here stays loaded until the process exits (it is never
// dlclose'd: NCCL and cuBLAS start threads and register exit handlers, and
// unloading them under those is undefined).
#pragma once

#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

class SharedLibrary {
 public:
  // dlopen(soname, RTLD_NOW | RTLD_LOCAL), searched as the dynamic loader
  // searches (LD_LIBRARY_PATH, ld.so.cache, the default directories); when
  // that fails and fallback_dir is not empty, fallback_dir/soname as well.
  // `what` names the library for a person ("NCCL"). On failure:
  //   ResourceExhausted when the address space is limited (RLIMIT_AS) and the
  //     loader could not map the library, naming the limit and what is mapped;
  //   Unavailable otherwise.
  // Either way the message names `what`, the soname and dlerror() of each try.
  // Thread-safe (dlopen and dlerror are, with glibc).
  static StatusOr<SharedLibrary> Open(std::string_view what, const std::string& soname,
                                      const std::string& fallback_dir = "");

  // The address of `symbol` (dlsym); Unavailable naming the symbol, the
  // library and dlerror() when it has none.
  StatusOr<void*> Symbol(const char* symbol) const;

  // Binds `fn` to `symbol`, typed: Bind(&api.ncclAllReduce, "ncclAllReduce").
  template <typename F>
  Status Bind(F** fn, const char* symbol) const {
    StatusOr<void*> p = Symbol(symbol);
    if (!p.ok()) return p.status();
    *fn = reinterpret_cast<F*>(*p);
    return Status::Ok();
  }

  const std::string& path() const { return path_; }  // the name dlopen accepted

 private:
  SharedLibrary(void* handle, std::string what, std::string path)
      : handle_(handle), what_(std::move(what)), path_(std::move(path)) {}
  void* handle_;  // never closed, see above
  std::string what_;
  std::string path_;
};

}  // namespace strata
