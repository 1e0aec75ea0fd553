// src/scheduler/engine_impl.h — EngineImpl, the strata::Engine of the
// tiered scheduler, declared once for the files that define it:
//
//   engine.cc        the hooks and the step: what runs every micro-batch
//   engine_setup.cc  creation, registration, Plan() and the wiring of the parts
//   engine_state.cc  checkpoints, parameters read and written, the learning
//   rate, workspaces, statistics
//
// Not a public header: the API is include/strata/engine.h.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

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

namespace strata::scheduler {

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

  // rendezvous: the store the ranks meet through (null: a directory).
  Status Init(std::shared_ptr<RendezvousStore> rendezvous = nullptr);

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
  std::string TimelinePath() const override { return cfg_.strata.trace_path; }

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
  // gives each rank its own directory under every nvme_path (rank-<k>) and
  // its own timeline file. Before the device. (DataParallel::Create refuses
  // the stages it does not partition, naming the key.)
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
  // The launch of an unclipped, finite window (strata.speculative_step).
  scheduler::LaunchParams SpeculativeLaunch() const;
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

}  // namespace strata::scheduler
