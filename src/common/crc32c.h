// src/common/crc32c.h — CRC-32C (Castagnoli, polynomial 0x1EDC6F41, reflected),
// the checksum of checkpoint files.
//
//   uint32_t c = Crc32c(data, n);                  // one buffer
//   uint32_t c = Crc32cExtend(Crc32cExtend(0, a, n), b, m);   // == Crc32c of a ++ b
//
// Uses the SSE4.2 crc32 instruction when the CPU has it (chosen once at run
// time), else a table; both give the same value (tested against each other and
// the standard check value Crc32c("123456789") == 0xE3069283).
// Thread-safe (pure functions).
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// The CRC of `n` more bytes after a running value `crc` (0 to start).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

// The table implementation alone (the reference for tests).
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n);
// Whether Crc32cExtend uses the SSE4.2 instruction.
bool Crc32cHardware();

}  // namespace strata
