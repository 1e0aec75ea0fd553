// The `strata` command line: the registry of subcommands, the validators
// they share, and the CLI11 app they make up (MakeStrataApp). main.cc runs
// it; tests/apps/cli_fuzz.cc parses random command lines with it.
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "apps/strata/commands.h"
#include "src/common/log.h"
#include "src/common/units.h"
#include "strata/strata.h"

namespace strata::cli {

std::vector<RegisteredCommand>& CommandRegistry() {
  static std::vector<RegisteredCommand> registry;
  return registry;
}

bool ParseByteSize(const std::string& text, uint64_t* out) {
  int64_t v = 0;
  if (!strata::ParseByteSize(text, &v)) return false;
  *out = static_cast<uint64_t>(v);
  return true;
}

CLI::Validator CountSuffix(int64_t min) {
  return CLI::Validator(
      [min](std::string& text) -> std::string {
        int64_t v = 0;
        if (!text.empty() && text[0] == '-')
          return "\"" + text + "\" is negative: give a count of at least " + std::to_string(min);
        if (!strata::ParseCount(text, &v))
          return "\"" + text + "\" is not a count (e.g. 1000, 1e8, 100M, 1.5B)";
        if (v < min) return text + " is too small: give at least " + std::to_string(min);
        text = std::to_string(v);
        return std::string();
      },
      "COUNT", "count");
}

CLI::Validator ThreadCount() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const int pus = MachinePus();
        const std::string range =
            "give 0 (all " + std::to_string(pus) + " PUs) to " + std::to_string(pus);
        int64_t v = 0;
        if (!strata::ParseCount(text, &v) || (!text.empty() && text[0] == '-'))
          return "\"" + text + "\" is not a thread count: " + range;
        if (v > pus)
          return text + " threads is more than this machine's " + std::to_string(pus) +
                 " PUs (hardware threads the process may run on): " + range;
        text = std::to_string(v);
        return std::string();
      },
      "THREADS", "threads");
}

int MachinePus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

CLI::Validator FiniteNumber() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || end == text.c_str() || *end != '\0')
          return "\"" + text + "\" is not a number";
        if (!std::isfinite(v)) return "\"" + text + "\" is not a finite number";
        return std::string();
      },
      "NUMBER", "finite number");
}

std::unique_ptr<CLI::App> MakeStrataApp(CliResult& result) {
  auto app = std::make_unique<CLI::App>(
      "strata: offload engine for training models larger than GPU memory.\n"
      "Keeps parameters, gradients and Adam states across GPU HBM, pinned CPU DRAM\n"
      "and NVMe, configured with DeepSpeed's JSON.",
      "strata");
  app->set_version_flag("--version", std::string(strata::Version()));
  app->require_subcommand(1);
  app->fallthrough();
  auto log_level = std::make_shared<std::string>();
  app->add_option("--log-level", *log_level, "trace|debug|info|warn|error|off (default: info)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));

  CLI::App* bench = app->add_subcommand(
      "bench",
      "Measure CPU Adam, gradient accumulation, the folded step, collectives, NVMe or PCIe "
      "against a baseline");
  bench->require_subcommand(1);
  CLI::App* tune = app->add_subcommand("tune", "Sweep settings and print the best config section");
  tune->require_subcommand(1);
  for (auto& cmd : CommandRegistry()) {
    CLI::App* parent = cmd.parent.empty() ? app.get() : (cmd.parent == "bench" ? bench : tune);
    cmd.add(*parent, result);
  }
  app->parse_complete_callback([log_level] {
    if (!log_level->empty()) strata::SetLogLevel(*log_level);
  });
  return app;
}

}  // namespace strata::cli
