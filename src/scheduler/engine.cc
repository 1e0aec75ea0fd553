// The tiered scheduler: strata::Engine on a Device, the CPU optimizer and the
// NVMe swap store. This file wires the parts together and reads like a
// training step; each part owns its state (see scheduler.h):
//
//   Layout            where every parameter's elements and bytes live (layout.h)
//   TierPlan          what each tier must hold, and whether it fits (plan.h)
//   StateStore        the states and parameter copies, commit/rollback (state_store.h)
//   ParamFetcher      parameters onto the device ahead of use (param_fetcher.h)
//   OptimizerBackend  where gradients go and the optimizer runs, chosen once
//                     by the plan (optimizer_backend.h): HostOptimizer
//                     (gradients into DRAM, the step on the CPU) or
//                     DeviceOptimizer (all in HBM)
//   StepCounters      the statistics of a step window (step_counters.h)
//
// A window of micro-batches: BeforeForward/AfterForward and BeforeBackward/
// AfterBackward per module acquire and release the module's parameters and
// hand its gradients to the back-end; Step() counts micro-batches and at the
// window's end drains the gradients, checks them (inf/nan, global norm,
// clipping) and launches the optimizer step. With the host back-end the step
// runs on while the next forward pass begins; a module's fetch waits only for
// the sub-group holding it. The next Step() (or an error, ReadParameter,
// Synchronize) joins it and commits it into the StateStore, or rolls it back.
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <unordered_map>

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/scheduler/checkpoint.h"
#include "src/scheduler/data_parallel.h"
#include "src/scheduler/device_optimizer.h"
#include "src/scheduler/host_optimizer.h"
#include "src/scheduler/hyperparams.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/loss_scaler.h"
#include "src/scheduler/optimizer_backend.h"
#include "src/scheduler/param_fetcher.h"
#include "src/scheduler/plan.h"
#include "src/scheduler/rate_probes.h"
#include "src/scheduler/scheduler.h"
#include "src/scheduler/state_store.h"
#include "src/scheduler/step_counters.h"

namespace strata {
namespace {

using scheduler::Layout;
using scheduler::OptimizerBackend;
using scheduler::ParamFetcher;
using scheduler::Phase;
using scheduler::StateStore;
using scheduler::StepCounters;

// A parameter as registered, until Plan() lays it out.
struct Registration {
  scheduler::ParamRec rec;
  std::vector<float> init;
  std::function<void(std::span<float>)> initializer;
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(Config config, EngineTestHooks hooks)
      : cfg_(std::move(config)),
        hooks_(std::move(hooks)),
        counters_(!cfg_.strata.trace_path.empty()) {}
  ~EngineImpl() override;

  Status Init();

  StatusOr<int> RegisterParameter(const ParamSpec& spec) override;
  StatusOr<int> AddParamGroup(const ParamGroupSpec& spec) override;
  int num_param_groups() const override { return static_cast<int>(groups_.size()); }
  const ParamGroupSpec& param_group(int group) const override {
    return groups_.at(static_cast<size_t>(group));
  }
  Status Plan() override;
  std::vector<TierBudget> Budgets() const override { return budgets_; }
  std::vector<PredictedTerm> PredictedStep() const override { return predicted_; }
  StatusOr<ModuleView> BeforeForward(int module) override;
  Status AfterForward(int module) override;
  StatusOr<ModuleView> BeforeBackward(int module) override;
  Status AfterBackward(int module) override;
  StatusOr<StepStats> Step() override;
  Status ZeroGrad() override;
  Status Synchronize() override;
  Status SaveCheckpoint(const std::string& dir, const CheckpointInfo& info) override;
  Status LoadCheckpoint(const std::string& dir, CheckpointInfo* info) override;
  Status SetLearningRate(double lr) override;
  Status SetLearningRate(int group, double lr) override;
  double learning_rate() const override { return learning_rate(0); }
  double learning_rate(int group) const override;
  double loss_scale() const override { return scaler_.scale(); }
  void* ComputeStream() const override { return dev_->compute().native_handle(); }
  StatusOr<void*> AllocateWorkspace(int64_t bytes) override;
  Status FreeWorkspace(void* ptr) override;
  std::string DeviceName() const override { return dev_->Describe(); }
  bool DeviceIsHost() const override { return dev_->is_host(); }
  Status ReadParameter(int id, std::span<float> out) override;
  Status WriteParameter(int id, std::span<const float> values) override;
  StatusOr<int> FindParameter(std::string_view name) const override;
  int num_parameters() const override { return static_cast<int>(regs_.size()); }
  int64_t num_elements() const override { return layout_.param_elems(); }
  int rank() const override { return dp_ ? dp_->rank() : 0; }
  int world_size() const override { return dp_ ? dp_->world_size() : 1; }
  Status ReduceOverRanks(std::span<double> values, OverRanks op) override {
    if (!dp_) return Status();
    using S = scheduler::DataParallel::Scalars;
    return dp_->ReduceScalars(values, op == OverRanks::kMean  ? S::kMean
                                      : op == OverRanks::kSum ? S::kSum
                                                              : S::kMax);
  }
  StepStats LastStepStats() const override { return last_; }
  std::string StatsJson() const override;
  Status WriteTimeline() override;

 private:
  OffloadDevice opt_place() const { return cfg_.zero_optimization.offload_optimizer.device; }
  OffloadDevice param_place() const { return cfg_.zero_optimization.offload_param.device; }

  Status CheckModule(int module, const char* call) const;
  Status FetchError(Status fetch);
  // FailedPrecondition naming `call` in the middle of an accumulation window
  // (gradients handed over and not yet applied), with `advice`.
  Status BetweenWindows(const std::string& call, std::string_view advice) const;
  // Keeps a checkpoint root's lock until the engine is destroyed.
  void HoldCheckpointLock(std::shared_ptr<scheduler::CheckpointDirLock> lock) {
    if (lock != nullptr && std::find(checkpoint_locks_.begin(), checkpoint_locks_.end(), lock) ==
                               checkpoint_locks_.end())
      checkpoint_locks_.push_back(std::move(lock));
  }
  // The plan's optimizer back-end, started; the store opened beside it.
  Status OpenBackendAndStore(const scheduler::TierPlan& plan);
  // The window's last micro-batch is under way.
  bool last_micro_batch() const { return window_.micro_batches + 1 >= gas_; }

  // The disk's sequential rates for the step bound (StepStats), when there
  // is an NVMe tier: the NVMe engine writes and reads up to 256 MiB (no more
  // than the tier holds) on the first NVMe path. A failure is a warning: the
  // bound then uses the rate of the engine's own traffic.
  void MeasureDiskRates(const scheduler::TierPlan& plan);
  // predicted_ (PredictedStep) from the plan and the rates measured.
  void PredictStep(const scheduler::Placement& placement, const scheduler::LayoutSizes& sizes,
                   const scheduler::TierPlan& plan, const scheduler::PlanRates& measured);
  // The window's end: drain, join the step in flight, global checks, launch.
  Status EndWindow(StepStats* st);
  // Data parallelism (CommOptions from torchrun's variables, several ranks):
  // refuses what it does not support yet, naming the key, and gives each rank
  // its own directory under every nvme_path (rank-<k>). Before the device.
  Status PrepareDataParallel(const gpu::CommOptions& comm);
  // Stage 3 with several ranks: each rank keeps its part of the parameters,
  // and fetches gather modules (decided before Plan() builds the Partition).
  bool PartitionsParams() const { return dp_ && cfg_.zero_optimization.stage == 3; }
  // How the ranks exchange for a checkpoint (null with one rank).
  const scheduler::CheckpointRanks* CheckpointRanks() const {
    return dp_ ? &checkpoint_ranks_ : nullptr;
  }
  // Several ranks: this rank's NUMA node and threads for the CPU optimizer
  // (cpu_adam::ShareOfLocalRank), logged once.
  void RankCpuShare(cpu_adam::Options* aopts) const;
  // The hyperparameters of the next step, per parameter group.
  std::vector<cpu_adam::HyperParams> HyperParamsFor(double grad_scale) const;
  // InvalidArgument naming `call` for a group id that does not exist.
  Status CheckGroup(int group, const char* call) const;

  Config cfg_;
  EngineTestHooks hooks_;
  // Checkpoints: the run id recorded by SaveCheckpoint (adopted from the
  // checkpoint LoadCheckpoint restores), and the roots locked.
  std::string run_id_ = scheduler::NewCheckpointRunId();
  std::vector<std::shared_ptr<scheduler::CheckpointDirLock>> checkpoint_locks_;
  StepCounters counters_;  // outlives the device: its callbacks note into it
  std::unique_ptr<gpu::Device> dev_;
  std::unique_ptr<cpu_adam::CpuOptimizer> adam_;
  LossScaler scaler_;
  // Data parallelism: the ranks' collectives (null with one rank; its
  // staging buffer goes before the device), and the config as this rank was
  // given it (before its per-rank nvme paths), which every rank must share.
  gpu::CommOptions comm_;
  std::string config_text_;
  std::unique_ptr<scheduler::DataParallel> dp_;
  double comm_gbps_ = 0;  // the collectives' bus bandwidth measured at Plan

  std::vector<Registration> regs_;
  std::unordered_map<std::string, int> by_name_;
  Layout layout_;
  // Where everything goes, with its decided policies, as the plan was
  // computed for it.
  scheduler::Placement placement_;
  // Who this rank is and what it owns: built once by Plan(), immutable after.
  std::unique_ptr<const scheduler::Partition> part_;
  scheduler::CheckpointRanks checkpoint_ranks_;
  bool planned_ = false;
  std::vector<TierBudget> budgets_;
  std::vector<PredictedTerm> predicted_;
  int64_t pinned_bytes_ = 0;  // the pinned pools

  bool device_optimizer_ = false;  // offload_optimizer none on a GPU (DeviceOptimizer)
  int64_t gas_ = 1;                // gradient_accumulation_steps, at least 1
  scheduler::GradientWindow window_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<OptimizerBackend> backend_;
  std::unique_ptr<ParamFetcher> fetcher_;
  std::map<void*, gpu::DeviceBuffer> workspaces_;
  StepStats last_;
  // The optimizer parameter groups (group 0: the config's own) and each
  // one's SetLearningRate value (no scheduler section; unset: the group's or
  // the config's).
  std::vector<ParamGroupSpec> groups_{scheduler::DefaultParamGroup()};
  std::vector<std::optional<double>> lr_override_{std::nullopt};
};

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

Status EngineImpl::Init() {
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
    ASSIGN_OR_RETURN(dp_, scheduler::DataParallel::Create(
                              dev_.get(), comm_, static_cast<int>(cfg_.zero_optimization.stage)));
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
  // Each rank's swap files in a directory of its own.
  auto per_rank = [&](std::vector<std::string>& paths) -> Status {
    for (std::string& p : paths) {
      p = fmt::format("{}/rank-{}", p, comm.rank);
      if (mkdir(p.c_str(), 0755) != 0 && errno != EEXIST)
        return ErrnoError(fmt::format("nvme_path: creating this rank's directory {}", p), errno);
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
  Registration r;
  r.rec.name = spec.name;
  r.rec.numel = spec.numel;
  r.rec.dtype = spec.dtype;
  r.rec.module = spec.module;
  r.rec.group = spec.group;
  r.init.assign(spec.init.begin(), spec.init.end());
  r.initializer = spec.initializer;
  const int id = static_cast<int>(regs_.size());
  by_name_[r.rec.name] = id;
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
  scheduler::LayoutOptions lo = scheduler::LayoutOptionsFromConfig(cfg_);
  lo.world_size = dp_ ? dp_->world_size() : 1;
  // Partitioned parameters come into device slots as offloaded ones do.
  if (PartitionsParams()) lo.params_offloaded = true;
  layout_ = Layout::Build(std::move(recs), lo);
  part_ = std::make_unique<const scheduler::Partition>(&layout_, rank(), world_size(),
                                                       PartitionsParams());
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

  // Leftover swap files of killed runs go before the plan counts free space
  // (one notice each; files of live runs are left alone).
  for (const std::string& p : scheduler::UsedNvmePaths(cfg_))
    RETURN_IF_ERROR(nvme::RemoveLeftoverSwapFiles(p).status());
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
  if (part_->params_partitioned())
    sizes.partitioned_param_bytes = scheduler::IoBytes(layout_.MaxOwnedBytes());
  scheduler::TierFacts facts = scheduler::MeasureTierFacts(
      static_cast<int64_t>(dev_->Stats().budget_bytes), cfg_.strata.pinned_budget_bytes,
      scheduler::UsedNvmePaths(cfg_), cfg_.strata.dram_budget_bytes);
  // The link rates the step bound and the gradient path use (pinned copies
  // of a few MiB each way, one pageable), the accumulation and Adam rates.
  ASSIGN_OR_RETURN(const scheduler::PlanRates rates,
                   scheduler::MeasurePlanRates(dev_.get(), adam_.get(), layout_.total_elems(),
                                               !device_optimizer_));
  counters_.SetLinkRates(rates.link.h2d_gbytes_per_s, rates.link.d2h_gbytes_per_s);
  facts.d2h_pinned_gbps = rates.link.d2h_gbytes_per_s;
  facts.d2h_pageable_gbps = rates.link.d2h_pageable_gbytes_per_s;
  facts.accumulate_gbps = rates.accumulate_gbps;
  const scheduler::TierPlan plan = scheduler::ComputeTierPlan(placement, sizes, facts);
  budgets_ = plan.budgets;
  if (!plan.fits) return ResourceExhaustedError(OverBudgetTable(plan, placement, sizes));
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
  ho.buffer_count = cfg_.zero_optimization.offload_optimizer.buffer_count;
  ho.before_sub_group = hooks_.before_sub_group;
  ho.dp = dp_.get();
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

// ---------------------------------------------------------------------------
// The hooks: parameters acquired before use, gradients handed over after backward
// ---------------------------------------------------------------------------

Status EngineImpl::FetchError(Status fetch) {
  // A fetch that failed while a step is in flight (it reads what the step
  // wrote): the step's own failure, if it failed, is what the caller must
  // hear about (its rollback); else the fetch's.
  if (fetch.ok() || !backend_->reading_next_params()) return fetch;
  Status step = backend_->Join();
  return step.ok() ? fetch : step;
}

Status EngineImpl::CheckModule(int module, const char* call) const {
  if (module < 0 || module >= layout_.num_modules() || !layout_.module(module).registered)
    return InvalidArgumentError(
        fmt::format("{}({}): no parameters are registered for module {}", call, module, module));
  return Status();
}

StatusOr<ModuleView> EngineImpl::BeforeForward(int module) {
  counters_.HookEntry();
  RETURN_IF_ERROR(Plan());
  RETURN_IF_ERROR(CheckModule(module, "BeforeForward"));
  RETURN_IF_ERROR(backend_->Poll());
  StatusOr<ModuleView> v = fetcher_->Acquire(module, Phase::kForward);
  if (!v.ok()) return FetchError(v.status());
  counters_.HookExit();
  return v;
}

Status EngineImpl::AfterForward(int module) {
  counters_.HookEntry();
  RETURN_IF_ERROR(CheckModule(module, "AfterForward"));
  if (!planned_) return FailedPreconditionError("AfterForward before any BeforeForward");
  RETURN_IF_ERROR(backend_->Poll());
  RETURN_IF_ERROR(fetcher_->Release(module));
  counters_.HookExit();
  return Status();
}

StatusOr<ModuleView> EngineImpl::BeforeBackward(int module) {
  counters_.HookEntry();
  RETURN_IF_ERROR(Plan());
  RETURN_IF_ERROR(CheckModule(module, "BeforeBackward"));
  RETURN_IF_ERROR(backend_->Poll());
  if (fetcher_->has_grad(module))
    return FailedPreconditionError(
        fmt::format("BeforeBackward({}): the module's previous gradients were not handed over with "
                    "AfterBackward",
                    module));
  StatusOr<ModuleView> v = fetcher_->Acquire(module, Phase::kBackward);
  if (!v.ok()) return FetchError(v.status());
  if (last_micro_batch()) backend_->PrepareStep();  // the step follows this backward pass
  counters_.HookExit();
  return v;
}

Status EngineImpl::AfterBackward(int module) {
  counters_.HookEntry();
  RETURN_IF_ERROR(CheckModule(module, "AfterBackward"));
  if (!planned_ || !fetcher_->has_grad(module))
    return FailedPreconditionError(fmt::format("AfterBackward({}) without BeforeBackward", module));
  window_.grads_since_launch = true;
  RETURN_IF_ERROR(backend_->AddGradients(module, fetcher_->grad(module), fetcher_->computed(module),
                                         last_micro_batch()));
  RETURN_IF_ERROR(fetcher_->ReleaseGrad(module, backend_->gradients_read_on()));
  counters_.HookExit();
  return Status();
}

// ---------------------------------------------------------------------------
// The optimizer step
// ---------------------------------------------------------------------------

std::vector<cpu_adam::HyperParams> EngineImpl::HyperParamsFor(double grad_scale) const {
  const cpu_adam::HyperParams base =
      scheduler::OptimizerHyperParams(cfg_, backend_->steps(), std::nullopt, grad_scale);
  std::vector<cpu_adam::HyperParams> out;
  for (size_t g = 0; g < groups_.size(); ++g)
    out.push_back(scheduler::GroupHyperParams(cfg_, base, groups_[g], lr_override_[g]));
  return out;
}

Status EngineImpl::SetLearningRate(double lr) {
  for (int g = 0; g < num_param_groups(); ++g) RETURN_IF_ERROR(SetLearningRate(g, lr));
  return Status();
}

Status EngineImpl::SetLearningRate(int group, double lr) {
  RETURN_IF_ERROR(CheckGroup(group, "SetLearningRate"));
  if (!std::isfinite(lr) || lr < 0)
    return InvalidArgumentError(
        fmt::format("SetLearningRate: {} is not allowed; must be >= 0", lr));
  if (cfg_.scheduler.type != LrScheduleType::kNone)
    return FailedPreconditionError(fmt::format(
        "SetLearningRate: the config's scheduler section ({}) sets the learning rate at every "
        "step; remove the section to set the learning rate from outside",
        LrScheduleTypeName(cfg_.scheduler.type)));
  lr_override_[static_cast<size_t>(group)] = lr;
  return Status();
}

double EngineImpl::learning_rate(int group) const {
  if (group < 0 || group >= num_param_groups()) return 0.0;
  const auto g = static_cast<size_t>(group);
  return scheduler::GroupLearningRate(cfg_, planned_ ? backend_->steps() : 0, groups_[g],
                                      lr_override_[g]);
}

Status EngineImpl::ZeroGrad() {
  if (!planned_) return Status();
  RETURN_IF_ERROR(backend_->Poll());
  return backend_->ZeroGrad();
}

Status EngineImpl::Synchronize() {
  if (!planned_) return Status();
  return backend_->Join();
}

// ---------------------------------------------------------------------------
// Checkpoints (checkpoint.h): between windows, nothing in flight
// ---------------------------------------------------------------------------

Status EngineImpl::BetweenWindows(const std::string& call, std::string_view advice) const {
  if (window_.micro_batches == 0 && !window_.grads_since_launch && !fetcher_->any_grad())
    return Status();
  return FailedPreconditionError(fmt::format(
      "{}: in the middle of an accumulation window ({} of {} micro-batches done, gradients not "
      "applied); {}",
      call, window_.micro_batches, gas_, advice));
}

Status EngineImpl::SaveCheckpoint(const std::string& dir, const CheckpointInfo& info) {
  RETURN_IF_ERROR(Plan());
  RETURN_IF_ERROR(BetweenWindows("SaveCheckpoint", "save after the Step() that ends the window"));
  RETURN_IF_ERROR(backend_->Join());
  RETURN_IF_ERROR(dev_->Synchronize());
  scheduler::CheckpointMeta meta;
  meta.optimizer_step = backend_->steps();
  meta.scaler = scaler_.state();
  meta.data_position = info.data_position;
  meta.note = info.note;
  meta.at_point = hooks_.checkpoint_point;
  meta.run_id = info.run_id.empty() ? run_id_ : info.run_id;
  meta.param_groups = groups_;
  const scheduler::CheckpointRanks* ranks = CheckpointRanks();
  Status s = scheduler::WriteCheckpoint(dir, cfg_, layout_, store_.get(), &meta, ranks);
  HoldCheckpointLock(std::move(meta.lock));
  if (!s.ok()) return s.WithContext("SaveCheckpoint " + dir);
  run_id_ = meta.run_id;
  return Status();
}

Status EngineImpl::LoadCheckpoint(const std::string& dir, CheckpointInfo* info) {
  RETURN_IF_ERROR(Plan());
  if (fetcher_->any_grad())
    return FailedPreconditionError(
        "LoadCheckpoint: a module's gradients were not handed over with AfterBackward");
  // A step in flight ends first; its outcome no longer matters.
  Status fs = backend_->Abandon();
  if (!fs.ok()) STRATA_LOG_WARN("LoadCheckpoint: the step in flight failed: {}", fs.ToString());
  RETURN_IF_ERROR(dev_->Synchronize());
  StatusOr<scheduler::CheckpointMeta> meta =
      scheduler::ReadCheckpoint(dir, cfg_, layout_, store_.get(), groups_, CheckpointRanks());
  // Device copies of parameters are stale once anything was restored.
  RETURN_IF_ERROR(fetcher_->InvalidateAll());
  if (!meta.ok()) return meta.status().WithContext("LoadCheckpoint " + dir);
  HoldCheckpointLock(std::move(meta->lock));
  run_id_ = meta->run_id;
  backend_->set_steps(meta->optimizer_step);
  scaler_.Restore(meta->scaler);
  backend_->DiscardWindow();
  if (info != nullptr) {
    info->data_position = meta->data_position;
    info->note = meta->note;
    info->optimizer_step = meta->optimizer_step;
    info->path = meta->path;
    info->run_id = meta->run_id;
  }
  return Status();
}

StatusOr<StepStats> EngineImpl::Step() {
  counters_.HookEntry();
  RETURN_IF_ERROR(Plan());
  if (fetcher_->any_grad())
    return FailedPreconditionError(
        "Step: a module's gradients were not handed over with AfterBackward");
  if (last_micro_batch() && !window_.grads_since_launch)
    return FailedPreconditionError(fmt::format(
        "Step: no gradients were handed over since the last optimizer step (no backward in this "
        "window of {} micro-batch{}); the optimizer would apply zero gradients, which weight "
        "decay and momentum still move. Run backward before Step(), or ZeroGrad() to drop the "
        "window",
        gas_, gas_ == 1 ? "" : "es"));
  StepStats st;
  st.lr = learning_rate();
  if (num_param_groups() > 1)
    for (int g = 0; g < num_param_groups(); ++g) st.group_lrs.push_back(learning_rate(g));
  Status status;
  if (++window_.micro_batches >= gas_) {
    const int64_t opt0 = NowNanos();
    status = EndWindow(&st);
    if (!status.ok()) backend_->DiscardWindow();  // the window is over, applied or not
    st.optimizer_wall_s = static_cast<double>(NowNanos() - opt0) * 1e-9;
    window_.micro_batches = 0;
  }
  // Statistics of the window since the previous Step().
  const int64_t now = NowNanos();
  st.trace_rerecords = fetcher_->NextStep();
  st.step = backend_->steps();
  st.loss_scale = scaler_.scale();
  if (dp_) {  // before EndWindow: the bound counts the network
    const scheduler::CommCounters c = dp_->TakeCounters();
    st.rank = dp_->rank();
    st.world_size = dp_->world_size();
    st.comm_reduced_bytes = c.reduced_bytes;
    st.comm_overlapped_bytes = c.overlapped_bytes;
    st.comm_gathered_bytes = c.gathered_bytes;
    st.comm_s = c.busy_s;
    st.comm_busy_s = c.device_s;
    st.comm_ring_bytes = dp_->RingBytes(c);
    st.comm_gbytes_per_s = comm_gbps_;
  }
  counters_.EndWindow(now, &st);
  st.hbm_high_water_bytes = static_cast<int64_t>(dev_->Stats().high_water_bytes);
  st.pinned_high_water_bytes = pinned_bytes_ + store_->pinned_array_bytes();
  last_ = st;
  counters_.HookExit();
  if (!status.ok()) return status;
  return st;
}

Status EngineImpl::EndWindow(StepStats* st) {
  Status status = backend_->Drain();
  // The step in flight ends here: this one reads its states (and with DPU
  // its parameters become the current ones now).
  Status joined = backend_->Join();
  RETURN_IF_ERROR(status);
  RETURN_IF_ERROR(joined);
  bool overflow = false;
  double sumsq = 0;
  RETURN_IF_ERROR(backend_->GlobalChecks(&overflow, &sumsq));
  const double scale = scaler_.scale();
  st->overflow = overflow;
  if (overflow) {
    scaler_.Update(true);
    STRATA_LOG_INFO("step {}: inf/nan in the gradients, step skipped; loss scale now {}",
                    backend_->steps() + 1, scaler_.scale());
    backend_->DiscardWindow();
    return Status();
  }
  const double norm = std::sqrt(sumsq) / scale;
  double clip_coef = 1.0;
  if (cfg_.gradient_clipping > 0) {
    const double c = cfg_.gradient_clipping / (norm + 1e-6);
    if (c < 1.0) clip_coef = c;
  }
  st->grad_norm = norm;
  st->clip_coef = clip_coef;
  scheduler::LaunchParams p;
  p.group_hp = HyperParamsFor(clip_coef / scale);
  p.hp = p.group_hp[0];
  p.delayed = cfg_.strata.delayed_param_update &&
              backend_->steps() >= cfg_.strata.delayed_param_update_warmup;
  // Beside the next window where the plan decided so (Placement::
  // overlap_step), and with delayed_param_update, whose step the next
  // Step() joins on every rank (with several ranks the gather happens there).
  p.background = p.delayed || placement_.overlap_step();
  const int64_t before = backend_->steps();
  Status launched = backend_->Launch(p);
  st->applied = backend_->steps() > before;
  return launched;
}

// ---------------------------------------------------------------------------
// The rest of the API
// ---------------------------------------------------------------------------

StatusOr<void*> EngineImpl::AllocateWorkspace(int64_t bytes) {
  if (bytes <= 0) return InvalidArgumentError(fmt::format("AllocateWorkspace: {} bytes", bytes));
  // From the arena's room beyond the plan's blocks (the fetcher's slots are
  // allocated once and never grow).
  ASSIGN_OR_RETURN(gpu::DeviceBuffer b, dev_->Allocate(static_cast<size_t>(bytes)));
  void* p = b.data();
  workspaces_[p] = std::move(b);
  return p;
}

Status EngineImpl::FreeWorkspace(void* ptr) {
  auto it = workspaces_.find(ptr);
  if (it == workspaces_.end())
    return InvalidArgumentError("FreeWorkspace: not a workspace pointer");
  RETURN_IF_ERROR(dev_->compute().Synchronize());
  workspaces_.erase(it);
  return Status();
}

Status EngineImpl::ReadParameter(int id, std::span<float> out) {
  if (id < 0 || id >= static_cast<int>(regs_.size()))
    return InvalidArgumentError(fmt::format("ReadParameter: no parameter {}", id));
  const Registration& r = regs_[static_cast<size_t>(id)];
  if (static_cast<int64_t>(out.size()) != r.rec.numel)
    return InvalidArgumentError(
        fmt::format("ReadParameter {}: buffer of {} floats, parameter has {}", r.rec.name,
                    out.size(), r.rec.numel));
  if (!planned_) {
    if (!r.init.empty()) {
      std::copy(r.init.begin(), r.init.end(), out.begin());
    } else {
      r.initializer(out);
    }
    return Status();
  }
  // A step in flight is finished (and committed) first: its states are read.
  RETURN_IF_ERROR(backend_->Join());
  RETURN_IF_ERROR(store_->ReadMaster(layout_.param(id), out));
  // Several ranks: the other partitions' values from their owners.
  if (dp_) return dp_->ShareMaster(layout_.param(id), out);
  return Status();
}

Status EngineImpl::WriteParameter(int id, std::span<const float> values) {
  if (id < 0 || id >= static_cast<int>(regs_.size()))
    return InvalidArgumentError(fmt::format("WriteParameter: no parameter {}", id));
  Registration& r = regs_[static_cast<size_t>(id)];
  if (static_cast<int64_t>(values.size()) != r.rec.numel)
    return InvalidArgumentError(fmt::format("WriteParameter {}: {} floats given, parameter has {}",
                                            r.rec.name, values.size(), r.rec.numel));
  if (!planned_) {
    r.init.assign(values.begin(), values.end());
    r.initializer = nullptr;
    return Status();
  }
  RETURN_IF_ERROR(BetweenWindows("WriteParameter " + r.rec.name, "write between windows"));
  RETURN_IF_ERROR(backend_->Join());
  RETURN_IF_ERROR(dev_->Synchronize());
  RETURN_IF_ERROR(store_->WriteMaster(layout_.param(id), values));
  // Device copies fetched before are stale.
  return fetcher_->InvalidateAll();
}

std::string EngineImpl::StatsJson() const {
  return scheduler::StepStatsJson(last_, dev_->Describe());
}

Status EngineImpl::WriteTimeline() {
  if (cfg_.strata.trace_path.empty())
    return FailedPreconditionError("WriteTimeline: strata.trace_path is not set");
  return counters_.timeline().WriteJson(cfg_.strata.trace_path);
}

}  // namespace

StatusOr<std::unique_ptr<Engine>> CreateEngine(const Config& config, const EngineTestHooks& hooks) {
  auto engine = std::make_unique<EngineImpl>(config, hooks);
  RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<Engine>(std::move(engine));
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(const Config& config) {
  return CreateEngine(config);
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
