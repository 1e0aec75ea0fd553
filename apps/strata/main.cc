// strata — the command: info, bench, tune (and train, when the engine lands).
#include <cstdio>
#include <iostream>

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

CLI::Validator CountSuffix() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        int64_t v = 0;
        if (!strata::ParseCount(text, &v))
          return "\"" + text + "\" is not a count (e.g. 1000, 1e8, 100M, 1.5B)";
        text = std::to_string(v);
        return std::string();
      },
      "COUNT", "count");
}

}  // namespace strata::cli

int main(int argc, char** argv) {
  using namespace strata::cli;
  CLI::App app{
      "strata: offload engine for training models larger than GPU memory.\n"
      "Keeps parameters, gradients and Adam states across GPU HBM, pinned CPU DRAM\n"
      "and NVMe, configured with DeepSpeed's JSON.",
      "strata"};
  app.set_version_flag("--version", std::string(strata::Version()));
  app.require_subcommand(1);
  app.fallthrough();
  std::string log_level;
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off (default: info)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));

  CliResult result;
  CLI::App* bench =
      app.add_subcommand("bench", "Measure CPU Adam, gradient accumulation, NVMe or PCIe against a baseline");
  bench->require_subcommand(1);
  CLI::App* tune = app.add_subcommand("tune", "Sweep settings and print the best config section");
  tune->require_subcommand(1);
  for (auto& cmd : CommandRegistry()) {
    CLI::App* parent = cmd.parent.empty() ? &app : (cmd.parent == "bench" ? bench : tune);
    cmd.add(*parent, result);
  }
  app.parse_complete_callback([&] {
    if (!log_level.empty()) strata::SetLogLevel(log_level);
  });

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // One line, then a pointer to --help: no wall of usage text on a typo.
    std::fprintf(stderr, "strata: %s\nRun 'strata --help' for usage.\n", e.what());
    return e.get_exit_code() == 0 ? 2 : e.get_exit_code();
  }
  return result.exit_code;
}
