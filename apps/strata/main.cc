// strata — the command: train, plan, report, checkpoint, info, bench and tune,
// one file per subcommand (cmd_*.cc), registered with CommandRegistrar.
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "examples/train/model.h"
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

}  // namespace strata::cli

namespace {

// OpenBLAS (the example model's GEMMs) starts its worker threads when it is
// loaded, before main, and each maps a ~128 MiB buffer; under a low
// RLIMIT_AS (`ulimit -v`) a refused mapping makes it retry forever: 100 % CPU
// and an exit that never returns (it joins that thread). Its thread count can
// only be set before it loads, so under a finite RLIMIT_AS with no thread
// count given, strata runs itself again (same pid, same arguments) with
// OPENBLAS_NUM_THREADS=1: no worker threads, one buffer, mapped on the first
// GEMM after the example model has checked there is room for it.
void SingleThreadedBlasUnderAddressLimit(char** argv) {
  rlimit rl{};
  if (getrlimit(RLIMIT_AS, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return;
  for (const char* var : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"})
    if (std::getenv(var) != nullptr) return;
  if (setenv("OPENBLAS_NUM_THREADS", "1", 1) != 0) return;
  execv("/proc/self/exe", argv);  // returns only on failure: carry on as we are
}

// OpenBLAS also picks its kernels when it loads, by the CPU's model number;
// on a CPU newer than the library it falls back to its generic SSE3 kernels
// (strata::example::BlasKernelsFor). Unless OPENBLAS_CORETYPE is set, strata
// then runs itself again with OPENBLAS_CORETYPE naming the kernels the CPU's
// instructions allow, and says so once (the ranks it launches inherit it).
constexpr const char* kBlasKernelsNote = "STRATA_BLAS_KERNELS_NOTE";
void RecognizedBlasKernels(char** argv) {
  if (const char* note = std::getenv(kBlasKernelsNote)) {
    STRATA_LOG_INFO("{}", note);
    unsetenv(kBlasKernelsNote);
    return;
  }
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  std::string why;
  const std::string kernels = strata::example::BetterBlasKernelsHere(&why);
  if (kernels.empty()) return;
  if (setenv("OPENBLAS_CORETYPE", kernels.c_str(), 1) != 0 ||
      setenv(kBlasKernelsNote, why.c_str(), 1) != 0)
    return;
  execv("/proc/self/exe", argv);  // returns only on failure: carry on as we are
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kBlasKernelsNote);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace strata::cli;
  RecognizedBlasKernels(argv);
  SingleThreadedBlasUnderAddressLimit(argv);
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
  CLI::App* bench = app.add_subcommand(
      "bench", "Measure CPU Adam, gradient accumulation, the folded step, collectives, NVMe or PCIe "
      "against a baseline");
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
    // CLI11's own codes (105 a bad value, 106 a missing option, 109 an
    // unknown argument, ...) are all the usage error of the table.
    return kExitUsage;
  }
  return result.exit_code;
}
