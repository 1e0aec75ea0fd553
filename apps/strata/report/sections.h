// The parts of `strata report` (cmd_report.cc runs them in turn): the sizes
// of a mode (Plan), the Runner that runs each measurement as a child
// `strata ... --json` against the clock, and one function per section of
// the page. hardware.cc: the machine, PCIe, the device Adam, the CPU Adam,
// NVMe; training.cc: the training runs of each placement and the model's
// GEMMs against raw cuBLAS. Each section function returns its Section (what
// was measured, or why not) and appends the checks it decides to *checks.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/strata/report/report.h"

namespace strata::cli::report {

using nlohmann::json;

// Sizes of one mode.
struct Plan {
  std::string pcie_sizes;
  int pcie_reps;
  std::string adam_params;
  int adam_reps;
  std::string nvme_size;
  std::vector<std::string> nvme_blocks;
  std::vector<int> nvme_depths;
  int nvme_runs;  // per point: engine and fio alternated, medians
  // The check re-measures fio's best grid point: this size, this many
  // engine/fio pairs (the spread of the check at these sizes is in
  // docs/perf.md, "NVMe: the report's check").
  std::string nvme_confirm_size;
  int nvme_confirm_runs;
  int train_steps;
  int train_rounds;  // every placement in turn, this many times
  std::string gpu_adam_params;
};

Plan PlanFor(bool tiny, bool quick, bool cuda);

// Seconds on the steady clock.
double NowS();
// j[key] when it is a number (NaN otherwise) / a string ("" otherwise).
double Num(const json& j, const char* key);
std::string Str(const json& j, const char* key);
// Whether `tool` is an executable on PATH.
bool OnPath(const std::string& tool);

// Runs the measurements against the clock.
class Runner {
 public:
  Runner(double deadline, double start) : deadline_(deadline), start_(start) {}

  double Left() const { return deadline_ - NowS(); }

  enum Outcome { kOk, kTimeLimit, kFailed };

  // Runs `argv` (argv[0] "strata" means this binary) and parses its stdout as
  // JSON. On kTimeLimit/kFailed, *why says what happened. `min_s`: a part
  // is not started with less time than this left.
  Outcome RunJson(const std::string& section, std::vector<std::string> argv, json* out,
                  std::string* why, double min_s = 2);

 private:
  double deadline_, start_;
};

// The command line that reruns `argv`, for a figure.
std::string Rerun(const std::vector<std::string>& argv);
// Marks the section by the outcome of one part; returns whether it went on.
bool Record(Section& s, Runner::Outcome o, const std::string& part, const std::string& why);
// A section none of whose parts ran because of the clock is "skipped".
void Settle(Section& s, size_t parts_done);
std::string ReadFirstLine(const std::string& path);
// The median, NaN for none.
double MedianOf(std::vector<double> v);
// A bench binary built beside this strata (BUILD/bench/NAME), or "".
std::string BenchBinary(const std::string& name);

// hardware.cc
Section Machine(Runner& run, const std::string& nvme_dir, bool cuda, json* info_out);
Section Pcie(Runner& run, const Plan& p, const std::string& dev, bool cuda,
             const std::string& no_gpu, std::vector<Check>* checks);
Section CpuAdam(Runner& run, const Plan& p, bool tiny, std::vector<Check>* checks);
Section Nvme(Runner& run, const Plan& p, const std::string& dir, std::vector<Check>* checks);
Section GpuAdam(Runner& run, const Plan& p, bool cuda, const std::string& no_gpu_reason);

// training.cc
json BaseTrainConfig(bool tiny, bool quick, bool cuda, const json& info);
Section Training(Runner& run, const Plan& p, const json& base, const std::string& dev,
                 const std::string& out_dir, const std::string& nvme_dir, bool cuda,
                 std::vector<Check>* checks);
Section Gemm(Runner& run, const json& base, const Section& training, bool cuda,
             const std::string& no_gpu_reason);

}  // namespace strata::cli::report
