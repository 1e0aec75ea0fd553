// src/scheduler/engine_setup.cc — the Engine's creation, the registration
// of parameters and groups, Plan() (layout, partition, placement, tier plan)
// and the wiring of the parts it decides (engine_impl.h).
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "src/common/log.h"
#include "src/common/private_fs.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/common/units.h"
#include "src/gpu/tcp_store.h"
#include "src/scheduler/engine_impl.h"

namespace strata::scheduler {

// ---------------------------------------------------------------------------
// Creation and registration
// ---------------------------------------------------------------------------

EngineImpl::~EngineImpl() {
  // A step still running in the background ends first; it is not committed
  // (nothing reads the engine's state any more).
  backend_.reset();
  if (dev_) dev_->Synchronize().IgnoreError();
  if (!cfg_.strata.trace_path.empty() && counters_.timeline().size() > 0) {
    Status s = WriteTimeline();
    if (!s.ok()) STRATA_LOG_WARN("timeline: {}", s.ToString());
  }
  fetcher_.reset();
  workspaces_.clear();
  if (store_) {
    Status s = store_->Close();
    if (!s.ok()) STRATA_LOG_WARN("closing the NVMe swap store: {}", s.ToString());
    store_.reset();
  }
}

Status EngineImpl::Init(std::shared_ptr<RendezvousStore> rendezvous) {
  RETURN_IF_ERROR(ValidateConfig(cfg_));
  // Fail on unusable NVMe directories before anything else is set up.
  for (const std::string& p : scheduler::UsedNvmePaths(cfg_)) {
    if (access(p.c_str(), F_OK) != 0)
      return NotFoundError(fmt::format("nvme_path {}: no such directory", p));
    if (access(p.c_str(), W_OK | X_OK) != 0)
      return ErrnoError(fmt::format("nvme_path {}: not writable", p), errno);
  }
  // Several ranks when torchrun's variables say so (nothing is allocated
  // for one rank: Create stays a Status under a tight address-space limit).
  if (const char* ws = std::getenv("WORLD_SIZE"); ws != nullptr && *ws != '\0') {
    try {
      ASSIGN_OR_RETURN(comm_, gpu::CommOptionsFromEnv());
      comm_.store = std::move(rendezvous);
      // None given: across machines, the TCP store at MASTER_ADDR:MASTER_PORT.
      ASSIGN_OR_RETURN(comm_.store, gpu::DefaultRendezvousStore(comm_));
      if (comm_.world_size > 1) {
        config_text_ = ConfigToJson(cfg_);  // as given, before the per-rank paths
        RETURN_IF_ERROR(PrepareDataParallel(comm_));
      }
    } catch (const std::bad_alloc&) {
      return ResourceExhaustedError("data parallelism: out of memory reading the ranks' setup");
    }
  }
  ASSIGN_OR_RETURN(gpu::DeviceOptions dopts, gpu::DeviceOptionsFromConfig(cfg_));
  // Several ranks on a machine: local rank k uses GPU k (as torchrun's
  // LOCAL_RANK means) unless the config names one.
  const bool by_local_rank = comm_.world_size > 1 && cfg_.strata.device_id == 0;
  if (by_local_rank) dopts.device_id = comm_.local_rank;
  {
    StatusOr<std::unique_ptr<gpu::Device>> dev = gpu::CreateDevice(dopts);
    if (!dev.ok() && by_local_rank && dev.status().code() == StatusCode::kInvalidArgument)
      return Status(dev.status())
          .WithContext(fmt::format(
              "rank {}: LOCAL_RANK {} runs on CUDA device {} (one GPU per local rank; NCCL needs "
              "a GPU of its own for each rank)",
              comm_.rank, comm_.local_rank, comm_.local_rank));
    if (!dev.ok()) return dev.status();
    dev_ = std::move(*dev);
  }
  // offload_optimizer none on a GPU: the optimizer runs there (DeviceOptimizer).
  device_optimizer_ =
      opt_place() == OffloadDevice::kNone && (!dev_->is_host() || hooks_.device_optimizer);
  if (comm_.world_size > 1) {
    // Stage 0 with several ranks (DeepSpeed's plain data parallelism: the
    // gradients averaged, every rank stepping every state) trains as stage
    // 1: the same updates, the same parameters on every rank after each
    // step, each rank keeping 1/N of the optimizer states.
    int stage = static_cast<int>(cfg_.zero_optimization.stage);
    if (stage == 0) {
      if (comm_.rank == 0)
        STRATA_LOG_INFO(
            "zero_optimization.stage 0 with {} ranks runs as stage 1: the same updates (the "
            "gradients averaged over the ranks), each rank keeping 1/{} of the optimizer states",
            comm_.world_size, comm_.world_size);
      stage = 1;
    }
    ASSIGN_OR_RETURN(dp_, scheduler::DataParallel::Create(dev_.get(), comm_, stage));
  }
  if (device_optimizer_ && param_place() != OffloadDevice::kNone)
    return NotSupportedError(fmt::format(
        "zero_optimization.offload_param.device: {} with offload_optimizer.device none on {}: the "
        "device optimizer updates the parameters in HBM, so offload_param must be none too (or "
        "offload the optimizer: cpu or nvme)",
        OffloadDeviceName(param_place()), dev_->Describe()));
  if (device_optimizer_ && cfg_.optimizer.type != OptimizerType::kAdam &&
      cfg_.optimizer.type != OptimizerType::kAdamW)
    return NotSupportedError(fmt::format(
        "optimizer.type: {} runs on the CPU optimizer only; with offload_optimizer.device none on "
        "{} use Adam or AdamW, or offload the optimizer (cpu or nvme)",
        OptimizerTypeName(cfg_.optimizer.type), dev_->Describe()));
  cpu_adam::Options aopts;
  aopts.threads = static_cast<int>(cfg_.strata.threads);
  if (comm_.world_size > 1) RankCpuShare(&aopts);
  ASSIGN_OR_RETURN(adam_, cpu_adam::CpuOptimizer::Create(aopts));
  scaler_ = cfg_.fp16.enabled ? LossScaler::FromConfig(cfg_.fp16) : LossScaler::Disabled();
  gas_ = std::max<int64_t>(1, cfg_.gradient_accumulation_steps);
  // Busy times from device events; a framework on a GPU computes on the
  // compute stream (on the host device it computes on the calling thread).
  RETURN_IF_ERROR(counters_.StartDeviceClock(dev_.get()));
  if (!dev_->is_host()) counters_.set_compute_stream(&dev_->compute());
  counters_.StartWindow(NowNanos());
  return Status();
}

Status EngineImpl::PrepareDataParallel(const gpu::CommOptions& comm) {
  // (DataParallel::Create refuses the stages it does not partition.)
  // Each rank's swap files in a directory of its own: created with mode
  // 0700, or reused only when it is a directory (not a symlink) of this user
  // that no one else may write (private_fs.h).
  auto per_rank = [&](std::vector<std::string>& paths) -> Status {
    for (std::string& p : paths) {
      p = fmt::format("{}/rank-{}", p, comm.rank);
      RETURN_IF_ERROR(MakePrivateDir(p, "nvme_path: this rank's directory").status());
    }
    return Status();
  };
  // Each rank's timeline in a file of its own: <trace_path>.rank-<k>.
  if (!cfg_.strata.trace_path.empty())
    cfg_.strata.trace_path = fmt::format("{}.rank-{}", cfg_.strata.trace_path, comm.rank);
  if (opt_place() == OffloadDevice::kNvme)
    RETURN_IF_ERROR(per_rank(cfg_.zero_optimization.offload_optimizer.nvme_path));
  if (param_place() == OffloadDevice::kNvme)
    RETURN_IF_ERROR(per_rank(cfg_.zero_optimization.offload_param.nvme_path));
  return Status();
}

void EngineImpl::RankCpuShare(cpu_adam::Options* aopts) const {
  // The local ranks share the machine's cores: each one's CPU optimizer on
  // the NUMA node nearest its GPU (hwloc), with its part of the node's PUs.
  StatusOr<cpu_adam::CpuTopology> topo = cpu_adam::DescribeTopology();
  if (!topo.ok()) {
    STRATA_LOG_WARN("rank {}: the CPU's topology is unknown ({}); the CPU optimizer is not pinned",
                    comm_.rank, topo.status().ToString());
    return;
  }
  int gpu_node = -1;
  if (!dev_->is_host()) {
    const gpu::CudaDeviceList gpus = gpu::ListCudaDevices();
    for (const gpu::CudaDeviceInfo& g : gpus.devices)
      if (g.ordinal == dev_->ordinal()) gpu_node = g.numa_node;
  }
  const cpu_adam::RankCpuShare share =
      cpu_adam::ShareOfLocalRank(*topo, comm_.local_rank, comm_.local_world_size, gpu_node);
  aopts->numa_node = share.numa_node;
  if (cfg_.strata.threads == 0) aopts->threads = share.threads;
  STRATA_LOG_INFO("rank {} of {} (local rank {}): CPU optimizer on {} ({}), {} thread(s){}",
                  comm_.rank, comm_.world_size, comm_.local_rank,
                  share.numa_os_node >= 0 ? fmt::format("NUMA node {}", share.numa_os_node)
                                          : std::string("every core"),
                  share.why, aopts->threads, cfg_.strata.threads == 0 ? "" : " (strata.threads)");
}

StatusOr<int> EngineImpl::RegisterParameter(const ParamSpec& spec) {
  if (planned_) return FailedPreconditionError("RegisterParameter " + spec.name + ": after Plan()");
  if (spec.name.empty()) return InvalidArgumentError("RegisterParameter: empty name");
  if (by_name_.count(spec.name))
    return InvalidArgumentError("RegisterParameter: duplicate name " + spec.name);
  if (spec.numel <= 0)
    return InvalidArgumentError(
        fmt::format("RegisterParameter {}: numel {} must be > 0", spec.name, spec.numel));
  if (spec.module < 0 || spec.module > 1'000'000)
    return InvalidArgumentError(
        fmt::format("RegisterParameter {}: module {} out of range", spec.name, spec.module));
  if (!spec.init.empty() && static_cast<int64_t>(spec.init.size()) != spec.numel)
    return InvalidArgumentError(fmt::format("RegisterParameter {}: init has {} values, numel is {}",
                                            spec.name, spec.init.size(), spec.numel));
  if (spec.init.empty() && !spec.initializer)
    return InvalidArgumentError("RegisterParameter " + spec.name +
                                ": give init values or an initializer");
  if (spec.group < 0 || spec.group >= num_param_groups())
    return InvalidArgumentError(fmt::format(
        "RegisterParameter {}: parameter group {} does not exist (there {} {}: 0{}; add groups "
        "with AddParamGroup first)",
        spec.name, spec.group, num_param_groups() == 1 ? "is" : "are", num_param_groups(),
        num_param_groups() > 1 ? fmt::format("..{}", num_param_groups() - 1) : ""));
  if (!spec.shape.empty()) {
    int64_t product = 1;
    bool bad = false;
    for (int64_t d : spec.shape) {
      bad = bad || d < 0 || (d > 0 && product > INT64_MAX / d);
      if (!bad) product *= d;
    }
    if (bad || product != spec.numel)
      return InvalidArgumentError(fmt::format(
          "RegisterParameter {}: shape [{}] holds {} elements, numel is {}", spec.name,
          fmt::join(spec.shape, ", "),
          bad ? std::string("a negative or overflowing number of") : std::to_string(product),
          spec.numel));
  }
  if (spec.aliases.size() > kMaxParamAliases)
    return InvalidArgumentError(fmt::format("RegisterParameter {}: {} aliases, at most {}",
                                            spec.name, spec.aliases.size(), kMaxParamAliases));
  for (size_t i = 0; i < spec.aliases.size(); ++i) {
    const std::string& a = spec.aliases[i];
    if (a.empty()) return InvalidArgumentError("RegisterParameter " + spec.name + ": empty alias");
    if (a == spec.name || by_name_.count(a) ||
        std::find(spec.aliases.begin(), spec.aliases.begin() + static_cast<std::ptrdiff_t>(i), a) !=
            spec.aliases.begin() + static_cast<std::ptrdiff_t>(i))
      return InvalidArgumentError(fmt::format(
          "RegisterParameter {}: alias {} is already a parameter's name or alias", spec.name, a));
  }
  Registration r;
  r.rec.name = spec.name;
  r.rec.numel = spec.numel;
  r.rec.shape = spec.shape;
  r.rec.aliases = spec.aliases;
  r.rec.dtype = spec.dtype;
  r.rec.module = spec.module;
  r.rec.group = spec.group;
  r.init.assign(spec.init.begin(), spec.init.end());
  r.initializer = spec.initializer;
  const int id = static_cast<int>(regs_.size());
  by_name_[r.rec.name] = id;
  for (const std::string& a : r.rec.aliases) by_name_[a] = id;
  regs_.push_back(std::move(r));
  return id;
}

StatusOr<int> EngineImpl::AddParamGroup(const ParamGroupSpec& spec) {
  const int id = num_param_groups();
  ParamGroupSpec g = spec;
  if (g.name.empty()) g.name = fmt::format("group {}", id);
  const std::string what = fmt::format("AddParamGroup {}", g.name);
  if (planned_) return FailedPreconditionError(what + ": after Plan()");
  for (const ParamGroupSpec& other : groups_)
    if (other.name == g.name) return InvalidArgumentError(what + ": duplicate group name");
  auto check = [&](const char* key, const std::optional<double>& v, double lo, double hi,
                   const char* range) -> Status {
    if (v.has_value() && (!std::isfinite(*v) || *v < lo || *v >= hi))
      return InvalidArgumentError(
          fmt::format("{}: {} {} is not allowed; must be {}", what, key, *v, range));
    return Status();
  };
  constexpr double kInf = std::numeric_limits<double>::infinity();
  RETURN_IF_ERROR(check("lr", g.lr, 0, kInf, ">= 0"));
  RETURN_IF_ERROR(check("weight_decay", g.weight_decay, 0, kInf, ">= 0"));
  RETURN_IF_ERROR(check("beta1", g.beta1, 0, 1, "in [0, 1)"));
  RETURN_IF_ERROR(check("beta2", g.beta2, 0, 1, "in [0, 1)"));
  RETURN_IF_ERROR(check("eps", g.eps, 0, kInf, ">= 0"));
  if (g.lr.has_value() && !ScheduleAt(cfg_, 0).lr_ratio.has_value())
    return FailedPreconditionError(fmt::format(
        "{}: lr {} with the config's scheduler section ({}), which sets the lr of every group at "
        "every step; leave the group's lr unset, or remove the section (WarmupCosineLR scales "
        "each group's own lr)",
        what, *g.lr, LrScheduleTypeName(cfg_.scheduler.type)));
  if ((g.beta1.has_value() || g.beta2.has_value()) && scheduler::ScheduleCyclesMomentum(cfg_))
    return FailedPreconditionError(fmt::format(
        "{}: betas with the config's scheduler section ({}), which cycles the momentum of every "
        "group; leave the group's betas unset, or set scheduler.params.cycle_momentum false",
        what, LrScheduleTypeName(cfg_.scheduler.type)));
  groups_.push_back(std::move(g));
  lr_override_.emplace_back();
  return id;
}

Status EngineImpl::CheckGroup(int group, const char* call) const {
  if (group < 0 || group >= num_param_groups())
    return InvalidArgumentError(fmt::format("{}: parameter group {} does not exist (groups 0..{})",
                                            call, group, num_param_groups() - 1));
  return Status();
}

StatusOr<int> EngineImpl::FindParameter(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  if (it == by_name_.end()) return NotFoundError(fmt::format("no parameter named {}", name));
  return it->second;
}

// ---------------------------------------------------------------------------
// Planning: layout → tier plan → states
// ---------------------------------------------------------------------------

Status EngineImpl::Plan() {
  if (planned_) return Status();
  if (regs_.empty()) return FailedPreconditionError("Plan: no parameters registered");
  const auto& zo = cfg_.zero_optimization;
  std::vector<scheduler::ParamRec> recs;
  for (const Registration& r : regs_) recs.push_back(r.rec);
  // Leftover swap files of killed runs go before the plan counts free space
  // (one notice each; files of live runs are left alone).
  for (const std::string& p : scheduler::UsedNvmePaths(cfg_))
    RETURN_IF_ERROR(nvme::RemoveLeftoverSwapFiles(p).status());
  // A model that cannot fit whatever the placement is refused from its sizes,
  // before its layout (in proportion to its elements) is built.
  RETURN_IF_ERROR(scheduler::CheckParamsCanFit(
      recs,
      scheduler::MeasureTierFacts(static_cast<int64_t>(dev_->Stats().budget_bytes),
                                  cfg_.strata.pinned_budget_bytes, scheduler::UsedNvmePaths(cfg_),
                                  cfg_.strata.dram_budget_bytes),
      dp_ ? dp_->world_size() : 1));
  scheduler::LayoutOptions lo = scheduler::LayoutOptionsFromConfig(cfg_);
  lo.world_size = dp_ ? dp_->world_size() : 1;
  // Partitioned parameters come into device slots as offloaded ones do.
  if (PartitionsParams()) lo.params_offloaded = true;
  layout_ = Layout::Build(std::move(recs), lo);
  // (Stage 3 with several ranks: each rank keeps its part of the parameters.)
  const bool params_partitioned = PartitionsParams() && world_size() > 1;
  int64_t dp_chunk = 0, dp_gather_bytes = 0;
  if (dp_) {
    // Every rank must train the same model with the same config.
    RETURN_IF_ERROR(dp_->CheckSame("config", config_text_));
    std::string model;
    for (const scheduler::ParamRec& p : layout_.params())
      model += fmt::format("parameter {}: numel {}, {}, module {}, group {}\n", p.name, p.numel,
                           DTypeName(p.dtype), p.module, p.group);
    RETURN_IF_ERROR(dp_->CheckSame("model (its registered parameters)", model));
    dp_chunk = scheduler::DataParallel::ChunkElems(layout_, zo.reduce_bucket_size);
    dp_gather_bytes = scheduler::DataParallel::GatherChunkBytes(layout_, zo.allgather_bucket_size);
  }

  scheduler::Placement placement = scheduler::Placement::FromConfig(cfg_);
  placement.device_optimizer = device_optimizer_;
  placement.fold_override = hooks_.fold_override;
  placement.host_device = dev_->is_host();
  if (dp_) {
    placement.world_size = dp_->world_size();
    placement.collective_staging_bytes = scheduler::DataParallel::StagingBytes(
        dp_->world_size(), scheduler::DataParallel::StagingChunkElems(dp_chunk, dp_gather_bytes));
    placement.fold_override = 0;  // the reduction reads one accumulator
    if (placement.grad_tier == GradTier::kAuto) placement.grad_tier = GradTier::kDram;
    if (placement.grad_tier == GradTier::kHbm)
      return InvalidArgumentError(fmt::format(
          "strata.grad_tier: \"hbm\" applies to one rank (this run has {}): the ranks reduce "
          "the window's sums on the host; allowed with several ranks: \"auto\", \"dram\"{}",
          dp_->world_size(),
          cfg_.zero_optimization.offload_optimizer.device == OffloadDevice::kNvme ? ", \"nvme\""
                                                                                  : ""));
  }
  if (dp_ && cfg_.strata.overlap_optimizer && !placement.overlap_step()) {
    STRATA_LOG_INFO(
        "rank {} of {}: the optimizer step runs inline (strata.overlap_optimizer applies to one "
        "rank, or to stage 3 with offload_param cpu): {}",
        dp_->rank(), dp_->world_size(),
        zo.stage == 3 ? "each module's parameters are gathered from the ranks when it is fetched"
                      : "the ranks' parameters are gathered after it");
  }
  placement_ = placement;
  scheduler::LayoutSizes sizes = scheduler::LayoutSizes::Of(layout_);
  // (Every rank plans for the largest part.)
  if (params_partitioned)
    sizes.partitioned_param_bytes = scheduler::IoBytes(layout_.MaxOwnedBytes());
  scheduler::TierFacts facts = scheduler::MeasureTierFacts(
      static_cast<int64_t>(dev_->Stats().budget_bytes), cfg_.strata.pinned_budget_bytes,
      scheduler::UsedNvmePaths(cfg_), cfg_.strata.dram_budget_bytes);
  // The link rates the step bound and the gradient path use (pinned copies
  // of a few MiB each way, one pageable), the accumulation and Adam rates.
  ASSIGN_OR_RETURN(const scheduler::PlanRates rates,
                   scheduler::MeasurePlanRates(dev_.get(), adam_.get(), layout_.total_elems(),
                                               !device_optimizer_, cfg_.strata.optimizer_states));
  counters_.SetLinkRates(rates.link.h2d_gbytes_per_s, rates.link.d2h_gbytes_per_s);
  facts.d2h_pinned_gbps = rates.link.d2h_gbytes_per_s;
  facts.d2h_pageable_gbps = rates.link.d2h_pageable_gbytes_per_s;
  facts.accumulate_gbps = rates.accumulate_gbps;
  facts.h2d_gbps = rates.link.h2d_gbytes_per_s;
  facts.adam_elems_per_s = rates.adam_elems_per_s;
  facts.device_copy_gbps = rates.link.d2d_gbytes_per_s;
  const scheduler::TierPlan plan = scheduler::ComputeTierPlan(placement, sizes, facts);
  budgets_ = plan.budgets;
  if (!plan.fits) return ResourceExhaustedError(OverBudgetTable(plan, placement, sizes));
  layout_.set_state_piece_elems(plan.state_piece_elems);
  // Who this rank is and what it owns, once: its part of the layout, and
  // (offload_optimizer.ratio, one rank) the first sub-groups stepped on the
  // device.
  part_ = std::make_unique<const scheduler::Partition>(&layout_, rank(), world_size(),
                                                       params_partitioned, plan.device_step_groups);
  if (!plan.device_step.empty()) {
    if (plan.device_step_groups == 0 && !zo.offload_optimizer.ratio_auto)
      STRATA_LOG_WARN("{}", plan.device_step);
    else
      STRATA_LOG_INFO("{}", plan.device_step);
  }
  if (plan.state_piece_elems > 0)
    STRATA_LOG_INFO(
        "optimizer pipeline: {} buffers of {} do not fit strata.pinned_budget {} beside the other "
        "pinned pools; sub-groups of {} elements stream through them in pieces of {}",
        placement.optimizer_buffer_count,
        FormatBytes(scheduler::OptimizerBufferBytes(layout_.max_group_elems(), plan.grads_on_nvme,
                                                    layout_.state_format())),
        FormatBytes(cfg_.strata.pinned_budget_bytes), layout_.max_group_elems(),
        plan.state_piece_elems);
  if (dp_) {
    RETURN_IF_ERROR(dp_->Bind(&layout_, dp_chunk, dp_gather_bytes));
    // The network's rate for the step bound (every rank, here).
    ASSIGN_OR_RETURN(comm_gbps_, dp_->ProbeBusBandwidth());
    STRATA_LOG_INFO(
        "rank {} of {}: the collectives' bus bandwidth {:.2f} GB/s (all-gathers of the "
        "staging chunk)",
        dp_->rank(), dp_->world_size(), comm_gbps_);
  }
  // Before the states' initial write, whose write-back would slow the probe.
  MeasureDiskRates(plan);
  RETURN_IF_ERROR(OpenBackendAndStore(plan));
  scheduler::FetchOptions fo;
  fo.prefetch_bucket_elems = zo.stage3_prefetch_bucket_size;
  fo.max_live_elems = zo.stage3_max_live_parameters;
  fo.max_reuse_distance = zo.stage3_max_reuse_distance;
  fo.device_slots = plan.device_slots;
  fetcher_ = std::make_unique<ParamFetcher>(dev_.get(), &layout_, store_.get(),
                                            part_->params_partitioned() ? dp_.get() : nullptr,
                                            &counters_, backend_.get(), fo);
  RETURN_IF_ERROR(fetcher_->Init());
  backend_->set_device_copies(fetcher_.get());
  const int64_t init0 = NowNanos();
  RETURN_IF_ERROR(
      store_->Initialize([&](int id, std::vector<float>& scratch) -> std::span<const float> {
        const Registration& r = regs_[static_cast<size_t>(id)];
        if (!r.init.empty()) return r.init;
        scratch.assign(static_cast<size_t>(r.rec.numel), 0.f);
        r.initializer(scratch);
        return scratch;
      }));
  if (store_->initial_nvme_bytes() > 0)
    counters_.NoteNvmeRate(static_cast<double>(store_->initial_nvme_bytes()) /
                           std::max<double>(static_cast<double>(NowNanos() - init0), 1.0));
  PredictStep(placement, sizes, plan, rates);
  planned_ = true;
  // Parameters are no longer needed in registration form.
  for (Registration& r : regs_) {
    r.init.clear();
    r.init.shrink_to_fit();
    r.initializer = nullptr;
  }
  return Status();
}

void EngineImpl::MeasureDiskRates(const scheduler::TierPlan& plan) {
  const std::vector<std::string> paths = scheduler::UsedNvmePaths(cfg_);
  if (paths.empty()) return;
  StatusOr<nvme::NvmeBenchResult> r = scheduler::MeasureDiskRates(
      cfg_, paths[0], static_cast<uint64_t>(std::max<int64_t>(0, plan.nvme_bytes() / 2)));
  if (!r.ok()) {
    STRATA_LOG_WARN(
        "measuring the disk's rates on {}: {}; the step bound uses the rate of the "
        "engine's own NVMe traffic",
        paths[0], r.status().ToString());
    return;
  }
  counters_.SetNvmeDiskRates(r->read_gbytes_per_s, r->write_gbytes_per_s);
}

void EngineImpl::PredictStep(const scheduler::Placement& placement,
                             const scheduler::LayoutSizes& sizes, const scheduler::TierPlan& plan,
                             const scheduler::PlanRates& measured) {
  scheduler::StepRates rates;
  rates.h2d_gbps = measured.link.h2d_gbytes_per_s;
  rates.d2h_gbps = measured.link.d2h_gbytes_per_s;
  rates.accumulate_gbps = measured.accumulate_gbps;
  rates.adam_elems_per_s = measured.adam_elems_per_s;
  rates.nvme_read_gbps = counters_.nvme_read_rate();  // MeasureDiskRates
  rates.nvme_write_gbps = counters_.nvme_write_rate();
  rates.device_gbps = measured.link.d2d_gbytes_per_s;
  predicted_.clear();
  for (const auto& t : scheduler::PredictStep(placement, sizes, plan, rates).terms)
    predicted_.push_back({t.resource, t.amount, t.seconds, t.what});
}

Status EngineImpl::OpenBackendAndStore(const scheduler::TierPlan& plan) {
  store_ = std::make_unique<StateStore>(dev_.get(), &layout_, *part_, &counters_, &cfg_);
  if (dp_) {
    checkpoint_ranks_.exchange = dp_.get();
    if (part_->params_partitioned()) checkpoint_ranks_.gatherer = dp_.get();
  }
  if (device_optimizer_) {
    RETURN_IF_ERROR(store_->Open(plan, {}, hooks_.wrap_io_engine, &pinned_bytes_));
    auto dev_opt = std::make_unique<scheduler::DeviceOptimizer>(
        dev_.get(), &layout_, store_.get(), &counters_, &scaler_, &window_, dp_.get());
    RETURN_IF_ERROR(dev_opt->Init());
    backend_ = std::move(dev_opt);
    return Status();
  }
  scheduler::HostOptimizer::Options ho;
  ho.second_accumulator = cfg_.strata.delayed_param_update;
  ho.fold = plan.fold_last_micro_batch;
  ho.landing_bytes = plan.grad_landing_bytes;
  ho.pin_landing = plan.pin_grad_landing;
  ho.device_accumulator = plan.device_grad_accumulator;
  ho.pin_accumulator = plan.pin_grad_accumulator;
  ho.grads_on_nvme = plan.grads_on_nvme;
  ho.sums_in_hbm = plan.grads_in_hbm;
  ho.sums_chunk_elems = plan.grad_chunk_elems;
  ho.buffer_count = cfg_.zero_optimization.offload_optimizer.buffer_count;
  ho.device_step_elems = plan.device_step_elems;
  ho.before_sub_group = hooks_.before_sub_group;
  ho.dp = dp_.get();
  ho.speculate = plan.placement.speculate() && plan.speculation_elems > 0;
  if (cfg_.strata.speculative_step.value_or(false) && !ho.speculate)
    STRATA_LOG_WARN(
        "strata.speculative_step true: {}; the step runs after backward",
        !plan.placement.speculate()
            ? "the speculative step covers the optimizer on the CPU (states in memory or on "
              "NVMe), one rank and no delayed_param_update"
        : plan.grads_in_hbm ? "the window's gradient sums are kept in HBM until the step"
                            : "the DRAM budget leaves no room for the spare states");
  ho.spare_elems = plan.speculation_elems;
  ho.speculation_steps_all = hooks_.speculation_steps_all_handed_over;
  ho.speculation_backoff = !cfg_.strata.speculative_step || hooks_.speculation_backoff;
  // (With the sums in HBM, each module's reaches the host once, at its last
  // micro-batch or at the drain; on NVMe they are reduced sub-group by
  // sub-group at the window's end: no overlap.)
  ho.overlap_comm = dp_ && cfg_.zero_optimization.overlap_comm && !plan.device_grad_accumulator &&
                    !plan.grads_on_nvme;
  auto host = std::make_unique<scheduler::HostOptimizer>(dev_.get(), &layout_, adam_.get(),
                                                         &counters_, &scaler_, &window_, ho);
  // The gradient staging buffers are registered with the store's I/O engine.
  RETURN_IF_ERROR(host->Start(&pinned_bytes_));
  RETURN_IF_ERROR(store_->Open(plan, host->io_buffers(), hooks_.wrap_io_engine, &pinned_bytes_));
  RETURN_IF_ERROR(host->Bind(store_.get()));
  backend_ = std::move(host);
  return Status();
}

}  // namespace strata::scheduler

namespace strata {

using scheduler::EngineImpl;

StatusOr<std::unique_ptr<Engine>> CreateEngine(const Config& config, const EngineTestHooks& hooks,
                                               std::shared_ptr<RendezvousStore> rendezvous) {
  auto engine = std::make_unique<EngineImpl>(config, hooks);
  RETURN_IF_ERROR(engine->Init(std::move(rendezvous)));
  return std::unique_ptr<Engine>(std::move(engine));
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(const Config& config) {
  return CreateEngine(config);
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(const Config& config,
                                                 std::shared_ptr<RendezvousStore> rendezvous) {
  return CreateEngine(config, {}, std::move(rendezvous));
}

StatusOr<std::unique_ptr<Engine>> Engine::CreateFromFile(const std::string& path) {
  ASSIGN_OR_RETURN(Config c, LoadConfigFile(path));
  return CreateEngine(c);
}

StatusOr<std::unique_ptr<Engine>> Engine::CreateFromJson(std::string_view json_text) {
  ASSIGN_OR_RETURN(Config c, ParseConfig(json_text));
  return CreateEngine(c);
}

}  // namespace strata
