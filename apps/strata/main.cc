// strata — the command: info, bench, tune (and train, when the engine lands).
#include <cmath>
#include <cstdio>
#include <iostream>

#include "apps/strata/commands.h"
#include "src/common/log.h"
#include "strata/strata.h"

namespace strata::cli {

std::vector<RegisteredCommand>& CommandRegistry() {
  static std::vector<RegisteredCommand> registry;
  return registry;
}

bool ParseByteSize(const std::string& text, uint64_t* out) {
  if (text.empty()) return false;
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (...) {
    return false;
  }
  if (!(value >= 0) || !std::isfinite(value)) return false;
  std::string suffix = text.substr(pos);
  for (auto& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult = 1;
  if (suffix.empty() || suffix == "B")
    mult = 1;
  else if (suffix == "K" || suffix == "KB" || suffix == "KIB")
    mult = 1024.0;
  else if (suffix == "M" || suffix == "MB" || suffix == "MIB")
    mult = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "GB" || suffix == "GIB")
    mult = 1024.0 * 1024 * 1024;
  else if (suffix == "T" || suffix == "TB" || suffix == "TIB")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else
    return false;
  *out = static_cast<uint64_t>(value * mult);
  return true;
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
      app.add_subcommand("bench", "Measure CPU Adam, NVMe or PCIe against a baseline");
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
