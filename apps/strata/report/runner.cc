// strata report's sizes per mode, its child runner and shared helpers
// (sections.h).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "apps/strata/bench_stats.h"
#include "apps/strata/report/child.h"
#include "apps/strata/report/report.h"
#include "apps/strata/report/sections.h"

namespace strata::cli::report {

Plan PlanFor(bool tiny, bool quick, bool cuda) {
  if (tiny)
    return {.pcie_sizes = "64K,1M",
            .pcie_reps = 2,
            .adam_params = "1M",
            .adam_reps = 2,
            .nvme_size = "16M",
            .nvme_blocks = {"256K", "1M"},
            .nvme_depths = {4},
            .nvme_runs = 1,
            .nvme_confirm_size = "16M",
            .nvme_confirm_runs = 1,
            .train_steps = 3,
            .train_rounds = 1,
            .gpu_adam_params = "4000000"};
  if (quick)
    return {.pcie_sizes = cuda ? "64K..256M" : "64K..16M",
            .pcie_reps = 3,
            .adam_params = cuda ? "50M" : "10M",
            .adam_reps = 7,
            .nvme_size = cuda ? "512M" : "64M",
            .nvme_blocks = {"128K", "1M", "4M"},
            .nvme_depths = {4, 16},
            .nvme_runs = 2,
            .nvme_confirm_size = "1G",
            .nvme_confirm_runs = cuda ? 5 : 3,
            .train_steps = cuda ? 4 : 5,
            .train_rounds = 1,
            .gpu_adam_params = "50000000"};
  return {.pcie_sizes = cuda ? "64K..1G" : "64K..256M",
          .pcie_reps = 5,
          .adam_params = cuda ? "100M" : "50M",
          .adam_reps = 7,
          .nvme_size = cuda ? "1G" : "256M",
          .nvme_blocks = {"128K", "512K", "1M", "4M"},
          .nvme_depths = {1, 4, 16, 32},
          .nvme_runs = cuda ? 2 : 3,
          .nvme_confirm_size = "1G",
          .nvme_confirm_runs = 5,
          .train_steps = cuda ? 10 : 12,
          .train_rounds = cuda ? 2 : 3,
          .gpu_adam_params = "200000000"};
}

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Num(const json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : NAN;
}

std::string Str(const json& j, const char* key) {
  return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
}

bool OnPath(const std::string& tool) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':'))
    if (!dir.empty() && access((dir + "/" + tool).c_str(), X_OK) == 0) return true;
  return false;
}

Runner::Outcome Runner::RunJson(const std::string& section, std::vector<std::string> argv,
                                json* out, std::string* why, double min_s) {
  const double left = Left();
  if (left < min_s) {
    *why = "time limit: " + report::Fixed(std::max(0.0, left), 1) + " s left";
    return kTimeLimit;
  }
  std::vector<std::string> run = argv;
  if (run[0] == "strata") run[0] = report::SelfExe();
  std::fprintf(stderr, "[%4.0f s] %s: %s\n", NowS() - start_, section.c_str(),
               report::CommandLine(argv).c_str());
  report::ChildResult r = report::RunChild(run, left);
  if (!r.error.empty()) {
    *why = r.error;
    return kFailed;
  }
  if (r.timed_out) {
    *why = "time limit: stopped after " + report::Fixed(r.seconds, 0) + " s";
    return kTimeLimit;
  }
  // The one-line error the command prints on failure.
  std::string tail = r.err_tail;
  while (!tail.empty() && tail.back() == '\n') tail.pop_back();
  if (tail.rfind('\n') != std::string::npos) tail = tail.substr(tail.rfind('\n') + 1);
  *out = json::parse(r.out, nullptr, false);
  if (r.exit_code != 0) {
    *why = "exit " + std::to_string(r.exit_code) + (tail.empty() ? "" : ": " + tail);
    // A --json command that failed may still say why in its object.
    if (!out->is_discarded() && out->is_object() && out->contains("error"))
      *why += " (" + Str(*out, "error") + ")";
    return kFailed;
  }
  if (out->is_discarded()) {
    *why = "its output is not JSON" + (tail.empty() ? "" : ": " + tail);
    return kFailed;
  }
  return kOk;
}

std::string Rerun(const std::vector<std::string>& argv) { return report::CommandLine(argv); }

// Marks the section by the outcome of one part; returns whether it went on.
bool Record(Section& s, Runner::Outcome o, const std::string& part, const std::string& why) {
  if (o == Runner::kOk) return true;
  if (o == Runner::kTimeLimit) {
    s.skipped.push_back(why + ": " + part);
  } else {
    s.state = SectionState::kFailed;
    s.reason = part + ": " + why;
  }
  return false;
}

// A section none of whose parts ran because of the clock is "skipped".
void Settle(Section& s, size_t parts_done) {
  if (s.state == SectionState::kOk && parts_done == 0 && !s.skipped.empty()) {
    s.state = SectionState::kSkipped;
    s.reason = s.skipped.front();
    s.skipped.clear();
  }
}

std::string ReadFirstLine(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

double MedianOf(std::vector<double> v) { return v.empty() ? NAN : Median(std::move(v)); }

// A bench binary built beside this strata (BUILD/bench/NAME), or "".
std::string BenchBinary(const std::string& name) {
  const std::string path =
      std::filesystem::path(report::SelfExe()).parent_path().parent_path().parent_path() / "bench" /
      name;
  return access(path.c_str(), X_OK) == 0 ? path : std::string();
}

}  // namespace strata::cli::report
