// The exit codes of every `strata` subcommand (docs/cli.md, "Exit codes"), and
// the one an error Status maps to.
#pragma once

#include "strata/status.h"

namespace strata::cli {

enum ExitCode : int {
  kExitOk = 0,
  // The run or measurement failed for a reason below none of the others: the
  // loss went NaN, a checkpoint of another config, an internal error.
  kExitFailed = 1,
  // The command line: an unknown option or subcommand, a bad or missing
  // value, options that exclude each other, a --steps the checkpoint passed.
  kExitUsage = 2,
  // The config file: missing, unreadable, not JSON, a bad value, a placement
  // that cannot work.
  kExitConfig = 3,
  // Not enough memory, address space, threads, disk space or HBM budget.
  kExitResource = 4,
  // A file or directory that cannot be created, read, written or locked; a
  // damaged checkpoint.
  kExitIo = 5,
  // Interrupted by signal N: 128 + N (SIGHUP 129, SIGINT 130, SIGTERM 143).
  kExitSignalBase = 128,
};

// The exit code of an error met while running (not while reading the command
// line or the config): ResourceExhausted → kExitResource; IOError, DataLoss,
// NotFound, Unavailable (e.g. a lock another process holds) → kExitIo;
// anything else → kExitFailed.
inline int ExitCodeOf(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk:
      return kExitOk;
    case StatusCode::kResourceExhausted:
      return kExitResource;
    case StatusCode::kIOError:
    case StatusCode::kDataLoss:
    case StatusCode::kNotFound:
    case StatusCode::kUnavailable:
      return kExitIo;
    default:
      return kExitFailed;
  }
}

}  // namespace strata::cli
