// Human-readable quantities: byte sizes and element counts, printed and parsed
// the same way everywhere (config, CLI, plan tables, summaries).
//
//   FormatBytes(2363136)        "2.25 MiB"     (binary units, two decimals; "512 B")
//   ParseByteSize("1.5G", &n)   1610612736     (binary: K = 1024; B/KB/KiB spellings)
//   ParseCount("1.5B", &n)      1500000000     (decimal: K = 1e3, M = 1e6, B/G = 1e9,
//                                               T = 1e12; also 1e8)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace strata {

// Bytes in binary units: "512 B", "2.25 MiB", "1.50 GiB".
std::string FormatBytes(int64_t bytes);

// "4096", "64K", "64KiB", "512M", "8G", "1.5GB", "1T" (case-insensitive,
// spaces allowed around the suffix). False on junk, negative values,
// fractions of a byte and values past INT64_MAX; *out is unchanged then.
bool ParseByteSize(std::string_view text, int64_t* out);

// Counts: "100000000", "1e8", "100M", "1.5B", "2K". False on junk, negative
// values, fractions and values past INT64_MAX; *out is unchanged then.
bool ParseCount(std::string_view text, int64_t* out);

}  // namespace strata
