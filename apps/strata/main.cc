// strata — the command: its subcommands (cmd_*.cc) make up the app of
// app.cc; this runs it in a process set up for them.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <memory>
#include <new>
#include <string>

#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "examples/train/model.h"
#include "src/common/log.h"

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

// Descriptors 0, 1 and 2 open before anything else is: a closed one would be
// the next file the command opens (a config, a swap file), and stdout's
// writes would go into it. A closed stdin or stdout becomes /dev/null opened
// read-only, so that writes to it fail (EBADF) as they would have, and are
// reported; a closed stderr becomes /dev/null for writing.
void ReserveStandardDescriptors() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    const int got = open("/dev/null", (fd == 2 ? O_WRONLY : O_RDONLY) | O_CLOEXEC);
    if (got < 0) continue;
    if (got != fd) {
      dup2(got, fd);
      close(got);
    } else {
      fcntl(fd, F_SETFD, 0);  // inherited by the processes the command starts, as it was
    }
  }
}

// stdout's buffered output flushed, and whether any of its writes failed (a
// closed pipe: EPIPE, with SIGPIPE ignored; a closed descriptor: EBADF; a full
// disk). *err is the errno of the failed flush, 0 when unknown.
bool StdoutFailed(int* err) {
  errno = 0;
  std::cout.flush();
  const bool stream_bad = !std::cout.good();
  const bool flush_failed = std::fflush(stdout) != 0;
  *err = flush_failed ? errno : 0;
  return stream_bad || flush_failed || std::ferror(stdout) != 0;
}

// The command's exit code, once its output is out: a run whose stdout could
// not be written fails with kExitIo (docs/cli.md, "Exit codes"), one line on
// stderr saying so; a failure's own code is kept.
int FinishStdout(int code, bool reported) {
  int err = 0;
  if (!StdoutFailed(&err) || reported) return code;
  std::fprintf(
      stderr, "strata: stdout: write failed (%s); the output was not all written%s\n",
      err != 0 ? std::strerror(err) : "closed: EPIPE or similar",
      code == 0 ? "" : ("; the command ended with exit code " + std::to_string(code)).c_str());
  return code == 0 ? strata::cli::kExitIo : code;
}

int RunStrata(int argc, char** argv) {
  using namespace strata::cli;
  CliResult result;
  std::unique_ptr<CLI::App> app = MakeStrataApp(result);
  int code = 0;
  try {
    app->parse(argc, argv);
    code = result.exit_code;
  } catch (const CLI::CallForHelp& e) {
    code = app->exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    code = app->exit(e);
  } catch (const CLI::CallForVersion& e) {
    code = app->exit(e);
  } catch (const CLI::ParseError& e) {
    // One line, then a pointer to --help: no wall of usage text on a typo.
    std::fprintf(stderr, "strata: %s\nRun 'strata --help' for usage.\n", e.what());
    // CLI11's own codes (105 a bad value, 106 a missing option, 109 an
    // unknown argument, ...) are all the usage error of the table.
    return kExitUsage;
  }
  return FinishStdout(code, result.stdout_reported);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace strata::cli;
  ReserveStandardDescriptors();
  RecognizedBlasKernels(argv);
  SingleThreadedBlasUnderAddressLimit(argv);
  // A closed stdout (`strata info | head -c1`) makes writes fail with EPIPE,
  // reported at the end (FinishStdout), instead of killing the command.
  std::signal(SIGPIPE, SIG_IGN);
  // Nothing thrown escapes: memory running out where no Status reports it is
  // the resource error of the table, anything else an internal error.
  try {
    return RunStrata(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "strata: out of memory: an allocation was refused (std::bad_alloc; see the "
                 "memory and address-space limits: free -b, ulimit -v)\n");
    return kExitResource;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata: internal error: %s\n", e.what());
    return kExitFailed;
  }
}
