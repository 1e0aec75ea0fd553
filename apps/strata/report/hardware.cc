// strata report's sections about the machine itself (sections.h): the
// machine, PCIe, the CPU Adam, NVMe and the device Adam.
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
#include "apps/strata/report/report_html.h"
#include "apps/strata/report/sections.h"
#include "src/common/units.h"
#include "strata/build_config.h"
#include "strata/strata.h"

namespace strata::cli::report {

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

namespace {

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

}  // namespace

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

}  // namespace strata::cli::report
