// Runs a command as a child process with a deadline, capturing its stdout and
// the tail of its stderr: how `strata report` runs each measurement in a
// process of its own (the same `strata` binary with --json), so that one
// measurement's memory, threads and swap files end with it and a time limit
// can stop it.
#pragma once

#include <string>
#include <vector>

namespace strata::cli::report {

struct ChildResult {
  int exit_code = -1;      // the child's exit status; 128 + N after signal N
  bool timed_out = false;  // stopped at the deadline (SIGTERM, then SIGKILL 5 s later)
  std::string out;         // all of stdout
  std::string err_tail;    // the last 4 KiB of stderr
  double seconds = 0;
  std::string error;  // non-empty when it could not be started (fork/exec/pipe failed)
};

// Runs argv[0] (searched on PATH when it has no slash) with argv (no shell) for at most `timeout_s`
// seconds.
ChildResult RunChild(const std::vector<std::string>& argv, double timeout_s);

// The path of the running binary (/proc/self/exe), for running itself.
std::string SelfExe();

// argv as one shell-quotable line (words with spaces or quotes are quoted).
std::string CommandLine(const std::vector<std::string>& argv);

}  // namespace strata::cli::report
