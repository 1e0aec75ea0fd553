// strata report: the machine and what Strata does on it, on one page. Runs,
// each in a process of its own (this binary with --json, so every figure's
// command reruns it alone and a time limit can stop it):
//   machine   `strata info` (+ GPU clocks, PCIe link and NUMA node from
//             nvidia-smi and sysfs when there is a GPU);
//   pcie      `bench pcie` over sizes (the engine path against raw);
//   gpu_adam  bench/bench_gpu_adam: the device Adam against HBM copy bandwidth (GPU only);
//   cpu_adam  `bench adam` over thread counts, with its roofline;
//   nvme      `bench nvme --vs-fio` over block size x queue depth;
//   training  `train` of each placement (none/none, cpu/none, cpu/cpu,
//             nvme/nvme) of a model sized to the machine;
// then writes report.json and index.html into --out, prints the checks'
// summary table and exits 1 (kExitFailed) when a check failed. The
// sections and their runner are in report/sections.h.
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
#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "apps/strata/report/child.h"
#include "apps/strata/report/report.h"
#include "apps/strata/report/report_html.h"
#include "apps/strata/report/sections.h"
#include "examples/train/model.h"
#include "src/common/units.h"
#include "strata/build_config.h"
#include "strata/strata.h"

namespace strata::cli {
namespace {

using nlohmann::json;
using report::Check;
using report::Section;
// The sections and their runner (report/sections.h).
using report::BaseTrainConfig;
using report::CpuAdam;
using report::Gemm;
using report::GpuAdam;
using report::Machine;
using report::NowS;
using report::Nvme;
using report::Pcie;
using report::Plan;
using report::PlanFor;
using report::Runner;
using report::Training;

constexpr char kCommand[] = "report";

struct ReportArgs {
  std::string out = "strata-report";
  bool quick = false;
  bool tiny = false;
  std::string config;
  std::string nvme_path;
  double time_limit = 0;  // 0: the default of the mode
  std::string device = "auto";
  bool json = false;              // print report.json instead of the summary table
  std::vector<std::string> argv;  // the command line, for the page
};

std::string UtcNow() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

int RunReport(const ReportArgs& a) {
  const double start = NowS();
  if (a.time_limit < 0) return Fail(kCommand, "--time-limit must be at least 0 seconds");
  const double limit = a.time_limit > 0 ? a.time_limit : (a.quick || a.tiny ? 170 : 570);
  const double deadline = start + limit;
  std::error_code ec;
  std::filesystem::create_directories(a.out, ec);
  if (ec) return Fail(kCommand, IOError("--out " + a.out + ": cannot create it: " + ec.message()));
  if (access(a.out.c_str(), W_OK) != 0)
    return Fail(kCommand, IOError("--out " + a.out + ": not writable"));
  const std::string out = std::filesystem::absolute(a.out).lexically_normal().string();
  const std::string nvme_dir =
      a.nvme_path.empty() ? out + "/nvme"
                          : std::filesystem::absolute(a.nvme_path).lexically_normal().string();
  std::filesystem::create_directories(nvme_dir, ec);
  if (ec)
    return Fail(kCommand,
                IOError("--nvme-path " + nvme_dir + ": cannot create it: " + ec.message()));
  json user_config;
  if (!a.config.empty()) {
    std::ifstream f(a.config);
    if (!f) {
      std::fprintf(stderr, "strata report: --config %s: cannot read it\n", a.config.c_str());
      return kExitConfig;
    }
    user_config = json::parse(f, nullptr, false);
    if (user_config.is_discarded() || !user_config.is_object()) {
      std::fprintf(stderr, "strata report: --config %s: not a JSON object\n", a.config.c_str());
      return kExitConfig;
    }
  }

  Runner run(deadline, start);
  report::Report r;
  r.version = std::string(Version());
  r.command = report::CommandLine(a.argv);
  r.started_utc = UtcNow();
  r.time_limit_s = limit;
  r.quick = a.quick;

  json info;
  Section machine = Machine(run, nvme_dir, a.device == "cuda", &info);
  const bool have_gpu = info.is_object() && !info["gpu"]["devices"].empty();
  if (a.device == "cuda" && !have_gpu)
    return Fail(kCommand,
                UnavailableError(
                    "--device cuda: no CUDA device (" +
                    (info.is_object() ? info["gpu"].value("reason", std::string()) : "") + ")"));
  const bool cuda = a.device == "cuda" || (a.device == "auto" && have_gpu);
  const std::string dev = cuda ? "cuda" : "host";
  // Why the GPU-only sections do not run.
  const std::string no_gpu = have_gpu ? "--device host" : "no GPU";
  if (cuda && a.device == "auto") machine = Machine(run, nvme_dir, true, &info);
  r.device = cuda ? "cuda: " + info["gpu"]["devices"][0].value("name", std::string("GPU"))
                  : "host backend (no GPU)";
  const Plan plan = PlanFor(a.tiny, a.quick, cuda);
  r.sections.push_back(machine);
  std::vector<Check> checks;
  const json base = a.config.empty() ? BaseTrainConfig(a.tiny, a.quick, cuda, info) : user_config;
  r.sections.push_back(Pcie(run, plan, dev, cuda, no_gpu, &checks));
  // On a GPU, what only a GPU can measure comes first (its time is lent
  // by the quarter hour): the device Adam, the placements' training with
  // its loss check, the GEMMs; the CPU and the disk after.
  if (cuda) {
    r.sections.push_back(GpuAdam(run, plan, cuda, no_gpu));
    r.sections.push_back(Training(run, plan, base, dev, out, nvme_dir, cuda, &checks));
    r.sections.push_back(Gemm(run, base, r.sections.back(), cuda, no_gpu));
    r.sections.push_back(CpuAdam(run, plan, a.tiny, &checks));
    r.sections.push_back(Nvme(run, plan, nvme_dir, &checks));
  } else {
    r.sections.push_back(GpuAdam(run, plan, cuda, no_gpu));
    r.sections.push_back(CpuAdam(run, plan, a.tiny, &checks));
    r.sections.push_back(Nvme(run, plan, nvme_dir, &checks));
    r.sections.push_back(Training(run, plan, base, dev, out, nvme_dir, cuda, &checks));
    r.sections.push_back(Gemm(run, base, r.sections.back(), cuda, no_gpu));
  }
  if (a.tiny) report::SkipRatioChecks(&checks, "--tiny: sizes too small to judge");
  checks.push_back(report::NoFailureCheck(r.sections));
  r.checks = checks;
  r.elapsed_s = NowS() - start;

  const std::string json_path = out + "/report.json", html_path = out + "/index.html";
  {
    std::ofstream f(json_path);
    f << report::ToJson(r).dump(2) << "\n";
    if (!f) return Fail(kCommand, IOError(json_path + ": write failed"));
  }
  {
    std::ofstream f(html_path);
    f << report::RenderPage(r);
    if (!f) return Fail(kCommand, IOError(html_path + ": write failed"));
  }
  if (a.json) {
    std::printf("%s\n", report::ToJson(r).dump(2).c_str());
    return report::ExitCodeFor(r);
  }
  std::printf("strata report: %s, %.0f s (limit %.0f s)\n", r.device.c_str(), r.elapsed_s, limit);
  std::printf("%s", report::SummaryTable(r).c_str());
  std::printf("wrote %s\n      %s\n", html_path.c_str(), json_path.c_str());
  return report::ExitCodeFor(r);
}

CommandRegistrar reg("", [](CLI::App& app, CliResult& result) {
  auto a = std::make_shared<ReportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "report",
      "Measure this machine (PCIe, NVMe, CPU optimizer, each placement's training) into one "
      "page: report.json + index.html, a pass/fail summary, exit 1 if a check fails");
  cmd->add_option("--out", a->out, "Directory for report.json and index.html")
      ->capture_default_str();
  cmd->add_flag("--quick", a->quick, "Smaller sizes: fits in 3 minutes");
  cmd->add_flag("--tiny", a->tiny,
                "The smallest sizes (seconds; for tests: the figures mean little)");
  cmd->add_option("--config", a->config,
                  "Training config for the placements (default: the example model sized to the "
                  "machine)");
  cmd->add_option("--nvme-path", a->nvme_path,
                  "Directory for the NVMe measurements and swap files (default: OUT/nvme)");
  cmd->add_option("--time-limit", a->time_limit,
                  "Stop after S seconds with what was measured, listing what was skipped "
                  "(default 570, --quick 170)")
      ->check(FiniteNumber());
  cmd->add_option("--device", a->device, "auto|cuda|host (host: the host backend, no GPU)")
      ->check(CLI::IsMember({"auto", "cuda", "host"}))
      ->capture_default_str();
  cmd->add_flag("--json", a->json, "Print report.json instead of the summary table");
  cmd->callback([a, &result] {
    // The command line as given, for the page and report.json.
    a->argv = {"strata", "report", "--out", a->out};
    if (a->quick) a->argv.push_back("--quick");
    if (a->tiny) a->argv.push_back("--tiny");
    if (a->json) a->argv.push_back("--json");
    if (a->device != "auto") a->argv.insert(a->argv.end(), {"--device", a->device});
    if (!a->config.empty()) a->argv.insert(a->argv.end(), {"--config", a->config});
    if (!a->nvme_path.empty()) a->argv.insert(a->argv.end(), {"--nvme-path", a->nvme_path});
    if (a->time_limit > 0)
      a->argv.insert(a->argv.end(), {"--time-limit", report::Fixed(a->time_limit, 0)});
    result.exit_code = RunReport(*a);
  });
});

}  // namespace
}  // namespace strata::cli
