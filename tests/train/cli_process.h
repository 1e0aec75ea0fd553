// Helpers of the tests that run the `strata` binary as a child process and
// watch what it leaves behind.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

namespace strata::cli_testing {

// The file's contents ("" when it cannot be read).
inline std::string ReadFile(const std::string& path) {
  std::stringstream ss;
  ss << std::ifstream(path).rdbuf();
  return ss.str();
}

// Waits until `file` contains `text` (or 60 s pass).
inline bool WaitFor(const std::string& file, const std::string& text) {
  for (int i = 0; i < 1200; ++i) {
    if (ReadFile(file).find(text) != std::string::npos) return true;
    usleep(50'000);
  }
  return false;
}

// The NVMe swap files a run left in `dir`.
inline size_t SwapFilesIn(const std::string& dir) {
  size_t n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    n += e.path().filename().string().rfind("strata-swap-", 0) == 0;
  return n;
}

// What `strata <args>` run to its end printed and returned.
struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

// Runs `strata <args>` (STRATA_CLI_PATH, the test target's) in the shell
// with stdout and stderr in `dir`; `env`: "VAR=value ..." put before it.
inline RunResult Strata(const std::string& args, const std::string& dir,
                        const std::string& env = "") {
  const std::string out = dir + "/stdout", err = dir + "/stderr";
  const std::string cmd =
      env + " " + std::string(STRATA_CLI_PATH) + " " + args + " >" + out + " 2>" + err;
  const int rc = std::system(cmd.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  r.out = ReadFile(out);
  r.err = ReadFile(err);
  return r;
}

// Starts `strata <args>` with stdout/stderr in files in `dir`; returns its pid.
inline pid_t Spawn(const std::string& args, const std::string& dir) {
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd = "exec " + std::string(STRATA_CLI_PATH) + " " + args + " >" + dir +
                            "/stdout 2>" + dir + "/stderr";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

}  // namespace strata::cli_testing
