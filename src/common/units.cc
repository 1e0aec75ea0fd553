#include "src/common/units.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <utility>

namespace strata {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return s;
}

// Splits "1.5 GiB" into a non-negative decimal number (digits, one '.', an
// optional exponent when allow_exponent) and a lower-case suffix.
bool SplitNumber(std::string_view s, bool allow_exponent, long double* value, std::string* suffix) {
  s = Trim(s);
  size_t i = 0;
  int dots = 0, digits = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) {
    dots += s[i] == '.';
    digits += s[i] != '.';
    ++i;
  }
  if (digits == 0 || dots > 1) return false;
  if (allow_exponent && i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    size_t j = i + 1;
    if (j < s.size() && (s[j] == '+' || s[j] == '-')) ++j;
    const size_t exp_digits = j;
    while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
    if (j > exp_digits) i = j;  // "1e8"; a bare "e" is left to the suffix check
  }
  const std::string number(s.substr(0, i));
  char* end = nullptr;
  *value = std::strtold(number.c_str(), &end);
  if (end != number.c_str() + number.size()) return false;
  suffix->clear();
  for (char c : Trim(s.substr(i))) suffix->push_back(static_cast<char>(std::tolower(c)));
  return true;
}

bool ToInt64(long double value, int64_t* out) {
  if (!(value >= 0) || value != std::floor(value) || value >= 9223372036854775807.0L) return false;
  *out = static_cast<int64_t>(value);
  return true;
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::fabs(v) >= 1024 && u < 5) v /= 1024, ++u;
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", v, kUnits[u]);
}

bool ParseByteSize(std::string_view text, int64_t* out) {
  long double value = 0;
  std::string suffix;
  if (!SplitNumber(text, /*allow_exponent=*/false, &value, &suffix)) return false;
  static const std::pair<std::string_view, int> kSuffixes[] = {
      {"", 0},    {"b", 0}, {"k", 1},  {"kb", 1},  {"kib", 1}, {"m", 2},  {"mb", 2},
      {"mib", 2}, {"g", 3}, {"gb", 3}, {"gib", 3}, {"t", 4},   {"tb", 4}, {"tib", 4}};
  int power = -1;
  for (const auto& [name, p] : kSuffixes)
    if (suffix == name) power = p;
  if (power < 0) return false;
  for (int p = 0; p < power; ++p) value *= 1024.0L;
  return ToInt64(value, out);
}

bool ParseCount(std::string_view text, int64_t* out) {
  long double value = 0;
  std::string suffix;
  if (!SplitNumber(text, /*allow_exponent=*/true, &value, &suffix)) return false;
  static const std::pair<std::string_view, long double> kSuffixes[] = {
      {"", 1}, {"k", 1e3L}, {"m", 1e6L}, {"b", 1e9L}, {"g", 1e9L}, {"t", 1e12L}};
  for (const auto& [name, mult] : kSuffixes)
    if (suffix == name) return ToInt64(value * mult, out);
  return false;
}

}  // namespace strata
