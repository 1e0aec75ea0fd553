// strata plan: a dry run of `strata train` with a config — the tier table,
// the predicted step per resource and the largest model that fits, without
// allocating any state. The plan is the public one (strata/plan.h, Planner),
// for the example model's parameters (examples/train).
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "apps/strata/train/train.h"
#include "examples/train/model.h"
#include "src/common/dtype.h"
#include "src/common/units.h"
#include "src/gpu/device.h"
#include "src/gpu/gpu_presets.h"
#include "strata/plan.h"

namespace strata::cli {
namespace {

using example::kMaxModelLayers;
using example::ModelShape;

struct PlanCommandOptions {
  std::string config_path;
  std::string nvme_path;
  std::string device;
  std::string gpu;           // plan for this GPU preset, described (PlanOptions::gpu)
  int64_t params = 0;        // 0: the config's strata.model
  bool measure_nvme = true;  // write and read 256 MiB on the NVMe directory
  bool json = false;
};

// The disk probe's size (the engine's, at Plan()).
constexpr int64_t kNvmeProbeBytes = int64_t{256} << 20;

// The example model's parameters for `shape`.
std::vector<PlanParam> ParamsOf(const ModelShape& shape, DType dtype) {
  std::vector<PlanParam> out;
  for (const example::ParamInfo& p : example::ParameterList(shape))
    out.push_back({p.name, p.numel, dtype, p.module});
  return out;
}

// The config's width with the blocks that make about `params` elements (at
// least one), from the sizes alone. More blocks than the example model has
// (kMaxModelLayers) is ResourceExhausted naming the parameters' bytes: such
// a model is not laid out (its layout would hold an entry per tensor).
StatusOr<ModelShape> ShapeWithParams(ModelShape shape, int64_t params, DType dtype) {
  shape.layers = 1;
  const int64_t one = shape.num_parameters();
  shape.layers = 2;
  const int64_t per_block = std::max<int64_t>(1, shape.num_parameters() - one);
  const int64_t extra = std::max<int64_t>(0, params - one);
  const int64_t blocks = extra / per_block + (extra % per_block >= (per_block + 1) / 2 ? 1 : 0);
  if (blocks >= kMaxModelLayers) {
    const auto bytes =
        static_cast<long double>(params) * static_cast<long double>(DTypeSize(dtype));
    shape.layers = kMaxModelLayers;
    return ResourceExhaustedError(fmt::format(
        "--params {}: at hidden {} that is about {} blocks, more than the example model's {} "
        "(at most {} parameters at this width); the parameters alone would need {:.0f} bytes "
        "({} each, before gradients and optimizer states)",
        params, shape.hidden, blocks + 1, kMaxModelLayers, shape.num_parameters(),
        static_cast<double>(bytes), DTypeSize(dtype)));
  }
  shape.layers = 1 + blocks;
  return shape;
}

// The plan of the example model of `shape`.
StatusOr<PlanResult> PlanOf(const Planner& planner, const ModelShape& shape, DType dtype) {
  return planner.Plan(ParamsOf(shape, dtype));
}

// The most blocks of the config's width whose plan fits (0 if none does;
// capped at the example model's kMaxModelLayers when nothing bounds it). A
// plan refused from the sizes alone (ResourceExhausted) does not fit.
StatusOr<ModelShape> LargestThatFits(ModelShape shape, DType dtype, const Planner& planner) {
  auto fits = [&](int64_t layers) -> StatusOr<bool> {
    shape.layers = layers;
    StatusOr<PlanResult> plan = PlanOf(planner, shape, dtype);
    if (!plan.ok() && plan.status().code() == StatusCode::kResourceExhausted) return false;
    STRATA_RETURN_IF_ERROR(plan.status());
    return plan->fits;
  };
  int64_t lo = 0, hi = 1;
  while (hi <= kMaxModelLayers) {
    STRATA_ASSIGN_OR_RETURN(const bool ok, fits(hi));
    if (!ok) break;
    lo = hi;
    hi *= 2;
  }
  if (hi > kMaxModelLayers) {  // every power of two up to the cap fits: try the cap itself
    STRATA_ASSIGN_OR_RETURN(const bool ok, fits(kMaxModelLayers));
    if (ok) lo = kMaxModelLayers;
    hi = kMaxModelLayers + (ok ? 1 : 0);
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    STRATA_ASSIGN_OR_RETURN(const bool ok, fits(mid));
    (ok ? lo : hi) = mid;
  }
  shape.layers = lo;
  return shape;
}

// The tiers over budget in the plan of one more block than `largest`.
StatusOr<std::string> WhatStopsOneMoreBlock(ModelShape largest, DType dtype,
                                            const Planner& planner) {
  if (largest.layers >= kMaxModelLayers)
    return fmt::format("the example model's {} blocks", kMaxModelLayers);
  ++largest.layers;
  StatusOr<PlanResult> plan = PlanOf(planner, largest, dtype);
  if (!plan.ok() && plan.status().code() == StatusCode::kResourceExhausted)
    return std::string("every tier together");
  STRATA_RETURN_IF_ERROR(plan.status());
  const PlanResult& over = *plan;
  std::string limited_by;
  for (const TierBudget& t : over.budgets)
    if (t.available_bytes > 0 && t.needed_bytes > t.available_bytes)
      limited_by += (limited_by.empty() ? "" : ", ") + t.tier;
  return limited_by;
}

std::string Seconds(double s) { return s > 0 ? fmt::format("{:.3f} s", s) : "-"; }

// Everything the command prints.
struct PlanReport {
  std::string config_path, device, placement, nvme_rates;
  ModelShape shape, largest;
  DType dtype = DType::kBf16;
  bool host_device = false;
  bool described_gpu = false;  // planned for a GPU not opened here
  int64_t accumulation = 1;
  PlanRates rates;
  PlanResult plan;
  std::string limited_by;
};

std::string ReportJson(const PlanReport& p) {
  nlohmann::json j;
  j["config"] = p.config_path;
  j["device"] = p.device;
  j["placement"] = p.placement;
  j["model"] = {{"layers", p.shape.layers},
                {"hidden", p.shape.hidden},
                {"parameters", p.shape.num_parameters()},
                {"dtype", std::string(DTypeName(p.dtype))}};
  j["fits"] = p.plan.fits;
  j["tiers"] = nlohmann::json::array();
  for (const TierBudget& t : p.plan.budgets)
    j["tiers"].push_back({{"tier", t.tier},
                          {"needed_bytes", t.needed_bytes},
                          {"available_bytes", t.available_bytes},
                          {"detail", t.detail}});
  j["host_bytes"] = p.plan.host_bytes;
  j["gradient_path"] = p.plan.gradient_path;
  j["device_step"] = p.plan.device_step;
  j["bound_all_on_cpu_s"] = p.plan.bound_all_on_cpu_s;
  j["rates"] = {{"h2d_gbytes_per_s", p.rates.h2d_gbytes_per_s},
                {"d2h_gbytes_per_s", p.rates.d2h_gbytes_per_s},
                {"accumulate_gbytes_per_s", p.rates.accumulate_gbytes_per_s},
                {"cpu_adam_elems_per_s", p.rates.cpu_adam_elements_per_s},
                {"nvme_read_gbytes_per_s", p.rates.nvme_read_gbytes_per_s},
                {"nvme_write_gbytes_per_s", p.rates.nvme_write_gbytes_per_s},
                {"device_copy_gbytes_per_s", p.rates.device_copy_gbytes_per_s},
                {"nvme", p.nvme_rates}};
  j["nominal"] = p.rates.nominal;
  j["step"] = nlohmann::json::array();
  for (const PredictedTerm& t : p.plan.step)
    j["step"].push_back(
        {{"resource", t.resource}, {"amount", t.amount}, {"seconds", t.seconds}, {"what", t.what}});
  j["bound_s"] = p.plan.bound_s;
  j["bound_by"] = p.plan.bound_by;
  j["largest"] = {{"layers", p.largest.layers},
                  {"parameters", p.largest.layers > 0 ? p.largest.num_parameters() : 0},
                  {"limited_by", p.limited_by}};
  return j.dump(1);
}

std::string ReportTable(const PlanReport& p) {
  std::string out = fmt::format("config     {}\ndevice     {}\nplacement  {}\n", p.config_path,
                                p.device, p.placement);
  out += fmt::format("model      {} blocks x hidden {}: {} parameters ({})\n\n", p.shape.layers,
                     p.shape.hidden, p.shape.num_parameters(), DTypeName(p.dtype));
  out += fmt::format("{:<7} {:>11} {:>11}  {}\n", "tier", "needed", "available", "holds");
  for (const TierBudget& t : p.plan.budgets)
    out += fmt::format(
        "{:<7} {:>11} {:>11}  {}{}\n", t.tier, FormatBytes(t.needed_bytes),
        t.available_bytes > 0 ? FormatBytes(t.available_bytes) : "-", t.detail,
        t.available_bytes > 0 && t.needed_bytes > t.available_bytes ? "  <-- over" : "");
  out +=
      fmt::format("{:<7} {:>11} {:>11}  {}\n", "host", FormatBytes(p.plan.host_bytes), "-",
                  p.host_device ? "what the process allocates in host memory: pinned + dram + hbm "
                                  "(the host device's)"
                                : "what the process allocates in host memory: pinned + dram");
  out += fmt::format("\npredicted step (one window of {} micro-batch{}), at the {} rates:\n",
                     p.accumulation, p.accumulation == 1 ? "" : "es",
                     p.rates.nominal.empty() ? "measured" : "measured and nominal");
  for (const PredictedTerm& t : p.plan.step)
    out += fmt::format("  {:<15} {:>10}  {}\n", t.resource, Seconds(t.seconds), t.what);
  out += fmt::format("  bound: {} by {} (compute not included)\n", Seconds(p.plan.bound_s),
                     p.plan.bound_by.empty() ? "-" : p.plan.bound_by);
  if (!p.plan.device_step.empty()) out += "  " + p.plan.device_step + "\n";
  if (p.plan.bound_all_on_cpu_s > 0)
    out += fmt::format(
        "  with every sub-group on the CPU (ratio 1) the bound is {}{}\n",
        Seconds(p.plan.bound_all_on_cpu_s),
        p.rates.device_copy_gbytes_per_s > 0
            ? ""
            : " (the device Adam's time is not predicted: no device copy rate on this device)");
  out += fmt::format(
      "rates: PCIe h2d {:.2f} GB/s, d2h {:.2f} GB/s; CPU Adam {:.0f} M elements/s, accumulate "
      "{:.2f} GB/s; NVMe read {:.2f} GB/s, write {:.2f} GB/s ({}){}\n",
      p.rates.h2d_gbytes_per_s, p.rates.d2h_gbytes_per_s, p.rates.cpu_adam_elements_per_s * 1e-6,
      p.rates.accumulate_gbytes_per_s, p.rates.nvme_read_gbytes_per_s,
      p.rates.nvme_write_gbytes_per_s, p.nvme_rates,
      p.rates.device_copy_gbytes_per_s > 0
          ? fmt::format("; device copy {:.0f} GB/s", p.rates.device_copy_gbytes_per_s)
          : "");
  if (!p.rates.nominal.empty()) {
    std::string names;
    for (const std::string& n : p.rates.nominal) names += (names.empty() ? "" : ", ") + n;
    out += fmt::format("nominal, not measured here: {}{}\n", names,
                       p.described_gpu ? " (a GPU described, not opened: datasheet memory; "
                                         "links at 0.8 of their raw rate); the CPU's rates "
                                         "are this machine's"
                                       : "");
  }
  out += fmt::format("largest that fits: {} blocks x hidden {}: {} parameters (then {} over)\n",
                     p.largest.layers, p.largest.hidden,
                     p.largest.layers > 0 ? p.largest.num_parameters() : 0,
                     p.limited_by.empty() ? "nothing" : p.limited_by);
  out += p.plan.fits ? "fits\n" : "does not fit (see the rows marked over)\n";
  return out;
}

// The command: returns the exit code (0 the plan fits, 4 it does not).
int RunPlanCommand(const PlanCommandOptions& opt, std::ostream& out, std::ostream& err) {
  auto fail = [&](int code, const Status& s) {
    err << "strata plan: " << s.ToString() << std::endl;
    if (opt.json) out << nlohmann::json{{"error", s.ToString()}}.dump() << std::endl;
    return code;
  };
  int code = 0;
  StatusOr<Config> loaded = LoadCommandConfig(opt.config_path, opt.nvme_path, opt.device, &code);
  if (!loaded.ok()) return fail(code, loaded.status());
  const Config& config = *loaded;
  if (opt.params < 0)
    return fail(kExitUsage,
                InvalidArgumentError(fmt::format("--params: {} must be at least 1", opt.params)));
  StatusOr<ModelShape> given = example::ShapeFromConfig(config);
  if (!given.ok()) return fail(kExitConfig, given.status());
  PlanReport p;
  p.config_path = opt.config_path;
  p.dtype = example::ParamDTypeFromConfig(config);
  if (opt.params > 0) {
    StatusOr<ModelShape> sized = ShapeWithParams(*given, opt.params, p.dtype);
    if (!sized.ok()) return fail(ExitCodeOf(sized.status()), sized.status());
    p.shape = *sized;
  } else {
    p.shape = *given;
  }
  p.accumulation = config.gradient_accumulation_steps;
  // Planning a GPU machine from one without its GPU (--gpu, or a config
  // naming cuda where there is none): its NVMe directories are that
  // machine's, so one missing here is left alone (not created).
  const bool other_machine = !opt.gpu.empty() || (config.strata.device == DeviceKind::kCuda &&
                                                  gpu::ListCudaDevices().devices.empty());
  if (Status s = PrepareNvmePaths(config, /*create_missing=*/!other_machine); !s.ok())
    return fail(ExitCodeOf(s), s);

  // The device (its arena: the HBM budget) and the engine's probes.
  PlanOptions popts;
  popts.gpu = opt.gpu;
  popts.nvme_probe_bytes = opt.measure_nvme ? kNvmeProbeBytes : 0;
  popts.cpu_probe_elements = p.shape.num_parameters();
  StatusOr<std::unique_ptr<Planner>> planner = Planner::Create(config, popts);
  if (!planner.ok()) {
    const StatusCode c = planner.status().code();
    return fail(c == StatusCode::kInvalidArgument ? kExitConfig : ExitCodeOf(planner.status()),
                planner.status());
  }
  const Planner& pl = **planner;
  p.device = pl.DeviceName();
  p.host_device = pl.DeviceIsHost();
  p.rates = pl.Rates();
  p.described_gpu = p.device.starts_with("cuda (described");
  const auto& nominal = p.rates.nominal;
  if (p.rates.nvme_path.empty())
    p.nvme_rates = "no NVMe tier";
  else if (std::find(nominal.begin(), nominal.end(), "nvme") != nominal.end())
    p.nvme_rates =
        fmt::format("{} is not here: not measured, its free space not checked", p.rates.nvme_path);
  else if (!p.rates.nvme_engine.empty())
    p.nvme_rates = fmt::format("engine ({}), 256 MiB sequential on {}", p.rates.nvme_engine,
                               p.rates.nvme_path);
  else
    p.nvme_rates = "not measured (--no-nvme-bench)";
  p.placement = fmt::format("offload_optimizer {}, offload_param {}{}",
                            OffloadDeviceName(config.zero_optimization.offload_optimizer.device),
                            OffloadDeviceName(config.zero_optimization.offload_param.device),
                            pl.OptimizerOnDevice() ? " (optimizer on the GPU)" : "");
  StatusOr<PlanResult> plan = PlanOf(pl, p.shape, p.dtype);
  if (!plan.ok()) return fail(ExitCodeOf(plan.status()), plan.status());
  p.plan = *plan;
  StatusOr<ModelShape> largest = LargestThatFits(p.shape, p.dtype, pl);
  if (!largest.ok()) return fail(ExitCodeOf(largest.status()), largest.status());
  p.largest = *largest;
  StatusOr<std::string> limited_by = WhatStopsOneMoreBlock(p.largest, p.dtype, pl);
  if (!limited_by.ok()) return fail(ExitCodeOf(limited_by.status()), limited_by.status());
  p.limited_by = *limited_by;

  if (opt.json)
    out << ReportJson(p) << std::endl;
  else
    out << ReportTable(p);
  return p.plan.fits ? kExitOk : kExitResource;
}

CommandRegistrar reg("", [](CLI::App& app, CliResult& r) {
  auto* cmd = app.add_subcommand(
      "plan",
      "Show what `strata train` would place where, the predicted step time per resource from "
      "measured rates, and the largest model that fits, without training (exit 4 if it does not "
      "fit)");
  auto opt = std::make_shared<PlanCommandOptions>();
  cmd->add_option("--config", opt->config_path, "DeepSpeed/Strata JSON config")->required();
  cmd->add_option("--params", opt->params,
                  "Plan a model of about this many parameters (the config's width, as many "
                  "blocks as that takes; 1.5B, 270M, ...) instead of strata.model")
      ->transform(CountSuffix(/*min=*/1));
  cmd->add_option("--nvme-path", opt->nvme_path,
                  "Directory for NVMe-offloaded states; overrides the config's nvme_path");
  cmd->add_option("--device", opt->device, "Override strata.device: auto, cuda or host");
  cmd->add_option("--gpu", opt->gpu,
                  "Plan for this GPU, described rather than opened (datasheet memory, nominal "
                  "PCIe and memory rates): " +
                      gpu::GpuPresetNames() +
                      ". Without it, a config naming cuda on a machine without a GPU plans a "
                      "GPU of strata.hbm_budget bytes")
      ->check([](const std::string& v) {
        return gpu::FindGpuPreset(v) != nullptr ? std::string()
                                                : v + " is not one of " + gpu::GpuPresetNames();
      });
  cmd->add_flag("--no-nvme-bench{false}", opt->measure_nvme,
                "Do not measure the NVMe directory (256 MiB written and read)");
  cmd->add_flag("--json", opt->json, "Print one JSON object instead of the tables");
  cmd->callback([&r, opt] { r.exit_code = RunPlanCommand(*opt, std::cout, std::cerr); });
});

}  // namespace
}  // namespace strata::cli
