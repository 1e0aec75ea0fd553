// dlopen/dlsym with Status errors. See shared_library.h.
#include "src/common/shared_library.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <string>

#include "src/common/host_memory.h"
#include "src/common/units.h"

namespace strata {
namespace {

std::string LastDlError() {
  const char* e = dlerror();
  return e != nullptr ? std::string(e) : std::string("unknown error");
}

// The loader's words for a mapping the kernel refused (ENOMEM), which under a
// finite RLIMIT_AS means the address space ran out.
bool LooksLikeNoAddressSpace(const std::string& e) {
  return e.find("failed to map segment") != std::string::npos ||
         e.find("Cannot allocate memory") != std::string::npos ||
         e.find("cannot allocate memory") != std::string::npos;
}

}  // namespace

StatusOr<SharedLibrary> SharedLibrary::Open(std::string_view what, const std::string& soname,
                                            const std::string& fallback_dir) {
  std::string errors;
  bool no_address_space = false;
  std::string tries[2] = {soname, fallback_dir.empty() ? "" : fallback_dir + "/" + soname};
  for (const std::string& path : tries) {
    if (path.empty()) continue;
    dlerror();  // clear a stale message
    if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL); h != nullptr)
      return SharedLibrary(h, std::string(what), path);
    const std::string e = LastDlError();
    no_address_space = no_address_space || LooksLikeNoAddressSpace(e);
    errors += fmt::format("{}dlopen(\"{}\"): {}", errors.empty() ? "" : "; ", path, e);
  }
  const HostMemoryInfo m = ReadHostMemory();
  if (m.as_limited && no_address_space)
    return ResourceExhaustedError(fmt::format(
        "{} could not be loaded: {}; RLIMIT_AS (`ulimit -v`) is {} bytes ({}) with {} bytes ({}) "
        "mapped: raise the limit to use {}",
        what, errors, m.as_limit, FormatBytes(static_cast<int64_t>(m.as_limit)), m.vm_size,
        FormatBytes(static_cast<int64_t>(m.vm_size)), what));
  return UnavailableError(fmt::format("{} could not be loaded: {}", what, errors));
}

StatusOr<void*> SharedLibrary::Symbol(const char* symbol) const {
  dlerror();
  void* p = dlsym(handle_, symbol);
  if (p == nullptr)
    return UnavailableError(
        fmt::format("{}: {} has no symbol {}: {}", what_, path_, symbol, LastDlError()));
  return p;
}

}  // namespace strata
