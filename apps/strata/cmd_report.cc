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
// summary table and exits 1 (kExitFailed) when a check failed.
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
#include "examples/train/model.h"
#include "src/common/units.h"
#include "strata/build_config.h"
#include "strata/strata.h"

namespace strata::cli {
namespace {

using nlohmann::json;
using report::Check;
using report::Figure;
using report::Section;
using report::SectionState;
using report::Table;

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
                  std::string* why, double min_s = 2) {
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

 private:
  double deadline_, start_;
};

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

// ---------------------------------------------------------------- machine

Section Machine(Runner& run, const std::string& nvme_dir, bool cuda, json* info_out) {
  Section s{.id = "machine", .title = "The machine"};
  const std::vector<std::string> argv = {"strata", "info", "--json", "--path", nvme_dir};
  s.commands.push_back(Rerun(argv));
  json info;
  std::string why;
  if (!Record(s, run.RunJson("machine", argv, &info, &why, 0.5), "strata info", why)) {
    Settle(s, 0);
    return s;
  }
  *info_out = info;
  s.raw["info"] = info;
  Table t{.caption = "strata info", .header = {"what", "value"}};
  auto row = [&](const std::string& k, const std::string& v) { t.rows.push_back({k, v}); };
  row("strata", Str(info, "version") + " (CUDA " +
                    (info["build"].value("cuda", false) ? "built" : "not built") + ", NCCL " +
                    (info["build"].value("nccl", false) ? "built" : "not built") + ")");
  const json& cpu = info["cpu"];
  if (cpu.contains("cores"))
    row("CPU", std::to_string(cpu.value("packages", 0)) + " package(s), " +
                   std::to_string(cpu.value("cores", 0)) + " cores, " +
                   std::to_string(cpu.value("pus", 0)) + " PUs");
  if (cpu.contains("numa_nodes"))
    for (const json& n : cpu["numa_nodes"])
      row("NUMA node " + std::to_string(n.value("node", 0)),
          std::to_string(n.value("cores", 0)) + " cores, " +
              FormatBytes(n.value("memory_bytes", int64_t{0})));
  row("CPU optimizer ISA", Str(cpu, "optimizer_isa"));
  const json& io = info["io"];
  row("io_uring", io["io_uring"].value("available", false)
                      ? "works"
                      : "unavailable: " + io["io_uring"].value("error", std::string()));
  const json& od = io["o_direct"];
  row("O_DIRECT under " + nvme_dir,
      od.value("supported", false)
          ? "works, logical block " + std::to_string(od.value("logical_block_size", 0))
          : "refused: " + od.value("error", std::string()));
  auto lim = [](const json& v) {
    return v.is_string() ? v.get<std::string>() : FormatBytes(v.get<int64_t>());
  };
  row("RLIMIT_MEMLOCK", "soft " + lim(info["memlock"]["soft_bytes"]) + ", hard " +
                            lim(info["memlock"]["hard_bytes"]));
  const json& gpus = info["gpu"]["devices"];
  if (gpus.empty()) row("GPUs", "none (" + info["gpu"].value("reason", std::string()) + ")");
  json gpu_rows = json::array();
  for (const json& g : gpus) {
    const std::string bus = g.value("pci_bus_id", std::string());
    std::string lower = bus;
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    const std::string numa = ReadFirstLine("/sys/bus/pci/devices/" + lower + "/numa_node");
    row("GPU " + std::to_string(g.value("ordinal", 0)),
        g.value("name", std::string()) + ", " + FormatBytes(g.value("hbm_bytes", int64_t{0})) +
            " HBM, sm_" + g.value("compute_capability", std::string()) + ", PCIe gen" +
            std::to_string(g.value("pcie_gen", 0)) + " x" +
            std::to_string(g.value("pcie_width", 0)) + ", bus " + bus + ", NUMA node " +
            (numa.empty() ? "unknown" : numa));
    gpu_rows.push_back({{"ordinal", g.value("ordinal", 0)}, {"numa_node", numa}});
  }
  if (cuda && OnPath("nvidia-smi")) {
    const std::vector<std::string> q = {
        "nvidia-smi",
        "--query-gpu=index,name,clocks.max.sm,clocks.max.mem,clocks.sm,pcie.link.gen.max,"
        "pcie.link.gen.current,pcie.link.width.max,pcie.link.width.current,power.limit",
        "--format=csv,noheader"};
    report::ChildResult r = report::RunChild(q, std::min(20.0, std::max(1.0, run.Left())));
    s.commands.push_back(Rerun(q));
    if (r.exit_code == 0) {
      Table g{.caption = "nvidia-smi",
              .header = {"GPU", "name", "max SM clock", "max memory clock", "SM clock now",
                         "PCIe gen max", "PCIe gen now", "width max", "width now", "power limit"}};
      std::stringstream lines(r.out);
      std::string line;
      while (std::getline(lines, line)) {
        std::vector<std::string> cells;
        std::stringstream cs(line);
        std::string c;
        while (std::getline(cs, c, ',')) {
          while (!c.empty() && c.front() == ' ') c.erase(0, 1);
          cells.push_back(c);
        }
        if (!cells.empty()) g.rows.push_back(cells);
      }
      s.tables.push_back(g);
      s.raw["nvidia_smi"] = r.out;
    } else {
      s.notes.push_back("nvidia-smi failed (exit " + std::to_string(r.exit_code) +
                        "): no clocks shown");
    }
  } else if (cuda) {
    s.notes.push_back("nvidia-smi not on PATH: GPU clocks not shown");
  }
  s.raw["gpu_numa"] = gpu_rows;
  s.tables.insert(s.tables.begin(), t);
  return s;
}

// ---------------------------------------------------------------- pcie

Section Pcie(Runner& run, const Plan& p, const std::string& dev, bool cuda,
             const std::string& no_gpu, std::vector<Check>* checks) {
  Section s{.id = "pcie", .title = "PCIe: pinned, pageable, both ways, the engine path"};
  const std::vector<std::string> argv = {
      "strata", "bench",   "pcie",       "--json", "--device",
      dev,      "--sizes", p.pcie_sizes, "--reps", std::to_string(p.pcie_reps)};
  const std::string cmd = Rerun(argv);
  s.commands.push_back(cmd);
  json j;
  std::string why;
  const Runner::Outcome o = run.RunJson("pcie", argv, &j, &why);
  if (!Record(s, o, "bench pcie", why)) {
    Settle(s, 0);
    checks->push_back(report::SkippedCheck(
        "PCIe engine path vs raw", ">= 0.90",
        s.state == SectionState::kFailed ? "bench pcie failed" : "time limit"));
    return s;
  }
  s.raw = j;
  s.device = Str(j, "device");
  if (!j.value("host_memory_pinned", true))
    s.notes.push_back("host buffers are PAGEABLE: page-locking was refused (RLIMIT_MEMLOCK)");
  if (!cuda)
    s.notes.push_back(
        "No GPU: these are the host backend's copies (memcpy), not PCIe; the target does not "
        "apply.");
  struct Col {
    const char* key;
    const char* name;
    bool dashed;
  };
  const Col cols[] = {{"h2d_pinned_gbytes_per_s", "H2D pinned", false},
                      {"d2h_pinned_gbytes_per_s", "D2H pinned", false},
                      {"h2d_pageable_gbytes_per_s", "H2D pageable", false},
                      {"d2h_pageable_gbytes_per_s", "D2H pageable", false},
                      {"bidir_gbytes_per_s", "both ways at once", false},
                      {"h2d_engine_gbytes_per_s", "H2D engine path", true},
                      {"d2h_engine_gbytes_per_s", "D2H engine path", true}};
  report::LineChart c{.title = "PCIe bandwidth over transfer size (" + s.device + ")",
                      .x_label = "transfer size (bytes)",
                      .y_label = "GB/s",
                      .log2_x = true,
                      .x_format = report::AxisFormat::kBytes};
  Table t{.caption = "GB/s by transfer size (medians)", .header = {"size"}};
  for (const Col& col : cols) t.header.push_back(col.name);
  int ci = 0;
  for (const Col& col : cols) {
    report::Series ser{.name = col.name, .dashed = col.dashed};
    ser.color = col.dashed ? (ci - 5) : ci;  // engine path: the colour of its raw direction
    for (const json& pt : j["sizes"]) ser.points.push_back({Num(pt, "bytes"), Num(pt, col.key)});
    c.series.push_back(ser);
    ++ci;
  }
  for (const json& pt : j["sizes"]) {
    std::vector<std::string> r = {report::BytesLabel(Num(pt, "bytes"))};
    for (const Col& col : cols) r.push_back(report::Fixed(Num(pt, col.key), 2));
    t.rows.push_back(r);
  }
  s.tables.push_back(t);
  s.charts.push_back(report::RenderLineChart(c));
  for (auto [key, name] : std::vector<std::pair<const char*, const char*>>{
           {"h2d_pinned_gbytes_per_s", "H2D pinned peak"},
           {"d2h_pinned_gbytes_per_s", "D2H pinned peak"},
           {"bidir_gbytes_per_s", "both ways peak"},
           {"h2d_pageable_gbytes_per_s", "H2D pageable peak"}})
    s.figures.push_back({name, Num(j, key), "GB/s", s.device, cmd});
  for (auto [key, name] : std::vector<std::pair<const char*, const char*>>{
           {"engine_path_vs_raw", "engine path / raw"},
           {"engine_path_vs_raw_h2d", "engine path / raw, H2D"},
           {"engine_path_vs_raw_d2h", "engine path / raw, D2H"},
           {"bidir_vs_one_direction", "both ways / one direction"}})
    s.figures.push_back({name, Num(j, key), "ratio", s.device, cmd});
  const double ratio = Num(j, "engine_path_vs_raw");
  const std::string detail = "H2D " + report::Fixed(Num(j, "engine_path_vs_raw_h2d"), 3) +
                             ", D2H " + report::Fixed(Num(j, "engine_path_vs_raw_d2h"), 3);
  if (cuda)
    checks->push_back(
        report::RatioCheck("PCIe engine path vs raw", ratio, 0.9, detail, s.device, cmd));
  else
    checks->push_back(report::SkippedCheck(
        "PCIe engine path vs raw", ">= 0.90",
        no_gpu + " (host backend's engine/raw " + report::Fixed(ratio, 3) + ", not PCIe)"));
  return s;
}

// ---------------------------------------------------------------- cpu adam

// Why a bench adam run's threads did not own their cores ("the machine was
// busy (...)"), or "" when they did.
std::string BusyReason(const json& bench) {
  if (!bench.value("cores_contended", false)) return "";
  return "the machine was busy (" +
         report::Fixed(Num(bench, "involuntary_context_switches_per_s"), 0) +
         " involuntary context switches/s, load average " +
         report::Fixed(Num(bench, "load_average"), 2) + ")";
}

// The optimizer-state formats at every PU, interleaved in one process, each
// against its own roofline and against fp32: a compact format moves fewer
// bytes, so where Adam is memory-bound it steps more params/s.
void CpuAdamFormats(Runner& run, const Plan& p, Section& s, int threads,
                    std::vector<Check>* checks) {
  struct Target {
    const char* states;  // its checks: "CPU Adam bf16 vs fp32", "... vs its roofline"
    double vs_fp32;
  };
  static constexpr Target kTargets[] = {{"bf16", 1.3}, {"int8", 1.4}};
  auto skip_all = [&](const std::string& why) {
    for (const Target& t : kTargets) {
      checks->push_back(report::SkippedCheck(std::string("CPU Adam ") + t.states + " vs fp32",
                                             ">= " + report::Fixed(t.vs_fp32, 2), why));
      checks->push_back(report::SkippedCheck(
          std::string("CPU Adam ") + t.states + " vs its roofline", ">= 0.85", why));
    }
  };
  if (threads == 0) {
    skip_all("CPU Adam at every PU was not measured");
    return;
  }
  const std::vector<std::string> argv = {"strata",    "bench",
                                         "adam",      "--json",
                                         "--params",  p.adam_params,
                                         "--threads", std::to_string(threads),
                                         "--reps",    std::to_string(p.adam_reps),
                                         "--states",  "all"};
  const std::string cmd = Rerun(argv);
  s.commands.push_back(cmd);
  json j;
  std::string why;
  if (!Record(s, run.RunJson("cpu_adam", argv, &j, &why), "bench adam --states all", why)) {
    skip_all("bench adam --states all: " + why);
    return;
  }
  s.raw.push_back(j);
  Table t{.caption = "Optimizer-state formats, AdamW, fp32 grads, " + std::to_string(threads) +
                     " threads, interleaved in one process (medians; vs fp32: median of the "
                     "repetitions' ratios)",
          .header = {"states", "bytes/param", "Mparams/s", "GB/s", "own roofline Mparams/s",
                     "of roofline", "vs fp32", "p25-p75"}};
  const std::string dev = "CPU, " + std::to_string(threads) + " threads";
  std::map<std::string, json> by_name;
  for (const json& f : j["formats"]) {
    const std::string name = Str(f, "states");
    by_name[name] = f;
    t.rows.push_back({name, report::Fixed(Num(f, "bytes_per_param"), 3),
                      report::Fixed(Num(f, "params_per_s") / 1e6, 1),
                      report::Fixed(Num(f, "gbytes_per_s"), 2),
                      report::Fixed(Num(f, "roofline_params_per_s") / 1e6, 1),
                      report::Fixed(Num(f, "roofline_fraction"), 3),
                      report::Fixed(Num(f, "speedup_vs_baseline"), 2),
                      report::Fixed(Num(f, "speedup_vs_baseline_p25"), 2) + "-" +
                          report::Fixed(Num(f, "speedup_vs_baseline_p75"), 2)});
    if (name == "fp32") continue;
    s.figures.push_back(
        {name + " states: Mparams/s", Num(f, "params_per_s") / 1e6, "Mparams/s", dev, cmd});
    s.figures.push_back(
        {name + " states: params/s vs fp32", Num(f, "speedup_vs_baseline"), "ratio", dev, cmd});
  }
  s.tables.push_back(t);
  const std::string busy = BusyReason(j);
  for (const Target& t : kTargets) {
    const json& f = by_name[t.states];
    const std::string name = std::string("CPU Adam ") + t.states;
    const std::string detail = report::Fixed(Num(f, "params_per_s") / 1e6, 1) +
                               " Mparams/s, fp32 " +
                               report::Fixed(Num(by_name["fp32"], "params_per_s") / 1e6, 1);
    if (!busy.empty())
      checks->push_back(
          report::SkippedCheck(name + " vs fp32", ">= " + report::Fixed(t.vs_fp32, 2),
                               busy + ": the threads did not own their cores (" + detail + ")"));
    else
      checks->push_back(
          report::RatioCheck(name + " vs fp32", Num(f, "speedup_vs_baseline"), t.vs_fp32,
                             detail + "; quartiles of the repetitions' ratios " +
                                 report::Fixed(Num(f, "speedup_vs_baseline_p25"), 2) + "-" +
                                 report::Fixed(Num(f, "speedup_vs_baseline_p75"), 2),
                             dev, cmd));
    checks->push_back(report::BoundCheck(
        name + " vs its roofline", Num(f, "roofline_fraction"), Num(f, "roofline_fraction_p25"),
        Num(f, "roofline_fraction_p75"), 0.85, busy,
        "at " + std::to_string(threads) + " threads, " +
            report::Fixed(Num(f, "params_per_s") / 1e6, 1) + " Mparams/s",
        "CPU", cmd));
  }
}

Section CpuAdam(Runner& run, const Plan& p, bool tiny, std::vector<Check>* checks) {
  Section s{.id = "cpu_adam", .title = "CPU optimizer: throughput over threads, with its roofline"};
  const int pus = MachinePus();
  std::vector<int> threads;
  if (tiny) {
    threads = {1};
    if (pus > 1) threads.push_back(pus);
  } else {
    for (int t = 1; t < pus; t *= 2) threads.push_back(t);
    threads.push_back(pus);
  }
  report::Series strata{.name = "strata (fused SIMD)"},
      roof{.name = "roofline (memory bound)", .dashed = true}, scalar{.name = "scalar loop"};
  Table t{.caption =
              "AdamW, fp32 grads (medians; of roofline: median of roofline/strata pairs "
              "on the same slab, back to back, with the pairs' quartiles)",
          .header = {"threads", "Mparams/s", "roofline Mparams/s", "of roofline", "p25-p75", "GB/s",
                     "scalar Mparams/s", "preemptions/s", "ISA"}};
  json raw = json::array();
  json last;
  std::string last_cmd;
  size_t done = 0, i = 0;
  for (; i < threads.size(); ++i) {
    const int th = threads[i];
    const std::vector<std::string> argv = {"strata",    "bench",
                                           "adam",      "--json",
                                           "--params",  p.adam_params,
                                           "--threads", std::to_string(th),
                                           "--reps",    std::to_string(p.adam_reps)};
    const std::string cmd = Rerun(argv);
    s.commands.push_back(cmd);
    json j;
    std::string why;
    if (!Record(s, run.RunJson("cpu_adam", argv, &j, &why),
                "bench adam --threads " + std::to_string(th), why))
      break;
    ++done;
    raw.push_back(j);
    strata.points.push_back({double(th), Num(j, "params_per_s") / 1e6});
    roof.points.push_back({double(th), Num(j, "roofline_params_per_s") / 1e6});
    scalar.points.push_back({double(th), Num(j, "scalar_params_per_s") / 1e6});
    t.rows.push_back({std::to_string(th), report::Fixed(Num(j, "params_per_s") / 1e6, 1),
                      report::Fixed(Num(j, "roofline_params_per_s") / 1e6, 1),
                      report::Fixed(Num(j, "roofline_fraction"), 3),
                      report::Fixed(Num(j, "roofline_fraction_p25"), 3) + "-" +
                          report::Fixed(Num(j, "roofline_fraction_p75"), 3),
                      report::Fixed(Num(j, "gbytes_per_s"), 2),
                      report::Fixed(Num(j, "scalar_params_per_s") / 1e6, 1),
                      report::Fixed(Num(j, "involuntary_context_switches_per_s"), 0),
                      Str(j, "isa")});
    const std::string dev = "CPU, " + std::to_string(th) + " threads";
    s.figures.push_back({"Mparams/s at " + std::to_string(th) + " threads",
                         Num(j, "params_per_s") / 1e6, "Mparams/s", dev, cmd});
    s.figures.push_back({"of roofline at " + std::to_string(th) + " threads",
                         Num(j, "roofline_fraction"), "ratio", dev, cmd});
    last = j;
    last_cmd = cmd;
  }
  for (size_t k = i + 1; k < threads.size(); ++k)
    s.skipped.push_back("bench adam --threads " + std::to_string(threads[k]) + " (not started)");
  Settle(s, done);
  s.device = "CPU (" + std::to_string(pus) + " PUs)";
  s.raw = raw;
  if (done > 0) {
    s.tables.push_back(t);
    report::LineChart c{.title = "CPU AdamW over threads (" + p.adam_params + " params)",
                        .x_label = "threads",
                        .y_label = "Mparams/s",
                        .series = {strata, roof, scalar}};
    s.charts.push_back(report::RenderLineChart(c));
  }
  const int last_threads = done > 0 ? threads[done - 1] : 0;
  if (done > 0 && last_threads == pus) {
    const std::string busy = BusyReason(last);
    checks->push_back(report::BoundCheck(
        "CPU Adam vs roofline", Num(last, "roofline_fraction"), Num(last, "roofline_fraction_p25"),
        Num(last, "roofline_fraction_p75"), 0.85, busy,
        "at " + std::to_string(pus) + " threads, " +
            report::Fixed(Num(last, "params_per_s") / 1e6, 1) + " Mparams/s",
        "CPU", last_cmd));
  } else
    checks->push_back(report::SkippedCheck("CPU Adam vs roofline", ">= 0.85",
                                           s.state == SectionState::kFailed
                                               ? "bench adam failed"
                                               : "time limit: all threads not measured"));
  CpuAdamFormats(run, p, s, done > 0 && last_threads == pus ? pus : 0, checks);
  return s;
}

// ---------------------------------------------------------------- nvme

Section Nvme(Runner& run, const Plan& p, const std::string& dir, std::vector<Check>* checks) {
  Section s{.id = "nvme", .title = "NVMe: the engine against fio over block size x queue depth"};
  const bool fio = OnPath("fio");
  if (!fio) s.notes.push_back("fio is not installed (apt-get install fio): the engine alone");
  s.device = dir;
  // "write: engine qd 4", ... in the order first measured (depths ascending,
  // engine before fio) so that the legend reads in that order.
  std::vector<report::Series> series;
  Table t{
      .caption = "GB/s (median of " + std::to_string(p.nvme_runs) +
                 " run(s) each, engine and fio alternated)",
      .header = {"block", "queue depth", "engine write", "engine read", "fio write", "fio read"}};
  double best_fio_score = 0;
  std::string best_fio_block;
  int best_fio_qd = 0;
  json raw = json::array();
  size_t done = 0, total = p.nvme_blocks.size() * p.nvme_depths.size();
  bool stop = false;
  int di = 0;
  for (int qd : p.nvme_depths) {
    for (const std::string& bs : p.nvme_blocks) {
      if (stop) {
        s.skipped.push_back("block " + bs + " qd " + std::to_string(qd) + " (not started)");
        continue;
      }
      std::vector<std::string> argv = {"strata",        "bench",
                                       "nvme",          "--json",
                                       "--path",        dir,
                                       "--size",        p.nvme_size,
                                       "--block-size",  bs,
                                       "--queue-depth", std::to_string(qd),
                                       "--runs",        std::to_string(p.nvme_runs)};
      if (fio) argv.push_back("--vs-fio");
      const std::string cmd = Rerun(argv);
      s.commands.push_back(cmd);
      json j;
      std::string why;
      if (!Record(s, run.RunJson("nvme", argv, &j, &why),
                  "block " + bs + " qd " + std::to_string(qd), why)) {
        stop = true;
        continue;
      }
      ++done;
      raw.push_back(j);
      uint64_t b = 0;
      ParseByteSize(bs, &b);
      const std::string q = " qd " + std::to_string(qd);
      auto add = [&](const std::string& name, double v, bool dashed) {
        auto it = std::find_if(series.begin(), series.end(),
                               [&](const report::Series& x) { return x.name == name; });
        if (it == series.end()) it = series.insert(series.end(), report::Series{.name = name});
        report::Series& ser = *it;
        ser.name = name;
        ser.dashed = dashed;
        ser.color = di;
        ser.points.push_back({double(b), v});
      };
      const double ew = Num(j, "write_gbytes_per_s"), er = Num(j, "read_gbytes_per_s");
      add("write: engine" + q, ew, false);
      add("read: engine" + q, er, false);
      const std::string where = "block " + bs + q;
      s.figures.push_back({"engine write, " + where, ew, "GB/s", dir, cmd});
      s.figures.push_back({"engine read, " + where, er, "GB/s", dir, cmd});
      std::vector<std::string> row = {
          bs, std::to_string(qd), report::Fixed(ew, 3), report::Fixed(er, 3), "-", "-"};
      if (fio) {
        const double fw = Num(j, "fio_write_gbytes_per_s"), fr = Num(j, "fio_read_gbytes_per_s");
        add("write: fio" + q, fw, true);
        add("read: fio" + q, fr, true);
        if (const double score = std::sqrt(fw * fr); score > best_fio_score) {
          best_fio_score = score;
          best_fio_block = bs;
          best_fio_qd = qd;
        }
        row[4] = report::Fixed(fw, 3);
        row[5] = report::Fixed(fr, 3);
        s.figures.push_back({"fio write, " + where, fw, "GB/s", dir, cmd});
        s.figures.push_back({"fio read, " + where, fr, "GB/s", dir, cmd});
      }
      t.rows.push_back(row);
    }
    ++di;
  }
  Settle(s, done);
  s.raw = raw;
  if (done > 0) {
    s.tables.push_back(t);
    for (const char* dir_name : {"write", "read"}) {
      report::LineChart c{.title = std::string("NVMe ") + dir_name + " over block size (" +
                                   p.nvme_size + " per run, O_DIRECT)",
                          .x_label = "block size (bytes)",
                          .y_label = "GB/s",
                          .log2_x = true,
                          .x_format = report::AxisFormat::kBytes};
      // Engine lines first, then fio's (dashed), each by depth.
      for (bool dashed : {false, true})
        for (const report::Series& ser : series) {
          const std::string& name = ser.name;
          if (ser.dashed != dashed || name.rfind(dir_name, 0) != 0) continue;
          report::Series copy = ser;
          copy.name = name.substr(name.find(':') + 2);
          c.series.push_back(copy);
        }
      s.charts.push_back(report::RenderLineChart(c));
    }
  }
  const std::string target = ">= 0.90";
  if (!fio) {
    checks->push_back(
        report::SkippedCheck("NVMe engine vs fio's best", target, "fio not installed"));
  } else if (done < total) {
    checks->push_back(report::SkippedCheck(
        "NVMe engine vs fio's best", target,
        s.state == SectionState::kFailed ? "bench nvme failed" : "time limit: grid not finished"));
  } else if (best_fio_score <= 0) {
    checks->push_back(report::SkippedCheck("NVMe engine vs fio's best", target,
                                           "fio measured no bandwidth on the grid"));
  } else {
    // The grid's points are a few short runs each, and the best of many noisy
    // points is biased up: the check re-measures fio's best point (by the
    // geometric mean of its write and read) as engine/fio pairs, one ratio
    // per run, at a size where a pass is long against the disk's jitter.
    const std::vector<std::string> argv = {"strata",        "bench",
                                           "nvme",          "--json",
                                           "--path",        dir,
                                           "--size",        p.nvme_confirm_size,
                                           "--block-size",  best_fio_block,
                                           "--queue-depth", std::to_string(best_fio_qd),
                                           "--runs",        std::to_string(p.nvme_confirm_runs),
                                           "--vs-fio"};
    const std::string cmd = Rerun(argv);
    s.commands.push_back(cmd);
    json j;
    std::string why;
    const std::string where = "block " + best_fio_block + " qd " + std::to_string(best_fio_qd) +
                              ", " + p.nvme_confirm_size + " x " +
                              std::to_string(p.nvme_confirm_runs) + " pairs";
    if (!Record(s, run.RunJson("nvme", argv, &j, &why), "check at fio's best point", why)) {
      checks->push_back(report::SkippedCheck(
          "NVMe engine vs fio's best", target,
          s.state == SectionState::kFailed ? "bench nvme failed" : "time limit: check not run"));
      return s;
    }
    raw.push_back(j);
    s.raw = raw;
    const double rw = Num(j, "write_vs_fio"), rr = Num(j, "read_vs_fio");
    s.figures.push_back({"engine / fio at fio's best point, write", rw, "ratio", dir, cmd});
    s.figures.push_back({"engine / fio at fio's best point, read", rr, "ratio", dir, cmd});
    auto spread = [&](const char* d) {
      const std::string k = std::string(d) + "_vs_fio";
      return std::string(d) + " " + report::Fixed(Num(j, k.c_str()), 3) + " (quartiles " +
             report::Fixed(Num(j, (k + "_p25").c_str()), 3) + "-" +
             report::Fixed(Num(j, (k + "_p75").c_str()), 3) + ")";
    };
    checks->push_back(report::RatioCheck(
        "NVMe engine vs fio's best", std::min(rw, rr), 0.9,
        where + ", medians of the pairs' ratios: " + spread("write") + ", " + spread("read"), dir,
        cmd));
  }
  return s;
}

// ---------------------------------------------------------------- training

// `other_speculation`: the placement again with strata.speculative_step the
// opposite of what auto chooses on this device (with a GPU the step after
// backward, on the host device the speculative step), side by side.
// `delayed`: with strata.delayed_param_update, the stale reference (its
// losses differ by design and are not compared).
// `split`: offload_optimizer.ratio below 1, the first sub-groups stepped on
// the device: "auto" with a GPU, under an HBM budget that holds the
// parameters, the gradient window and at most half of the optimizer states
// (SplitHbmBudget); 0.5 on the host device (where "auto" keeps them all on
// the CPU).
struct Placement {
  const char* opt;
  const char* param;
  bool other_speculation = false;
  bool delayed = false;
  bool split = false;
  const char* states = nullptr;  // strata.optimizer_states, when not fp32
};
constexpr Placement kPlacements[] = {{.opt = "none", .param = "none"},
                                     {.opt = "cpu", .param = "none"},
                                     {.opt = "cpu", .param = "none", .other_speculation = true},
                                     {.opt = "cpu", .param = "none", .split = true},
                                     {.opt = "cpu", .param = "none", .delayed = true},
                                     {.opt = "cpu", .param = "none", .states = "bf16"},
                                     {.opt = "cpu", .param = "cpu"},
                                     {.opt = "cpu", .param = "cpu", .other_speculation = true},
                                     {.opt = "cpu", .param = "cpu", .split = true},
                                     {.opt = "nvme", .param = "nvme"},
                                     {.opt = "nvme", .param = "nvme", .other_speculation = true}};

// The split row's HBM budget: twice (the plan's "auto" uses half of it;
// the rest is the model's activations) the parameters (bf16, 2 bytes
// each), the window's fp32 gradient accumulator (4), half of the fp32
// optimizer states (6 of 12) and 512 MiB for the gradient and parameter
// slots, for the example model's parameter count.
std::string SplitHbmBudget(const json& model) {
  example::ModelShape shape;
  shape.layers = model.value("layers", shape.layers);
  shape.hidden = model.value("hidden", shape.hidden);
  shape.vocab = model.value("vocab", shape.vocab);
  const int64_t bytes = 2 * (12 * shape.num_parameters() + (int64_t{512} << 20));
  return std::to_string(bytes >> 20) + "M";
}

// The example model sized to the machine (a config given with --config wins).
json BaseTrainConfig(bool tiny, bool quick, bool cuda, const json& info) {
  json model;
  std::string hbm = "256M";
  std::string pinned;
  int micro = 4, gas = 2;
  if (tiny) {
    model = {{"layers", 2}, {"hidden", 64}, {"seq_len", 32}};
    micro = 2;
    gas = 1;
  } else if (!cuda) {
    model = quick ? json{{"layers", 2}, {"hidden", 256}, {"seq_len", 64}}
                  : json{{"layers", 4}, {"hidden", 384}, {"seq_len", 64}};
  } else {
    // ~270M parameters (configs/gpu-270m.json's shape) where the GPU has room
    // for every state in HBM (none/none), a quarter of it otherwise.
    int64_t free_hbm = 0;
    for (const json& g : info["gpu"]["devices"])
      free_hbm = std::max<int64_t>(free_hbm, g.value("free_bytes", int64_t{0}));
    const bool big = free_hbm >= (int64_t{24} << 30);
    model = {{"layers", quick ? 4 : 8}, {"hidden", big ? 2048 : 1024}, {"seq_len", 512}};
    micro = 8;
    gas = quick ? 2 : 4;
    hbm = big ? "20G" : std::to_string(std::max<int64_t>(1, free_hbm * 6 / 10 >> 20)) + "M";
    pinned = "16G";
  }
  model["vocab"] = 256;
  model["seed"] = 1234;
  json c = {
      {"train_micro_batch_size_per_gpu", micro},
      {"gradient_accumulation_steps", gas},
      {"gradient_clipping", 1.0},
      {"optimizer",
       {{"type", "AdamW"},
        {"params", {{"lr", 2e-3}, {"betas", {0.9, 0.95}}, {"eps", 1e-8}, {"weight_decay", 0.0}}}}},
      {"bf16", {{"enabled", true}}},
      {"zero_optimization",
       {{"stage", 3},
        {"sub_group_size", 1e6},
        {"stage3_max_live_parameters", 2e6},
        {"stage3_param_persistence_threshold", 1e4},
        {"stage3_prefetch_bucket_size", 5e6},
        {"reduce_bucket_size", 2e6}}},
      {"aio", {{"block_size", 1048576}, {"queue_depth", 8}, {"intra_op_parallelism", 1}}},
      {"strata",
       {{"device", "auto"}, {"hbm_budget", hbm}, {"io_engine", "auto"}, {"model", model}}}};
  if (cuda) {
    c["zero_optimization"]["sub_group_size"] = 1e8;
    c["zero_optimization"]["stage3_max_live_parameters"] = 1e8;
    c["zero_optimization"]["stage3_param_persistence_threshold"] = 1e5;
    c["zero_optimization"]["stage3_prefetch_bucket_size"] = 1e8;
    c["zero_optimization"]["reduce_bucket_size"] = 5e7;
    c["aio"]["queue_depth"] = 16;
    c["strata"]["pinned_budget"] = pinned;
  }
  return c;
}

double MedianOf(std::vector<double> v) { return v.empty() ? NAN : Median(std::move(v)); }

Section Training(Runner& run, const Plan& p, const json& base, const std::string& dev,
                 const std::string& out_dir, const std::string& nvme_dir, bool cuda,
                 std::vector<Check>* checks) {
  Section s{.id = "training", .title = "Training: each placement of the example model"};
  s.device = dev == "cuda" ? "cuda" : "host backend (no GPU)";
  std::error_code ec;
  std::filesystem::create_directories(out_dir + "/configs", ec);
  const json& m = base["strata"]["model"];
  s.notes.push_back("model: " + std::to_string(m.value("layers", 0)) + " layers, hidden " +
                    std::to_string(m.value("hidden", 0)) + ", seq_len " +
                    std::to_string(m.value("seq_len", 0)) + "; " + std::to_string(p.train_steps) +
                    " steps per placement; HBM budget " +
                    base["strata"].value("hbm_budget", std::string("?")));
  struct Run {
    std::string name, cmd;
    json j;                 // the first round's run: losses, per-step phases
    std::vector<json> all;  // every round's
  };
  std::vector<Run> runs;
  std::vector<std::vector<std::string>> argvs;
  for (const Placement pl : kPlacements) {
    json c = base;
    json& z = c["zero_optimization"];
    z["offload_optimizer"] = {{"device", pl.opt}};
    z["offload_param"] = {{"device", pl.param}};
    if (std::string(pl.opt) == "nvme") {
      z["offload_optimizer"]["nvme_path"] = nvme_dir;
      z["offload_optimizer"]["buffer_count"] = 4;
    }
    if (std::string(pl.param) == "nvme") {
      z["offload_param"]["nvme_path"] = nvme_dir;
      z["offload_param"]["buffer_count"] = 8;
    }
    std::string name = std::string(pl.opt) + "/" + pl.param;
    std::string file = std::string(pl.opt) + "_" + pl.param;
    if (pl.other_speculation) {
      c["strata"]["speculative_step"] = !cuda;
      name += cuda ? ", step after backward" : ", speculative step";
      file += cuda ? "_after_backward" : "_speculative";
    }
    if (pl.delayed) {
      c["strata"]["delayed_param_update"] = true;
      name += ", delayed_param_update";
      file += "_delayed";
    }
    if (pl.states != nullptr) {
      c["strata"]["optimizer_states"] = pl.states;
      name += std::string(", ") + pl.states + " moments";
      file += std::string("_") + pl.states;
    }
    if (pl.split) {
      if (cuda) {
        z["offload_optimizer"]["ratio"] = "auto";
        c["strata"]["hbm_budget"] = SplitHbmBudget(c["strata"]["model"]);
        name += ", ratio auto (HBM budget " + c["strata"]["hbm_budget"].get<std::string>() + ")";
      } else {
        z["offload_optimizer"]["ratio"] = 0.5;
        name += ", ratio 0.5";
      }
      file += "_split";
    }
    const std::string path = out_dir + "/configs/" + file + ".json";
    std::ofstream(path) << c.dump(2) << "\n";
    argvs.push_back({"strata", "train", "--config", path, "--steps", std::to_string(p.train_steps),
                     "--device", dev, "--json"});
    runs.push_back({name, Rerun(argvs.back()), json(), {}});
  }
  // Rounds of every placement in turn, so that all see the same machine
  // noise; figures are medians over the rounds.
  bool stop = false;
  for (int round = 0; round < p.train_rounds; ++round) {
    for (size_t i = 0; i < runs.size(); ++i) {
      const std::string part =
          runs[i].name + (p.train_rounds > 1 ? ", round " + std::to_string(round + 1) : "");
      if (stop) {
        s.skipped.push_back(part + " (not started)");
        continue;
      }
      if (round == 0) s.commands.push_back(runs[i].cmd);
      json j;
      std::string why;
      if (!Record(s, run.RunJson("training", argvs[i], &j, &why), part, why)) {
        stop = true;
        continue;
      }
      if (round == 0) runs[i].j = j;
      runs[i].all.push_back(j);
    }
  }
  // A placement whose first round did not run is left out.
  std::erase_if(runs, [](const Run& r) { return r.all.empty(); });
  Settle(s, runs.size());
  json raw = json::object();
  for (const Run& r : runs) raw[r.name] = r.all;
  s.raw = raw;
  auto median_of = [](const Run& r, const char* key) {
    std::vector<double> v;
    for (const json& j : r.all) v.push_back(Num(j, key));
    return MedianOf(v);
  };
  if (runs.empty()) {
    checks->push_back(
        report::SkippedCheck("placements' losses agree", "<= 1e-3 relative", "no placement ran"));
    return s;
  }
  // The reference: the cpu placements (cpu/cpu, else cpu/none).
  const Run* ref = nullptr;
  for (const char* want : {"cpu/cpu", "cpu/none"})
    for (const Run& r : runs)
      if (!ref && r.name == want) ref = &r;
  double base_tps = NAN;
  for (const Run& r : runs)
    if (r.name == "none/none") base_tps = median_of(r, "tokens_per_s");
  Table t{.caption = "medians over the steps (and over " + std::to_string(p.train_rounds) +
                     " round(s) of the placements in turn)",
          .header = {"placement", "step time s", "tokens/s", "vs none/none", "bound efficiency",
                     "bound by", "final loss", "loss vs " + (ref ? ref->name : std::string("-"))}};
  report::StackedBarChart bars{
      .title = "Step time by phase (median step, " + s.device + ")",
      .y_label = "seconds",
      .parts = {"compute", "fetch wait (PCIe/NVMe)", "waiting for the optimizer", "other"}};
  report::LineChart loss{.title = "Loss per step", .x_label = "step", .y_label = "loss"};
  bool agree = true;
  std::string disagree;
  double worst_all = 0;
  for (const Run& r : runs) {
    const json& j = r.j;
    const double tps = median_of(r, "tokens_per_s");
    const double step_s = median_of(r, "step_time_s"), bound = median_of(r, "bound_efficiency");
    std::vector<double> losses = j.value("losses", std::vector<double>{});
    std::string vs_ref = "-";
    const bool rounded = r.name.ends_with(" moments");  // compact states: not fp32's bits
    if (r.name.ends_with("delayed_param_update")) {
      vs_ref = "stale by design";
    } else if (ref && &r != ref) {
      double worst = 0;
      int step = 0;
      const bool ok = report::LossesAgree(losses, ref->j.value("losses", std::vector<double>{}),
                                          1e-3, &worst, &step);
      vs_ref = std::isfinite(worst) ? report::Fixed(worst, 6) : "no losses";
      if (rounded) vs_ref += " (rounded states)";
      if (!rounded) worst_all = std::max(worst_all, worst);
      if (!ok && !rounded) {
        agree = false;
        disagree += (disagree.empty() ? "" : "; ") + r.name + " differs by " + vs_ref +
                    " at step " + std::to_string(step);
      }
    }
    t.rows.push_back({r.name, report::Fixed(step_s, 4), report::Fixed(tps, 0),
                      report::Fixed(tps / base_tps, 3), report::Fixed(bound, 3), Str(j, "bound_by"),
                      report::Fixed(Num(j, "final_loss"), 5), vs_ref});
    s.figures.push_back({r.name + " step time", step_s, "s", Str(j, "device"), r.cmd});
    s.figures.push_back({r.name + " tokens/s", tps, "tokens/s", Str(j, "device"), r.cmd});
    s.figures.push_back(
        {r.name + " tokens/s vs none/none", tps / base_tps, "ratio", Str(j, "device"), r.cmd});
    s.figures.push_back({r.name + " bound efficiency", bound, "ratio", Str(j, "device"), r.cmd});
    // Per-phase medians over the steps after the first (which warms up).
    std::vector<double> comp, fetch, opt, other;
    const json& steps = j.contains("per_step") ? j["per_step"] : json::array();
    for (size_t k = steps.size() > 1 ? 1 : 0; k < steps.size(); ++k) {
      const json& st = steps[k];
      const double o = Num(st, "optimizer_wall_s") + Num(st, "optimizer_wait_s");
      comp.push_back(Num(st, "compute_s"));
      fetch.push_back(Num(st, "fetch_wait_s"));
      opt.push_back(o);
      other.push_back(std::max(0.0, Num(st, "step_time_s") - comp.back() - fetch.back() - o));
    }
    bars.bars.push_back(
        {r.name, {MedianOf(comp), MedianOf(fetch), MedianOf(opt), MedianOf(other)}});
    report::Series ls{.name = r.name};
    for (size_t k = 0; k < losses.size(); ++k) ls.points.push_back({double(k + 1), losses[k]});
    loss.series.push_back(ls);
  }
  s.tables.push_back(t);
  s.charts.push_back(report::RenderStackedBars(bars));
  s.charts.push_back(report::RenderLineChart(loss));
  if (!ref || runs.size() < 2) {
    checks->push_back(report::SkippedCheck("placements' losses agree", "<= 1e-3 relative",
                                           "fewer than two placements ran, or no cpu placement"));
  } else {
    Check c = report::BoolCheck(
        "placements' losses agree", "<= 1e-3 relative", agree,
        agree ? "every placement within " + report::Fixed(worst_all, 6) + " of " + ref->name +
                    (cuda ? " (GPU placements against the cpu ones)" : "")
              : disagree,
        s.device, "strata train --config " + out_dir + "/configs/<placement>.json --json");
    c.measured = worst_all;
    checks->push_back(c);
  }
  // Compact states against the same placement in fp32, in the same run.
  for (const Run& r : runs) {
    if (!r.name.ends_with(" moments")) continue;
    const std::string of = r.name.substr(0, r.name.find(','));
    for (const Run& f : runs)
      if (f.name == of)
        s.figures.push_back({r.name + " tokens/s vs " + of,
                             median_of(r, "tokens_per_s") / median_of(f, "tokens_per_s"), "ratio",
                             Str(r.j, "device"), r.cmd});
  }
  // On a GPU, the offloaded placements' tokens/s against none/none, at the
  // defaults (the exact step: clipping on, speculation as auto picks it).
  if (cuda && std::isfinite(base_tps) && base_tps > 0) {
    for (const Run& r : runs) {
      double want = 0;
      if (r.name == "cpu/none") want = 0.65;
      if (r.name == "cpu/cpu") want = 0.6;
      if (r.name.starts_with("cpu/none, ratio auto")) want = 0.85;
      if (want == 0) continue;
      checks->push_back(report::RatioCheck(r.name + " tokens/s vs none/none",
                                           median_of(r, "tokens_per_s") / base_tps, want,
                                           "medians over the steps and rounds", s.device, r.cmd));
    }
  }
  return s;
}

// ---------------------------------------------------------------- GPU only

// A bench binary built beside this strata (BUILD/bench/NAME), or "".
std::string BenchBinary(const std::string& name) {
  const std::string path =
      std::filesystem::path(report::SelfExe()).parent_path().parent_path().parent_path() / "bench" /
      name;
  return access(path.c_str(), X_OK) == 0 ? path : std::string();
}

Section GpuAdam(Runner& run, const Plan& p, bool cuda, const std::string& no_gpu_reason) {
  Section s{.id = "gpu_adam", .title = "GPU optimizer: the device Adam against HBM bandwidth"};
  if (!cuda) {
    s.state = SectionState::kSkipped;
    s.reason = no_gpu_reason;
    return s;
  }
  const std::string bench = BenchBinary("bench_gpu_adam");
  if (bench.empty()) {
    s.state = SectionState::kSkipped;
    s.reason = "bench/bench_gpu_adam not found beside this strata (build the bench targets)";
    return s;
  }
  json rows = json::array();
  Table t{.caption = "AdamW step on the GPU (median)",
          .header = {"grad", "copy-out", "states", "Mparams/s", "GB/s moved", "D2D copy GB/s",
                     "of copy bandwidth"}};
  size_t done = 0;
  // (The state formats of strata.optimizer_states in HBM.)
  for (auto [grad, copy, moments] : std::vector<std::tuple<const char*, const char*, const char*>>{
           {"fp32", "none", "fp32"},
           {"bf16", "bf16", "fp32"},
           {"bf16", "bf16", "bf16"},
           {"bf16", "bf16", "bf16-master"},
           {"bf16", "bf16", "int8"}}) {
    const std::vector<std::string> argv = {
        bench,          "--device", "cuda",       "--params", p.gpu_adam_params,
        "--grad-dtype", grad,       "--copy-out", copy,       "--states",
        moments,        "--reps",   "10",         "--json"};
    const std::string cmd = Rerun(argv);
    s.commands.push_back(cmd);
    json j;
    std::string why;
    if (!Record(s, run.RunJson("gpu_adam", argv, &j, &why),
                std::string("grad ") + grad + " copy-out " + copy + " states " + moments, why))
      break;
    ++done;
    rows.push_back(j);
    s.device = Str(j, "device");
    t.rows.push_back({grad, copy, moments, report::Fixed(Num(j, "params_per_s") / 1e6, 0),
                      report::Fixed(Num(j, "adam_gbytes_per_s"), 1),
                      report::Fixed(Num(j, "d2d_copy_gbytes_per_s"), 1),
                      report::Fixed(Num(j, "fraction_of_copy"), 3)});
    const std::string what =
        std::string(" (grad ") + grad + ", copy-out " + copy + ", states " + moments + ")";
    s.figures.push_back(
        {"device Adam GB/s" + what, Num(j, "adam_gbytes_per_s"), "GB/s", s.device, cmd});
    s.figures.push_back(
        {"device Adam / D2D copy" + what, Num(j, "fraction_of_copy"), "ratio", s.device, cmd});
  }
  Settle(s, done);
  s.raw = rows;
  if (done > 0) s.tables.push_back(t);
  return s;
}

// The model's compute per micro-batch (the training run on the GPU: none/none
// if it ran) against bench_gemm: its GEMMs of one micro-batch, raw cuBLAS.
Section Gemm(Runner& run, const json& base, const Section& training, bool cuda,
             const std::string& no_gpu_reason) {
  Section s{.id = "gemm", .title = "GPU compute: the model's GEMMs against raw cuBLAS"};
  if (!cuda) {
    s.state = SectionState::kSkipped;
    s.reason = no_gpu_reason;
    return s;
  }
  const std::string bench = BenchBinary("bench_gemm");
  if (bench.empty()) {
    s.state = SectionState::kSkipped;
    s.reason = "bench/bench_gemm not found beside this strata (build the bench targets)";
    return s;
  }
  const json* train = nullptr;
  std::string placement;
  for (const char* want : {"none/none", "cpu/none", "cpu/cpu", "nvme/nvme"})
    if (!train && training.raw.is_object() && training.raw.contains(want)) {
      train = &training.raw[want][0];
      placement = want;
    }
  if (train == nullptr) {
    s.state = SectionState::kSkipped;
    s.reason = "no training run to compare with";
    return s;
  }
  const json& m = base["strata"]["model"];
  const int64_t tokens =
      base.value("train_micro_batch_size_per_gpu", int64_t{1}) * m.value("seq_len", int64_t{64});
  const int64_t gas = std::max<int64_t>(1, base.value("gradient_accumulation_steps", int64_t{1}));
  const std::string dtype = base.contains("bf16") && base["bf16"].value("enabled", false) ? "bf16"
                            : base.contains("fp16") && base["fp16"].value("enabled", false)
                                ? "fp16"
                                : "fp32";
  const std::vector<std::string> argv = {bench,
                                         "--layers",
                                         std::to_string(m.value("layers", 4)),
                                         "--hidden",
                                         std::to_string(m.value("hidden", 256)),
                                         "--tokens",
                                         std::to_string(tokens),
                                         "--vocab",
                                         std::to_string(m.value("vocab", 256)),
                                         "--dtype",
                                         dtype,
                                         "--reps",
                                         "10",
                                         "--json"};
  const std::string cmd = Rerun(argv);
  s.commands.push_back(cmd);
  json j;
  std::string why;
  if (!Record(s, run.RunJson("gemm", argv, &j, &why), "bench_gemm", why)) {
    Settle(s, 0);
    return s;
  }
  s.raw = {{"bench_gemm", j}, {"placement", placement}};
  s.device = Str(j, "device");
  std::vector<double> compute;
  if (train->contains("per_step"))
    for (size_t k = (*train)["per_step"].size() > 1 ? 1 : 0; k < (*train)["per_step"].size(); ++k)
      compute.push_back(Num((*train)["per_step"][k], "compute_s"));
  const double model_s = MedianOf(compute) / static_cast<double>(gas);
  const double gemm_s = Num(j, "gemm_s_per_micro_batch");
  s.notes.push_back("The model's compute per micro-batch (" + placement +
                    ", median step's compute / " + std::to_string(gas) +
                    " micro-batches) against its GEMMs alone, timed raw: the rest is the model's "
                    "own kernels and launch gaps.");
  s.tables.push_back(
      {.caption = "one micro-batch",
       .header = {"GEMMs", "TFLOP/s raw", "raw GEMM ms", "model compute ms", "GEMM / compute"},
       .rows = {{std::to_string(j.value("gemms_per_micro_batch", 0)),
                 report::Fixed(Num(j, "tflops"), 1), report::Fixed(gemm_s * 1e3, 3),
                 report::Fixed(model_s * 1e3, 3), report::Fixed(gemm_s / model_s, 3)}}});
  s.figures.push_back({"raw cuBLAS GEMMs per micro-batch", gemm_s, "s", s.device, cmd});
  s.figures.push_back({"raw cuBLAS GEMM throughput", Num(j, "tflops"), "TFLOP/s", s.device, cmd});
  s.figures.push_back({"model compute per micro-batch (" + placement + ")", model_s, "s", s.device,
                       "strata train ... (the training section's " + placement + " run)"});
  s.figures.push_back(
      {"raw GEMM time / model compute time", gemm_s / model_s, "ratio", s.device, cmd});
  return s;
}

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
