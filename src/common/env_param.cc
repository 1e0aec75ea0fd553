#include "src/common/env_param.h"

#include <cstdlib>
#include <string_view>

namespace strata {

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 0);
  return (end != nullptr && *end == '\0') ? static_cast<int64_t>(x) : fallback;
}

std::string EnvString(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v == nullptr) ? fallback : std::string(v);
}

bool EnvBool(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  std::string_view s(v);
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  return fallback;
}

}  // namespace strata
