// Host memory as a process can use it: the machine's MemAvailable and the
// process's address-space limit (RLIMIT_AS) less what it has mapped. Used to
// refuse a large allocation up front, naming the bytes asked and available,
// instead of failing half-way (or being killed) after allocating.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

struct HostMemoryInfo {
  bool mem_known = false;      // /proc/meminfo was readable
  uint64_t mem_available = 0;  // MemAvailable, bytes
  bool as_limited = false;     // RLIMIT_AS (soft) is finite
  uint64_t as_limit = 0;       // RLIMIT_AS soft, bytes
  uint64_t vm_size = 0;        // VmSize of this process, bytes (/proc/self/status)
  // Address space left under RLIMIT_AS (UINT64_MAX when unlimited).
  uint64_t as_headroom() const;
};

// Reads /proc/meminfo, /proc/self/status and getrlimit. Never fails: what
// cannot be read is left unknown (and then not checked).
HostMemoryInfo ReadHostMemory();

// OK when `resident_bytes` fit in MemAvailable and `resident_bytes +
// address_bytes` in the address space RLIMIT_AS leaves (address_bytes:
// mappings that count against the limit without being touched, such as
// library buffers). Else ResourceExhausted:
// "<what> needs N bytes (X) but only M bytes are available (MemAvailable ...;
// RLIMIT_AS ... with ... mapped)".
Status CheckHostMemory(std::string_view what, uint64_t resident_bytes, uint64_t address_bytes = 0);

// The limits that can refuse a new thread, those that are finite, for the
// error of a thread that did not start: "RLIMIT_AS (`ulimit -v`) is N bytes
// (X) with M bytes (Y) mapped now, and a thread reserves a stack of S bytes
// (Z) (RLIMIT_STACK) plus up to 64 MiB for its malloc arena (glibc);
// RLIMIT_NPROC (`ulimit -u`) is P". "" when none is finite.
std::string ThreadStartLimits();

}  // namespace strata
