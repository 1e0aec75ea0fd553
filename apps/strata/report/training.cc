// strata report's training runs of each placement and the model's GEMMs
// against raw cuBLAS (sections.h).
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
#include "examples/train/model.h"
#include "src/common/units.h"
#include "strata/build_config.h"
#include "strata/strata.h"

namespace strata::cli::report {

// ---------------------------------------------------------------- training

namespace {

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

}  // namespace

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

}  // namespace strata::cli::report
