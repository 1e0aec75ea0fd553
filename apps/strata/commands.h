// The `strata` command's subcommands register themselves here, one file each
// (cmd_info.cc, cmd_bench_adam.cc, ...), so that adding one touches no other.
//
//   static CommandRegistrar reg("bench", [](CLI::App& bench, CliResult& r) {
//     auto* cmd = bench.add_subcommand("adam", "Benchmark CPU Adam");
//     ... options ...
//     cmd->callback([&r, ...] { r.exit_code = RunBenchAdam(...); });
//   });
//
// Parents: "" (top level), "bench", "tune". A callback sets r.exit_code; it
// prints its own output (JSON when its --json flag is given) and a one-line
// error to stderr on failure.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace strata::cli {

struct CliResult {
  int exit_code = 0;
  // The command checked stdout's writes and reported a failure itself
  // (`strata train`); otherwise main does (exit 5 when the output was lost).
  bool stdout_reported = false;
};

using AddCommandFn = std::function<void(CLI::App& parent, CliResult& result)>;

struct RegisteredCommand {
  std::string parent;  // "", "bench" or "tune"
  AddCommandFn add;
};

std::vector<RegisteredCommand>& CommandRegistry();

struct CommandRegistrar {
  CommandRegistrar(std::string parent, AddCommandFn add) {
    CommandRegistry().push_back({std::move(parent), std::move(add)});
  }
};

// Parses sizes written as 4096, 64K, 1M, 4G, 1.5G, 64KiB (powers of 1024;
// strata::ParseByteSize in src/common/units.h). Returns false on junk.
bool ParseByteSize(const std::string& text, uint64_t* out);

// A CLI11 transform for options that take a count: "1e8", "100M", "1.5B",
// "2K" become plain integers before CLI11 converts them (decimal multiples,
// strata::ParseCount). A value below `min` (a negative one included) is an
// error naming the value and the minimum.
CLI::Validator CountSuffix(int64_t min = 0);

// A check for options that take a floating-point number: NaN and the
// infinities are refused, the error naming the value (CLI11 prefixes the
// option's name).
CLI::Validator FiniteNumber();

// The whole command line: every registered subcommand under one CLI11 app,
// their callbacks setting `result` (which must outlive the app). Parsing runs
// the chosen subcommand's callback; --log-level sets the log level.
std::unique_ptr<CLI::App> MakeStrataApp(CliResult& result);

// A check for --threads: 0 (all) up to the machine's PUs; the error names
// the value and the range.
CLI::Validator ThreadCount();
// PUs this process may run on (sched_getaffinity), at least 1.
int MachinePus();

}  // namespace strata::cli
