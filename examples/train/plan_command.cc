// `strata plan`: the tier plan, the predicted step and the largest model of
// the config's width, for the example model, without training (train.h).
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>

#include "apps/strata/exit_codes.h"
#include "examples/train/model.h"
#include "examples/train/train.h"
#include "src/common/log.h"
#include "src/common/units.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/nvme/nvme_bench.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/plan.h"
#include "src/scheduler/rate_probes.h"

namespace strata::example {
namespace {

using scheduler::LayoutSizes;
using scheduler::Placement;
using scheduler::TierFacts;
using scheduler::TierPlan;

// The example model's layout for `shape`, as the engine lays it out.
LayoutSizes SizesOf(const ModelShape& shape, DType dtype, const Config& config) {
  std::vector<scheduler::ParamRec> recs;
  for (const ParamInfo& p : ParameterList(shape)) {
    scheduler::ParamRec r;
    r.name = p.name;
    r.numel = p.numel;
    r.dtype = dtype;
    r.module = p.module;
    recs.push_back(std::move(r));
  }
  return LayoutSizes::Of(
      scheduler::Layout::Build(std::move(recs), scheduler::LayoutOptionsFromConfig(config)));
}

// The config's width with the blocks that make about `params` elements (at least one).
ModelShape ShapeWithParams(ModelShape shape, int64_t params) {
  shape.layers = 1;
  const int64_t one = shape.num_parameters();
  shape.layers = 2;
  const int64_t per_block = std::max<int64_t>(1, shape.num_parameters() - one);
  shape.layers = std::max<int64_t>(1, 1 + (params - one + per_block / 2) / per_block);
  return shape;
}

// The most blocks of the config's width whose plan fits (0 if none does;
// capped at 2^20 blocks when nothing bounds it).
ModelShape LargestThatFits(ModelShape shape, DType dtype, const Config& config,
                           const Placement& placement, const TierFacts& facts) {
  auto fits = [&](int64_t layers) {
    shape.layers = layers;
    return scheduler::ComputeTierPlan(placement, SizesOf(shape, dtype, config), facts).fits;
  };
  int64_t lo = 0, hi = 1;
  while (hi <= (int64_t{1} << 20) && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  hi = std::min<int64_t>(hi, int64_t{1} << 20);
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  shape.layers = lo;
  return shape;
}

std::string Seconds(double s) { return s > 0 ? fmt::format("{:.3f} s", s) : "-"; }

}  // namespace

int RunPlanCommand(const PlanCommandOptions& opt, std::ostream& out, std::ostream& err) {
  using namespace cli;  // the exit codes (apps/strata/exit_codes.h)
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
  StatusOr<ModelShape> given = ShapeFromConfig(config);
  if (!given.ok()) return fail(kExitConfig, given.status());
  const ModelShape shape = opt.params > 0 ? ShapeWithParams(*given, opt.params) : *given;
  const DType dtype = ParamDTypeFromConfig(config);
  if (Status s = PrepareNvmePaths(config); !s.ok()) return fail(ExitCodeOf(s), s);

  // The device (its arena: the HBM budget) and the engine's probes.
  StatusOr<gpu::DeviceOptions> dopts = gpu::DeviceOptionsFromConfig(config);
  if (!dopts.ok()) return fail(kExitConfig, dopts.status());
  StatusOr<std::unique_ptr<gpu::Device>> dev = gpu::CreateDevice(*dopts);
  if (!dev.ok()) return fail(ExitCodeOf(dev.status()), dev.status());
  Placement placement = Placement::FromConfig(config);
  placement.device_optimizer = placement.optimizer == OffloadDevice::kNone && !(*dev)->is_host();
  placement.host_device = (*dev)->is_host();
  TierFacts facts = scheduler::MeasureTierFacts(
      static_cast<int64_t>((*dev)->Stats().budget_bytes), config.strata.pinned_budget_bytes,
      scheduler::UsedNvmePaths(config), config.strata.dram_budget_bytes);
  cpu_adam::Options aopts;
  aopts.threads = static_cast<int>(config.strata.threads);
  StatusOr<std::unique_ptr<cpu_adam::CpuOptimizer>> adam = cpu_adam::CpuOptimizer::Create(aopts);
  if (!adam.ok()) return fail(ExitCodeOf(adam.status()), adam.status());
  const LayoutSizes sizes = SizesOf(shape, dtype, config);
  StatusOr<scheduler::PlanRates> measured = scheduler::MeasurePlanRates(
      dev->get(), adam->get(), sizes.total_elems, !placement.device_optimizer);
  if (!measured.ok()) return fail(ExitCodeOf(measured.status()), measured.status());
  facts.d2h_pinned_gbps = measured->link.d2h_gbytes_per_s;
  facts.d2h_pageable_gbps = measured->link.d2h_pageable_gbytes_per_s;
  facts.accumulate_gbps = measured->accumulate_gbps;
  scheduler::StepRates rates;
  rates.h2d_gbps = measured->link.h2d_gbytes_per_s;
  rates.d2h_gbps = measured->link.d2h_gbytes_per_s;
  rates.accumulate_gbps = measured->accumulate_gbps;
  rates.adam_elems_per_s = measured->adam_elems_per_s;
  std::string nvme_rates = "no NVMe tier";
  if (!facts.nvme_paths.empty() && opt.measure_nvme) {
    StatusOr<nvme::NvmeBenchResult> r =
        scheduler::MeasureDiskRates(config, facts.nvme_paths[0], uint64_t{256} << 20);
    if (!r.ok()) return fail(ExitCodeOf(r.status()), r.status());
    rates.nvme_read_gbps = r->read_gbytes_per_s;
    rates.nvme_write_gbps = r->write_gbytes_per_s;
    nvme_rates =
        fmt::format("engine ({}), 256 MiB sequential on {}", r->engine, facts.nvme_paths[0]);
  } else if (!facts.nvme_paths.empty()) {
    nvme_rates = "not measured (--no-nvme-bench)";
  }
  const TierPlan plan = scheduler::ComputeTierPlan(placement, sizes, facts);
  const scheduler::StepPrediction pred = scheduler::PredictStep(placement, sizes, plan, rates);
  const ModelShape largest = LargestThatFits(shape, dtype, config, placement, facts);
  // What stops one more block.
  std::string limited_by;
  {
    ModelShape next = largest;
    ++next.layers;
    const TierPlan over =
        scheduler::ComputeTierPlan(placement, SizesOf(next, dtype, config), facts);
    for (const TierBudget& t : over.budgets)
      if (t.available_bytes > 0 && t.needed_bytes > t.available_bytes)
        limited_by += (limited_by.empty() ? "" : ", ") + t.tier;
  }

  const std::string place =
      fmt::format("offload_optimizer {}, offload_param {}{}",
                  OffloadDeviceName(placement.optimizer), OffloadDeviceName(placement.params),
                  placement.device_optimizer ? " (optimizer on the GPU)" : "");
  if (opt.json) {
    nlohmann::json j;
    j["config"] = opt.config_path;
    j["device"] = (*dev)->Describe();
    j["placement"] = place;
    j["model"] = {{"layers", shape.layers},
                  {"hidden", shape.hidden},
                  {"parameters", shape.num_parameters()},
                  {"dtype", std::string(DTypeName(dtype))}};
    j["fits"] = plan.fits;
    j["tiers"] = nlohmann::json::array();
    for (const TierBudget& t : plan.budgets)
      j["tiers"].push_back({{"tier", t.tier},
                            {"needed_bytes", t.needed_bytes},
                            {"available_bytes", t.available_bytes},
                            {"detail", t.detail}});
    j["host_bytes"] = plan.host_bytes;
    j["gradient_path"] = plan.grad_path;
    j["rates"] = {{"h2d_gbytes_per_s", rates.h2d_gbps},
                  {"d2h_gbytes_per_s", rates.d2h_gbps},
                  {"accumulate_gbytes_per_s", rates.accumulate_gbps},
                  {"cpu_adam_elems_per_s", rates.adam_elems_per_s},
                  {"nvme_read_gbytes_per_s", rates.nvme_read_gbps},
                  {"nvme_write_gbytes_per_s", rates.nvme_write_gbps},
                  {"nvme", nvme_rates}};
    j["step"] = nlohmann::json::array();
    for (const auto& t : pred.terms)
      j["step"].push_back({{"resource", t.resource},
                           {"amount", t.amount},
                           {"seconds", t.seconds},
                           {"what", t.what}});
    j["bound_s"] = pred.bound_s;
    j["bound_by"] = pred.bound_by;
    j["largest"] = {{"layers", largest.layers},
                    {"parameters", largest.layers > 0 ? largest.num_parameters() : 0},
                    {"limited_by", limited_by}};
    out << j.dump(1) << std::endl;
  } else {
    out << fmt::format("config     {}\ndevice     {}\nplacement  {}\n", opt.config_path,
                       (*dev)->Describe(), place);
    out << fmt::format("model      {} blocks x hidden {}: {} parameters ({})\n\n", shape.layers,
                       shape.hidden, shape.num_parameters(), DTypeName(dtype));
    out << fmt::format("{:<7} {:>11} {:>11}  {}\n", "tier", "needed", "available", "holds");
    for (const TierBudget& t : plan.budgets)
      out << fmt::format(
          "{:<7} {:>11} {:>11}  {}{}\n", t.tier, FormatBytes(t.needed_bytes),
          t.available_bytes > 0 ? FormatBytes(t.available_bytes) : "-", t.detail,
          t.available_bytes > 0 && t.needed_bytes > t.available_bytes ? "  <-- over" : "");
    out << fmt::format("{:<7} {:>11} {:>11}  {}\n", "host", FormatBytes(plan.host_bytes), "-",
                       placement.host_device
                           ? "what the process allocates in host memory: pinned + dram + hbm "
                             "(the host device's)"
                           : "what the process allocates in host memory: pinned + dram");
    out << fmt::format(
        "\npredicted step (one window of {} micro-batch{}), at the measured rates:\n",
        placement.gradient_accumulation_steps,
        placement.gradient_accumulation_steps == 1 ? "" : "es");
    for (const auto& t : pred.terms)
      out << fmt::format("  {:<15} {:>10}  {}\n", t.resource, Seconds(t.seconds), t.what);
    out << fmt::format("  bound: {} by {} (compute not included)\n", Seconds(pred.bound_s),
                       pred.bound_by.empty() ? "-" : pred.bound_by);
    out << fmt::format(
        "rates: PCIe h2d {:.2f} GB/s, d2h {:.2f} GB/s; CPU Adam {:.0f} M elements/s, accumulate "
        "{:.2f} GB/s; NVMe read {:.2f} GB/s, write {:.2f} GB/s ({})\n",
        rates.h2d_gbps, rates.d2h_gbps, rates.adam_elems_per_s * 1e-6, rates.accumulate_gbps,
        rates.nvme_read_gbps, rates.nvme_write_gbps, nvme_rates);
    out << fmt::format("largest that fits: {} blocks x hidden {}: {} parameters (then {} over)\n",
                       largest.layers, largest.hidden,
                       largest.layers > 0 ? largest.num_parameters() : 0,
                       limited_by.empty() ? "nothing" : limited_by);
    out << (plan.fits ? "fits\n" : "does not fit (see the rows marked over)\n");
  }
  return plan.fits ? kExitOk : kExitResource;
}

}  // namespace strata::example
