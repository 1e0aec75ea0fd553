#include "src/common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

#include "src/common/status_util.h"
#include "src/common/thread_annotations.h"

namespace strata {
namespace {

spdlog::level::level_enum ParseLevel(std::string_view name, bool* ok) {
  *ok = true;
  if (name == "trace") return spdlog::level::trace;
  if (name == "debug") return spdlog::level::debug;
  if (name == "info") return spdlog::level::info;
  if (name == "warn" || name == "warning") return spdlog::level::warn;
  if (name == "error") return spdlog::level::err;
  if (name == "off") return spdlog::level::off;
  *ok = false;
  return spdlog::level::info;
}

std::shared_ptr<spdlog::logger> MakeLogger() {
  auto logger = spdlog::stderr_color_mt("strata");
  logger->set_pattern("[strata %^%l%$] %v");
  logger->set_level(spdlog::level::info);
  if (const char* env = std::getenv("STRATA_LOG_LEVEL")) {
    bool ok = false;
    auto level = ParseLevel(env, &ok);
    if (ok) logger->set_level(level);
  }
  return logger;
}

}  // namespace

spdlog::logger& Logger() {
  static std::shared_ptr<spdlog::logger> logger = MakeLogger();
  return *logger;
}

void SetLogLevel(std::string_view level) {
  bool ok = false;
  auto parsed = ParseLevel(level, &ok);
  if (ok) Logger().set_level(parsed);
}

bool FirstTimeFor(std::string_view key) {
  struct Seen {
    Mutex mu;
    std::set<std::string, std::less<>> keys GUARDED_BY(mu);
  };
  static Seen seen;
  MutexLock lock(&seen.mu);
  return seen.keys.emplace(key).second;
}

namespace internal {
void DieOnBadStatus(const char* file, int line, const char* expr, const Status& s) {
  std::fprintf(stderr, "%s:%d: CHECK_OK(%s) failed: %s\n", file, line, expr, s.ToString().c_str());
  std::abort();
}
}  // namespace internal

}  // namespace strata
