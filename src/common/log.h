// Logging for all of Strata: spdlog underneath, fmt-style format strings.
//
// Level from the environment (STRATA_LOG_LEVEL=trace|debug|info|warn|error|off,
// default info) or SetLogLevel(). Output goes to stderr. LOG_*_ONCE prints a
// message the first time a given key is seen in the process (fallbacks are
// announced once, not per call). Thread-safe.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace strata {

spdlog::logger& Logger();
void SetLogLevel(std::string_view level);  // unknown names leave the level as is
// True the first time `key` is passed in this process, false afterwards.
bool FirstTimeFor(std::string_view key);

}  // namespace strata

#define STRATA_LOG_DEBUG(...) ::strata::Logger().debug(__VA_ARGS__)
#define STRATA_LOG_INFO(...) ::strata::Logger().info(__VA_ARGS__)
#define STRATA_LOG_WARN(...) ::strata::Logger().warn(__VA_ARGS__)
#define STRATA_LOG_ERROR(...) ::strata::Logger().error(__VA_ARGS__)
// Logs a warning only the first time `key` is seen.
#define STRATA_WARN_ONCE(key, ...)                                         \
  do {                                                                     \
    if (::strata::FirstTimeFor(key)) ::strata::Logger().warn(__VA_ARGS__); \
  } while (0)
#define STRATA_INFO_ONCE(key, ...)                                         \
  do {                                                                     \
    if (::strata::FirstTimeFor(key)) ::strata::Logger().info(__VA_ARGS__); \
  } while (0)
