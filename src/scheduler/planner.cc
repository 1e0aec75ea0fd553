// strata::Planner (include/strata/plan.h): the tier plan and the predicted
// step of Engine::Plan(), from the same pieces (plan.h, rate_probes.h), for
// parameters that are only described.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "src/common/status_util.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/gpu/gpu_presets.h"
#include "src/scheduler/hyperparams.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/plan.h"
#include "src/scheduler/rate_probes.h"
#include "strata/plan.h"

namespace strata {
namespace {

// The device a plan is for: one opened here, or a GPU only described
// (PlanOptions::gpu; strata.device "cuda" without a device here).
struct DescribedGpu {
  std::string name;             // "NVIDIA H100 SXM5 80GB", or "a GPU"
  int64_t budget_bytes = 0;     // the arena's budget
  double link_gbps = 0;         // nominal pinned copy rate per direction
  double device_copy_gbps = 0;  // nominal; 0 unknown
  bool budget_nominal = false;  // from the preset's memory, not strata.hbm_budget
};

bool IsDirectory(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

class PlannerImpl final : public Planner {
 public:
  PlannerImpl(Config config, std::unique_ptr<gpu::Device> dev)
      : config_(std::move(config)), dev_(std::move(dev)) {}
  PlannerImpl(Config config, DescribedGpu described)
      : config_(std::move(config)), described_(std::move(described)) {}

  Status Init(const PlanOptions& options) {
    const bool host = dev_ != nullptr && dev_->is_host();
    placement_ = scheduler::Placement::FromConfig(config_);
    placement_.device_optimizer =
        placement_.optimizer == OffloadDevice::kNone && !host;  // as the engine
    placement_.host_device = host;
    const int64_t budget = dev_ != nullptr ? static_cast<int64_t>(dev_->Stats().budget_bytes)
                                           : described_.budget_bytes;
    facts_ = scheduler::MeasureTierFacts(budget, config_.strata.pinned_budget_bytes,
                                         scheduler::UsedNvmePaths(config_),
                                         config_.strata.dram_budget_bytes);
    cpu_adam::Options aopts;
    aopts.threads = static_cast<int>(config_.strata.threads);
    ASSIGN_OR_RETURN(std::unique_ptr<cpu_adam::CpuOptimizer> adam,
                     cpu_adam::CpuOptimizer::Create(aopts));
    const int64_t elems =
        options.cpu_probe_elements > 0 ? options.cpu_probe_elements : int64_t{1} << 23;
    ASSIGN_OR_RETURN(
        scheduler::PlanRates measured,
        scheduler::MeasurePlanRates(dev_.get(), adam.get(), elems, !placement_.device_optimizer,
                                    config_.strata.optimizer_states));
    if (dev_ == nullptr) {  // nominal figures of the described GPU
      measured.link.h2d_gbytes_per_s = described_.link_gbps;
      measured.link.d2h_gbytes_per_s = described_.link_gbps;
      measured.link.d2h_pageable_gbytes_per_s = described_.link_gbps / 2;
      measured.link.d2d_gbytes_per_s = described_.device_copy_gbps;
      if (described_.budget_nominal) rates_.nominal.push_back("hbm_budget");
      for (const char* n : {"h2d", "d2h", "d2h_pageable", "device_copy"})
        rates_.nominal.push_back(n);
    }
    facts_.d2h_pinned_gbps = measured.link.d2h_gbytes_per_s;
    facts_.d2h_pageable_gbps = measured.link.d2h_pageable_gbytes_per_s;
    facts_.accumulate_gbps = measured.accumulate_gbps;
    facts_.h2d_gbps = measured.link.h2d_gbytes_per_s;
    facts_.adam_elems_per_s = measured.adam_elems_per_s;
    facts_.device_copy_gbps = measured.link.d2d_gbytes_per_s;
    rates_.device_copy_gbytes_per_s = measured.link.d2d_gbytes_per_s;
    rates_.h2d_gbytes_per_s = measured.link.h2d_gbytes_per_s;
    rates_.d2h_gbytes_per_s = measured.link.d2h_gbytes_per_s;
    rates_.d2h_pageable_gbytes_per_s = measured.link.d2h_pageable_gbytes_per_s;
    rates_.accumulate_gbytes_per_s = measured.accumulate_gbps;
    rates_.cpu_adam_elements_per_s = measured.adam_elems_per_s;
    if (!facts_.nvme_paths.empty()) {
      rates_.nvme_path = facts_.nvme_paths[0];
      if (!IsDirectory(rates_.nvme_path)) {
        // Planned from another machine (its NVMe is not here): the disk's
        // rates and free space are unknown, and the NVMe terms left out.
        rates_.nominal.push_back("nvme");
      } else if (options.nvme_probe_bytes > 0) {
        ASSIGN_OR_RETURN(
            const nvme::NvmeBenchResult disk,
            scheduler::MeasureDiskRates(config_, rates_.nvme_path,
                                        static_cast<uint64_t>(options.nvme_probe_bytes)));
        rates_.nvme_read_gbytes_per_s = disk.read_gbytes_per_s;
        rates_.nvme_write_gbytes_per_s = disk.write_gbytes_per_s;
        rates_.nvme_engine = disk.engine;
      }
    }
    return Status();
  }

  StatusOr<PlanResult> Plan(std::span<const PlanParam> params) const override {
    if (params.empty()) return InvalidArgumentError("Planner::Plan: no parameters");
    std::vector<scheduler::ParamRec> recs;
    recs.reserve(params.size());
    for (const PlanParam& p : params) {
      if (p.numel < 1 || p.module < 0)
        return InvalidArgumentError(
            fmt::format("Planner::Plan: parameter {}: numel {} and module {} (numel must be at "
                        "least 1, module at least 0)",
                        p.name, p.numel, p.module));
      scheduler::ParamRec r;
      r.name = p.name;
      r.numel = p.numel;
      r.dtype = p.dtype;
      r.module = p.module;
      recs.push_back(std::move(r));
    }
    RETURN_IF_ERROR(scheduler::CheckParamsCanFit(recs, facts_));
    const scheduler::LayoutSizes sizes = scheduler::LayoutSizes::Of(
        scheduler::Layout::Build(std::move(recs), scheduler::LayoutOptionsFromConfig(config_)));
    const scheduler::TierPlan plan = scheduler::ComputeTierPlan(placement_, sizes, facts_);
    scheduler::StepRates rates;
    rates.h2d_gbps = rates_.h2d_gbytes_per_s;
    rates.d2h_gbps = rates_.d2h_gbytes_per_s;
    rates.accumulate_gbps = rates_.accumulate_gbytes_per_s;
    rates.adam_elems_per_s = rates_.cpu_adam_elements_per_s;
    rates.nvme_read_gbps = rates_.nvme_read_gbytes_per_s;
    rates.nvme_write_gbps = rates_.nvme_write_gbytes_per_s;
    rates.device_gbps = rates_.device_copy_gbytes_per_s;
    const scheduler::StepPrediction pred = scheduler::PredictStep(placement_, sizes, plan, rates);
    PlanResult out;
    out.fits = plan.fits;
    out.budgets = plan.budgets;
    out.host_bytes = plan.host_bytes;
    out.gradient_path = plan.grad_path;
    out.device_step = plan.device_step;
    if (plan.device_step_groups > 0) {
      scheduler::Placement all_cpu = placement_;
      all_cpu.cpu_ratio = 1.0;
      all_cpu.cpu_ratio_auto = false;
      const scheduler::TierPlan without = scheduler::ComputeTierPlan(all_cpu, sizes, facts_);
      out.bound_all_on_cpu_s = scheduler::PredictStep(all_cpu, sizes, without, rates).bound_s;
    }
    for (const auto& t : pred.terms) out.step.push_back({t.resource, t.amount, t.seconds, t.what});
    out.bound_s = pred.bound_s;
    out.bound_by = pred.bound_by;
    return out;
  }

  std::string DeviceName() const override {
    return dev_ != nullptr ? dev_->Describe()
                           : "cuda (described, not opened: " + described_.name + ")";
  }
  bool DeviceIsHost() const override { return dev_ != nullptr && dev_->is_host(); }
  bool OptimizerOnDevice() const override { return placement_.device_optimizer; }
  const PlanRates& Rates() const override { return rates_; }

 private:
  const Config config_;
  std::unique_ptr<gpu::Device> dev_;  // its arena is the HBM budget; null: described_
  DescribedGpu described_;
  scheduler::Placement placement_;
  scheduler::TierFacts facts_;
  PlanRates rates_;
};

}  // namespace

namespace {

// The GPU of PlanOptions::gpu, or of strata.device "cuda" where none can be
// opened (`why`).
StatusOr<DescribedGpu> DescribeGpu(const Config& config, const std::string& preset_name,
                                   const std::string& why) {
  DescribedGpu d;
  const int64_t budget = config.strata.hbm_budget_bytes;
  if (!preset_name.empty()) {
    const gpu::GpuPreset* p = gpu::FindGpuPreset(preset_name);
    if (p == nullptr)
      return InvalidArgumentError(
          fmt::format("gpu \"{}\" is not one of {}", preset_name, gpu::GpuPresetNames()));
    d.name = std::string(p->description);
    d.link_gbps = gpu::NominalLinkGBytesPerS(*p);
    d.device_copy_gbps = gpu::NominalDeviceCopyGBytesPerS(*p);
    if (budget > p->memory_bytes)
      return InvalidArgumentError(
          fmt::format("strata.hbm_budget: {} bytes is more than the {} bytes of the {}", budget,
                      p->memory_bytes, d.name));
    if (budget > 0) {
      d.budget_bytes = budget;
    } else {  // the CUDA device's default: all memory less its headroom
      const int64_t headroom = std::min<int64_t>(int64_t{1} << 30, p->memory_bytes / 20);
      d.budget_bytes = p->memory_bytes - headroom;
      d.budget_nominal = true;
    }
  } else {
    if (budget <= 0)
      return InvalidArgumentError(fmt::format(
          "no CUDA device to plan for here ({}): set strata.hbm_budget to plan for a GPU that "
          "is not here, or name one (strata plan --gpu {})",
          why, gpu::GpuPresetNames()));
    d.name = "a GPU with a PCIe 4.0 x16 link";
    d.link_gbps = gpu::kNominalFraction * gpu::PcieRawGBytesPerS(4, 16);
    d.budget_bytes = budget;
  }
  d.budget_bytes = static_cast<int64_t>(gpu::ArenaBudgetBytes(static_cast<size_t>(d.budget_bytes)));
  return d;
}

}  // namespace

StatusOr<std::unique_ptr<Planner>> Planner::Create(const Config& config,
                                                   const PlanOptions& options) {
  RETURN_IF_ERROR(ValidateConfig(config));
  ASSIGN_OR_RETURN(const gpu::DeviceOptions dopts, gpu::DeviceOptionsFromConfig(config));
  std::unique_ptr<PlannerImpl> planner;
  if (!options.gpu.empty()) {
    ASSIGN_OR_RETURN(DescribedGpu d, DescribeGpu(config, options.gpu, ""));
    planner = std::make_unique<PlannerImpl>(config, std::move(d));
  } else {
    StatusOr<std::unique_ptr<gpu::Device>> dev = gpu::CreateDevice(dopts);
    // No GPU here (none, no driver: Unavailable; a CPU-only build:
    // NotSupported) for a config that names one: plan the GPU described.
    const StatusCode c = dev.status().code();
    if (!dev.ok() && config.strata.device == DeviceKind::kCuda &&
        (c == StatusCode::kUnavailable || c == StatusCode::kNotSupported)) {
      ASSIGN_OR_RETURN(DescribedGpu d,
                       DescribeGpu(config, "", std::string(dev.status().message())));
      planner = std::make_unique<PlannerImpl>(config, std::move(d));
    } else {
      RETURN_IF_ERROR(dev.status());
      planner = std::make_unique<PlannerImpl>(config, std::move(*dev));
    }
  }
  RETURN_IF_ERROR(planner->Init(options));
  return std::unique_ptr<Planner>(std::move(planner));
}

}  // namespace strata
