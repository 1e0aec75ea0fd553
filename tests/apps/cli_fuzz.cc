// libFuzzer target for the `strata` command line (apps/strata/app.cc): the
// input, split at NUL bytes, is argv after "strata"; the whole app is built
// (every subcommand, option and validator) and parses it; once every option
// is parsed and validated, the top app's parse-complete callback, which
// CLI11 runs before any subcommand's, ends the parse (CLI::Success), so no
// command's work runs. (The subcommands' callbacks stay: they own the
// storage their options write into.)
//
// Any argv must parse or give a CLI11 error, never a crash, another
// exception, a leak or unbounded memory (ASan/UBSan watch). Built only where
// the compiler links -fsanitize=fuzzer; scripts/fuzz.sh runs it seeded with
// tests/apps/cli_fuzz_seeds and tests/apps/cli_fuzz.dict.
#include <CLI/CLI.hpp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "apps/strata/commands.h"
#include "src/common/log.h"

namespace {

constexpr size_t kMaxArgs = 64;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  strata::SetLogLevel("off");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args = {"strata"};
  std::string arg;
  for (size_t i = 0; i <= size && args.size() < kMaxArgs; ++i) {
    if (i == size || data[i] == 0) {
      args.push_back(arg);
      arg.clear();
    } else {
      arg.push_back(static_cast<char>(data[i]));
    }
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  strata::cli::CliResult result;
  std::unique_ptr<CLI::App> app = strata::cli::MakeStrataApp(result);
  // (--log-level stays "off": this replaces the callback that sets it.)
  app->parse_complete_callback([] { throw CLI::Success(); });
  try {
    app->parse(static_cast<int>(args.size()), argv.data());
  } catch (const CLI::Error&) {
    // A parse error, --help or --version: what a user sees as one line.
  }
  return 0;
}
