// Host memory checks. See host_memory.h.
#include "src/common/host_memory.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "src/common/units.h"

namespace strata {
namespace {

// The value of a "Key:   N kB" line of a /proc file, in bytes.
bool ReadKb(const char* file, std::string_view key, uint64_t* bytes) {
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line)) {
    if (line.compare(0, key.size(), key) != 0 || line.size() <= key.size() ||
        line[key.size()] != ':')
      continue;
    try {
      *bytes = std::stoull(line.substr(key.size() + 1)) * 1024;
    } catch (...) {
      return false;
    }
    return true;
  }
  return false;
}

std::string Both(uint64_t b) {
  return fmt::format("{} bytes ({})", b, FormatBytes(static_cast<int64_t>(b)));
}

}  // namespace

uint64_t HostMemoryInfo::as_headroom() const {
  if (!as_limited) return UINT64_MAX;
  return as_limit > vm_size ? as_limit - vm_size : 0;
}

HostMemoryInfo ReadHostMemory() {
  HostMemoryInfo m;
  m.mem_known = ReadKb("/proc/meminfo", "MemAvailable", &m.mem_available);
  ReadKb("/proc/self/status", "VmSize", &m.vm_size);
  rlimit rl{};
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    m.as_limited = true;
    m.as_limit = static_cast<uint64_t>(rl.rlim_cur);
  }
  return m;
}

Status CheckHostMemory(std::string_view what, uint64_t resident_bytes, uint64_t address_bytes) {
  const HostMemoryInfo m = ReadHostMemory();
  if (m.mem_known && resident_bytes > m.mem_available)
    return ResourceExhaustedError(fmt::format(
        "{} needs {} of memory but only {} are available (MemAvailable in /proc/meminfo)", what,
        Both(resident_bytes), Both(m.mem_available)));
  const uint64_t need = resident_bytes + address_bytes;
  if (m.as_limited && need > m.as_headroom())
    return ResourceExhaustedError(fmt::format(
        "{} needs {} of address space but only {} are available (RLIMIT_AS, `ulimit -v`, is {} "
        "with {} already mapped)",
        what, Both(need), Both(m.as_headroom()), Both(m.as_limit), Both(m.vm_size)));
  return Status::Ok();
}

std::string ThreadStartLimits() {
  std::string out;
  const HostMemoryInfo m = ReadHostMemory();
  if (m.as_limited) {
    out = fmt::format("RLIMIT_AS (`ulimit -v`) is {} with {} mapped now", Both(m.as_limit),
                      Both(m.vm_size));
    rlimit st{};
    if (getrlimit(RLIMIT_STACK, &st) == 0 && st.rlim_cur != RLIM_INFINITY)
      out += fmt::format(", and a thread reserves a stack of {} (RLIMIT_STACK)",
                         Both(static_cast<uint64_t>(st.rlim_cur)));
    out += " plus up to 64 MiB for its malloc arena (glibc)";
  }
  rlimit np{};
  if (getrlimit(RLIMIT_NPROC, &np) == 0 && np.rlim_cur != RLIM_INFINITY)
    out += fmt::format("{}RLIMIT_NPROC (`ulimit -u`) is {}", out.empty() ? "" : "; ",
                       static_cast<uint64_t>(np.rlim_cur));
  return out;
}

}  // namespace strata
