// Developer knobs from the environment, read in one place (NCCL_PARAM style).
// User-facing tunables are config keys, not environment variables.
//
//   int64_t v = EnvInt("STRATA_FOO", 4);   // STRATA_FOO=8 → 8; unset or junk → 4
#pragma once

#include <cstdint>
#include <string>

namespace strata {

int64_t EnvInt(const char* name, int64_t fallback);
std::string EnvString(const char* name, const std::string& fallback);
bool EnvBool(const char* name, bool fallback);  // 1/true/yes/on, 0/false/no/off

}  // namespace strata
