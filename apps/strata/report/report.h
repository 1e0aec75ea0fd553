// The model of a `strata report` run: sections (what was measured, or why
// not), figures (value, unit, device, the command that reruns it), checks
// (a measured ratio against its target: pass, fail or skipped with the
// reason), and the three ways the report leaves the process: report.json,
// the summary table on stdout and the exit code. The HTML page is in
// report_html.h, the sections in sections.h, the command in cmd_report.cc.
// Pure functions; no I/O.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace strata::cli::report {

// One number the report measured. `command` reruns the measurement on its own.
struct Figure {
  std::string name;  // e.g. "h2d pinned peak"
  double value = 0;
  std::string unit;  // e.g. "GB/s", "Mparams/s", "s", "ratio"
  std::string device;
  std::string command;
};

// A table of the page (and of report.json): a header and rows of cells.
struct Table {
  std::string caption;
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
};

enum class SectionState { kOk, kSkipped, kFailed };
const char* SectionStateName(SectionState s);

struct Section {
  std::string id;     // "machine", "pcie", "nvme", "cpu_adam", "training", "gpu_adam", "gemm"
  std::string title;  // heading of the page
  SectionState state = SectionState::kOk;
  std::string reason;                 // why skipped or failed (empty when ok)
  std::string device;                 // what it measured
  std::vector<std::string> commands;  // every command it ran, in order
  std::vector<Figure> figures;
  std::vector<Table> tables;
  std::vector<std::string> charts;   // inline SVG (not written to report.json)
  std::vector<std::string> notes;    // one-line remarks shown under the heading
  std::vector<std::string> skipped;  // parts left out (time limit), each with its reason
  nlohmann::json raw = nlohmann::json::object();  // the measurements' own JSON
};

enum class CheckState { kPass, kFail, kSkipped };
const char* CheckStateName(CheckState s);

// A measured ratio against a lower bound (`measured >= threshold` passes), or
// a yes/no check (threshold unused, `ok` given).
struct Check {
  std::string name;     // "PCIe engine path vs raw"
  std::string target;   // "≥ 0.90"
  double measured = 0;  // NaN when there is nothing to show
  std::string detail;   // what the measured figure is, or what failed
  std::string device;
  std::string command;  // reruns the measurement
  CheckState state = CheckState::kSkipped;
  std::string reason;  // for skipped: why it could not run
};

// A ratio check: pass when measured >= threshold; a NaN/inf measurement
// fails (the measurement went wrong), saying so.
Check RatioCheck(std::string name, double measured, double threshold, std::string detail,
                 std::string device, std::string command);
// The fraction of a bound measured in pairs (the bound's kernel and the
// measured one back to back, many times): `fraction` is the pairs' median,
// p25/p75 their quartiles. Skipped, with the figures, when `busy` says why
// the run's threads did not own their cores (both kernels were then bound by
// their share of the CPUs, not by what the bound models); failed when
// three quarters of the pairs beat the bound (p25 > 1: it is not a bound);
// else a RatioCheck of the median.
Check BoundCheck(std::string name, double fraction, double p25, double p75, double threshold,
                 std::string busy, std::string detail, std::string device, std::string command);
// A yes/no check.
Check BoolCheck(std::string name, std::string target, bool ok, std::string detail,
                std::string device, std::string command);
Check SkippedCheck(std::string name, std::string target, std::string reason);

// Whether the per-step losses `got` agree with `ref` within `rel_tol`
// (|a − b| ≤ rel_tol · max(|b|, 1)) at every step both have. Sets *worst to
// the largest relative difference and *worst_step to its step (from 1).
// Different lengths compare the common prefix; an empty one disagrees.
bool LossesAgree(const std::vector<double>& got, const std::vector<double>& ref, double rel_tol,
                 double* worst, int* worst_step);

struct Report {
  std::string version;
  std::string command;  // the command line of the run
  std::string device;   // "cuda: <name>" or "host backend (no GPU)"
  std::string started_utc;
  double elapsed_s = 0;
  double time_limit_s = 0;
  bool quick = false;
  std::vector<Section> sections;
  std::vector<Check> checks;
};

// The "no test-level failure" check: fails naming every failed section.
Check NoFailureCheck(const std::vector<Section>& sections);

// Turns every ratio check that ran (target ">= x") into a skipped one whose
// reason is `why` plus the figure measured: for runs whose sizes are too small
// for a speed target to mean anything (--tiny). Yes/no checks stay.
void SkipRatioChecks(std::vector<Check>* checks, const std::string& why);

// Every part the run left out: "section: part (reason)".
std::vector<std::string> SkippedParts(const Report& r);

// kExitOk when no check failed; kExitFailed (exit_codes.h) when one did.
int ExitCodeFor(const Report& r);

// report.json: everything but the SVGs.
nlohmann::json ToJson(const Report& r);

// The summary table printed at the end: one row per check (name, target,
// measured, result), then the skipped parts.
std::string SummaryTable(const Report& r);

// "1.23" style formatting shared by the tables (NaN: "-").
std::string Fixed(double v, int digits);

}  // namespace strata::cli::report
