// strata/engine.h — the offload engine a training framework links.
//
// The framework registers its parameters (in model order, grouped into
// modules), then drives each micro-batch with hooks:
//
//   for each module m in forward order:   p = BeforeForward(m); run m; AfterForward(m)
//   loss.backward() with, for each module in backward order:
//                                         v = BeforeBackward(m); run m's backward,
//                                         writing its gradients into v.grads; AfterBackward(m)
//   Step()      (applies the optimizer once every gradient_accumulation_steps calls)
//
// The engine owns where every state lives (config `zero_optimization`):
//   fp32 master parameters, exp_avg and exp_avg_sq: HBM (offload_optimizer
//   none), pinned DRAM (cpu) or the NVMe swap store (nvme);
//   fp16/bf16 parameters between uses: HBM (offload_param none), DRAM (cpu)
//   or NVMe (nvme), fetched into HBM ahead of use along the recorded trace.
// Gradients leave the device during backward, in buckets, and are
// accumulated in fp32 on the host across micro-batches.
//
// Device pointers: on a CUDA device they are CUDA device pointers; on the
// host device (strata.device = host, or no GPU) they are host pointers into
// the engine's simulated HBM arena. Device work the framework does on these
// pointers must be ordered on ComputeStream() (CUDA) — on the host device the
// framework computes synchronously on its own thread.
//
// Threading: one thread drives an Engine (External synchronization). Every
// call returns Status; no exceptions. A failed Step() leaves the parameters
// and optimizer states as they were before it, or says precisely what was
// lost.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/config.h"
#include "strata/dtype.h"
#include "strata/rendezvous.h"
#include "strata/status.h"

namespace strata {

// One parameter tensor, as a framework registers it.
struct ParamSpec {
  std::string name;  // unique
  int64_t numel = 0;
  DType dtype = DType::kBf16;  // what forward/backward compute with
  int module = 0;              // owning module id (0-based, dense)
  // Initial values in fp32 (numel of them), or empty to use `initializer`.
  std::span<const float> init;
  // Called once with a buffer of numel floats to fill (used when init is empty).
  std::function<void(std::span<float>)> initializer;
  // The optimizer parameter group (AddParamGroup): 0, the config's own
  // hyperparameters, unless the framework added groups.
  int group = 0;
  // The tensor's shape (its product is numel; empty: [numel]) and its other
  // names (a tied weight's, as the framework's state_dict lists them).
  // Checkpoints record both, so that exported weights have the model's
  // shapes under every name and load strictly; FindParameter finds a
  // parameter by any of its names.
  std::vector<int64_t> shape = {};
  std::vector<std::string> aliases = {};  // at most kMaxParamAliases
};

// The most other names one parameter may have (a weight tied across a block
// repeated a thousand times); a checkpoint claiming more is refused too.
inline constexpr size_t kMaxParamAliases = 1024;

// An optimizer parameter group, as torch.optim's param_groups and DeepSpeed's
// model_parameters give them: hyperparameters that replace the config's
// optimizer.params for the parameters registered into it (ParamSpec::group).
// Unset fields are the config's. Group 0 is the config's own (no overrides);
// AddParamGroup adds 1, 2, ... The groups are part of a checkpoint's identity.
struct ParamGroupSpec {
  std::string name;          // for messages; "" becomes "group <id>"
  std::optional<double> lr;  // not with a config `scheduler` section
  std::optional<double> weight_decay;
  std::optional<double> beta1, beta2;  // not with a schedule that cycles momentum
  std::optional<double> eps;
};

// The device view of a module during forward or backward.
struct ModuleView {
  std::vector<void*> params;  // device pointers, one per parameter, in registration order
  std::vector<void*> grads;   // BeforeBackward only: device buffers to write gradients into
};

// What happened in the last Step() and where the time went. Times are wall
// seconds on the calling thread unless noted; bytes are totals for the step.
struct StepStats {
  int64_t step = 0;       // optimizer steps applied so far
  bool applied = false;   // false: accumulating, or skipped on overflow
  bool overflow = false;  // inf/nan in the gradients (step skipped)
  // The learning rate of the optimizer step this Step() applied; when none
  // was applied (accumulating, or skipped on overflow), the one the next
  // step will use.
  double lr = 0.0;
  // The same per parameter group (index: group id), when there are several.
  std::vector<double> group_lrs;
  double loss_scale = 1.0;        // the scale for the next micro-batch
  double grad_norm = 0.0;         // global L2 norm of the (unscaled) gradients
  double clip_coef = 1.0;         // applied clip multiplier (1 = not clipped)
  double step_time_s = 0.0;       // since the previous Step() returned
  double fetch_wait_s = 0.0;      // time hooks blocked waiting for parameters
  double compute_s = 0.0;         // time between hooks (the framework's compute)
  double grad_offload_s = 0.0;    // busy time of gradient D2H + accumulation
  double optimizer_s = 0.0;       // busy time of the CPU optimizer
  double optimizer_wall_s = 0.0;  // wall time Step() spent on the optimizer (blocking part)
  double optimizer_wait_s = 0.0;  // hooks blocked for the previous step's new parameters
  double nvme_busy_s = 0.0;       // wall time with NVMe requests in flight
  double pcie_busy_s = 0.0;       // busy time of H2D + D2H copies
  int64_t nvme_read_bytes = 0;
  int64_t nvme_written_bytes = 0;
  int64_t pcie_h2d_bytes = 0;
  int64_t pcie_d2h_bytes = 0;
  int64_t hbm_high_water_bytes = 0;
  int64_t pinned_high_water_bytes = 0;
  int64_t prefetched_modules = 0;  // fetches satisfied by a prefetch
  int64_t fetch_misses = 0;        // fetches that had to start on demand
  int64_t trace_rerecords = 0;     // times the fetch order changed
  // strata.speculative_step: sub-groups this optimizer step stepped (in
  // whole or in part) during the window's last backward pass, and of those
  // the ones rolled back after the global checks, redone or dropped with a
  // skipped step (an overflow, a clip coefficient below 1, changed
  // hyperparameters, or a module whose backward ran again).
  int64_t sub_groups_speculated = 0;
  int64_t sub_groups_redone = 0;
  // max(busy of compute, PCIe, CPU optimizer, NVMe) / step time.
  double overlap_efficiency = 0.0;
  // The rates the bound below uses: pinned host<->device copy rates measured
  // by Plan(); the disk's sequential read and write rates measured by Plan()
  // (the NVMe engine writing and reading up to 256 MiB on the first NVMe
  // path, as `strata bench nvme` does); and the best rate of the engine's own
  // NVMe traffic (bytes while requests were in flight / that time), which
  // the bound uses only when the disk's were not measured. 0 without an
  // NVMe tier.
  double h2d_gbytes_per_s = 0.0;
  double d2h_gbytes_per_s = 0.0;
  double nvme_read_gbytes_per_s = 0.0;
  double nvme_write_gbytes_per_s = 0.0;
  double nvme_gbytes_per_s = 0.0;
  // A lower bound for the step's time (StepBound): the busiest resource as if
  // it had worked flat out all step, and bound_s / step_time_s.
  double bound_s = 0.0;
  double bound_efficiency = 0.0;
  const char* bound_by =
      "";  // "compute", "pcie_h2d", "pcie_d2h", "cpu_optimizer", "nvme", "network"
  // offload_param nvme: fetches during an overlapped step that took the
  // module's new bytes from the step's write-back buffer instead of reading
  // them back from NVMe.
  int64_t updated_from_memory = 0;
  // Data parallelism (several ranks): this rank, the ranks, and what the
  // window's collectives moved: gradient bytes this rank sent into the
  // reduction, of those the bytes issued while backward went on
  // (zero_optimization.overlap_comm), parameter bytes it received by
  // all-gather, and the wall time the engine waited for collectives
  // (staging copies included; an overlapped reduction counts only its wait
  // at the window's end), and the collectives' busy time on their stream
  // from device events around each (NCCL's kernels on CUDA, Gloo's calls on
  // the host device; waits for the peers included): comm_busy_s - comm_s is
  // the communication that overlapped other work.
  int rank = 0;
  int world_size = 1;
  int64_t comm_reduced_bytes = 0;
  int64_t comm_overlapped_bytes = 0;
  int64_t comm_gathered_bytes = 0;
  double comm_s = 0.0;
  double comm_busy_s = 0.0;
  // The bytes a ring algorithm moves through this rank for the window's
  // collectives, and the collectives' bus bandwidth measured at Plan
  // (nccl-tests' busbw of an all-gather; 0: not measured): their quotient
  // is the step bound's network term.
  double comm_ring_bytes = 0.0;
  double comm_gbytes_per_s = 0.0;
};

// The step's lower bound from its statistics: max(compute_s, pcie_h2d_bytes /
// h2d rate, pcie_d2h_bytes / d2h rate, optimizer_s, nvme_read_bytes / read
// rate + nvme_written_bytes / write rate (one disk: reads and writes add up;
// with the disk's rates unmeasured, (read + written) / nvme_gbytes_per_s),
// comm_ring_bytes / comm_gbytes_per_s (several ranks; comm_s when the
// bandwidth is not measured)), and which term it is. Terms whose rate
// is 0 are left out. For a window of several Step() calls, sum the busy times and bytes first.
struct StepBound {
  double seconds = 0.0;
  const char* by = "";
};
StepBound BoundOf(const StepStats& stats);

// One resource's share of an optimizer step as the plan predicts it
// (Engine::PredictedStep): what it moves per window of
// gradient_accumulation_steps micro-batches, and how long that takes at the
// rates Plan() measured.
struct PredictedTerm {
  // "pcie_h2d", "pcie_d2h", "cpu_accumulate", "cpu_optimizer", "nvme_read",
  // "nvme_write"
  std::string resource;
  double amount = 0;   // bytes (elements for cpu_optimizer)
  double seconds = 0;  // 0 when the rate is unknown
  std::string what;    // what the amount is made of
};

// Needed vs available bytes per tier, from the placement (Plan()).
struct TierBudget {
  std::string tier;  // "hbm", "pinned", "nvme"
  int64_t needed_bytes = 0;
  int64_t available_bytes = 0;  // budget or free space
  std::string detail;           // what the needed bytes are made of
};

// The caller's side of a checkpoint: where its data stream is, so that a
// resumed run continues with the next batch. Stored verbatim.
struct CheckpointInfo {
  // The caller's position, e.g. micro-batches (or samples) consumed so far.
  int64_t data_position = 0;
  // Anything else the caller needs to resume (a data loader's state, ...):
  // UTF-8 text, e.g. JSON.
  std::string note;
  // Set by LoadCheckpoint (ignored by SaveCheckpoint): optimizer steps applied
  // when the checkpoint was saved, and the checkpoint's directory.
  int64_t optimizer_step = 0;
  std::string path;
  // The run (lineage) the checkpoint belongs to. SaveCheckpoint records it
  // (empty: the engine's own, random at Create and replaced by the run id of
  // the checkpoint LoadCheckpoint restores); LoadCheckpoint sets it.
  std::string run_id;
  // Set before LoadCheckpoint: a checkpoint saved with another optimizer
  // state format (strata.optimizer_states, or DeepSpeed's bf16 state keys)
  // is loaded anyway, its states (held as fp32) encoded in this engine's
  // format. Without it such a checkpoint is refused naming both formats.
  // Between int8 and the other formats the model's layout differs (int8
  // starts every tensor on a 256-element block) and the load is refused.
  bool convert_optimizer_states = false;
};

class Engine {
 public:
  // Creates the device (strata.device), the CPU optimizer, and for NVMe
  // placements the I/O service. Nothing is allocated for parameters yet.
  static StatusOr<std::unique_ptr<Engine>> Create(const Config& config);
  // The same, for several ranks (WORLD_SIZE > 1) that meet through
  // `rendezvous` (strata/rendezvous.h: a store every rank reaches, e.g.
  // torch.distributed's TCPStore) instead of a directory they share.
  static StatusOr<std::unique_ptr<Engine>> Create(const Config& config,
                                                  std::shared_ptr<RendezvousStore> rendezvous);
  static StatusOr<std::unique_ptr<Engine>> CreateFromFile(const std::string& config_path);
  static StatusOr<std::unique_ptr<Engine>> CreateFromJson(std::string_view json_text);
  virtual ~Engine() = default;

  // Registers a parameter; returns its id (0, 1, 2, ... in call order).
  // REQUIRES: before the first BeforeForward (or Plan()).
  virtual StatusOr<int> RegisterParameter(const ParamSpec& spec) = 0;
  // Adds an optimizer parameter group; returns its id (1, 2, ... in call
  // order; group 0 is the config's). REQUIRES: before Plan(). InvalidArgument
  // for a negative or non-finite value, betas outside [0, 1), or a duplicate
  // name; FailedPrecondition for an lr when the config has a `scheduler`
  // section (it sets the lr of every group), or betas when that schedule
  // cycles momentum. RegisterParameter refuses a group id not added.
  virtual StatusOr<int> AddParamGroup(const ParamGroupSpec& spec) = 0;
  virtual int num_param_groups() const = 0;
  virtual const ParamGroupSpec& param_group(int group) const = 0;

  // Computes the placement and each tier's needs; fails with
  // ResourceExhausted and the needed-vs-available table when it cannot fit.
  // Then allocates and initializes every state. Called by the first hook if
  // not called before. Idempotent.
  virtual Status Plan() = 0;
  virtual std::vector<TierBudget> Budgets() const = 0;
  // The plan's prediction of one optimizer step per resource, at the rates
  // Plan() measured (PCIe, the CPU's accumulation and Adam, the disk).
  // Parameter fetches are counted for forward and backward of every
  // micro-batch (an upper bound); compute is not predicted. Empty before
  // Plan().
  virtual std::vector<PredictedTerm> PredictedStep() const = 0;

  virtual StatusOr<ModuleView> BeforeForward(int module) = 0;
  virtual Status AfterForward(int module) = 0;
  virtual StatusOr<ModuleView> BeforeBackward(int module) = 0;
  // The module's gradient buffers (from BeforeBackward) are complete: they are
  // copied to the host (bucketed, overlapped with the rest of backward).
  virtual Status AfterBackward(int module) = 0;

  // Ends a micro-batch. On the last micro-batch of an accumulation window it
  // applies the optimizer (FailedPrecondition, and nothing changes, when no
  // gradients were handed over since the last optimizer step: the update
  // would be one of zero gradients, which weight decay and momentum still
  // move): fp16 overflow → skipped (loss scale lowered);
  // gradient clipping by global norm; updated parameters copied to where
  // offload_param says.
  //
  // With strata.overlap_optimizer (the default) Step() returns once the
  // global checks are done and the optimizer has started; it runs on while
  // the next forward pass begins, and BeforeForward/BeforeBackward of a
  // module wait only for the sub-groups holding its parameters, so the
  // arithmetic is exactly that of a blocking step. An error of that step
  // (NVMe I/O) is returned by the next Engine call (any hook, Step,
  // ZeroGrad, ReadParameter or Synchronize); the engine has then rolled the
  // step back: parameters and optimizer states are those before it, the
  // window's gradients are discarded, and a micro-batch in progress must be
  // restarted from its first module. With strata.delayed_param_update the
  // step runs during the whole next window, which uses the parameters from
  // before it (ZeRO-Offload's DPU); its outputs become current at the next
  // Step() (or Synchronize()).
  virtual StatusOr<StepStats> Step() = 0;
  // Discards accumulated gradients.
  virtual Status ZeroGrad() = 0;
  // Waits for the optimizer step in flight, commits it (its parameters become
  // the current ones) and returns its error, if any. For checkpoints and
  // evaluation; ReadParameter does this itself.
  virtual Status Synchronize() = 0;

  // Checkpoints (docs/design.md, "Checkpoints"). Call SaveCheckpoint after
  // the Step() that ends an accumulation window (FailedPrecondition in the
  // middle of one: accumulated gradients are not saved) and before the next
  // BeforeForward; it finishes the optimizer step in flight first (as
  // Synchronize()). It writes the current parameters, the fp32 masters and
  // moments, the optimizer step count, the loss scaler's state, the config's
  // and the layout's identity and `info` into a new directory under `dir`
  // (created if missing), copying NVMe-resident states out of the swap store;
  // the checkpoint becomes valid only when its manifest (with a CRC-32C per
  // file) has been fsync'd and renamed into place, so a crash at any point
  // leaves the previous checkpoint loadable. The two newest checkpoints of
  // the run (CheckpointInfo::run_id) are kept; another run's are never
  // removed: a `dir` holding complete checkpoints of another run is refused
  // (FailedPrecondition naming them; LoadCheckpoint first continues that
  // run). The engine locks `dir` (flock on dir/LOCK) at its first save or
  // load there and holds it until it is destroyed: another process's save or
  // load there is refused (Unavailable, naming the holder's pid and run id). Cost: reading every
  // state once from where it lives and writing about 12 + 2 bytes per parameter (bf16/fp16; 16 for
  // fp32), then fsync. With strata.delayed_param_update the step in flight becomes current at the
  // save (as at Synchronize()), so the run continues as after an ordinary step.
  // With several ranks it is a collective: every rank calls it with the same
  // `dir`, on a filesystem every rank sees; rank 0 locks it and writes the
  // parameters and the manifest, each rank its partition of the states, and
  // every rank returns the same status. The run id is rank 0's.
  virtual Status SaveCheckpoint(const std::string& dir, const CheckpointInfo& info) = 0;
  // Restores the newest checkpoint under `dir` (or `dir` itself when it is a
  // checkpoint's directory): after RegisterParameter of every parameter (it
  // calls Plan() if needed), before or between windows. The config's
  // arithmetic fields and the layout must equal the saved ones, else
  // FailedPrecondition naming the first difference ("optimizer.params.lr:
  // 0.001 in the checkpoint, 0.002 now", "parameter block3.w1: numel 1024 in
  // the checkpoint, 2048 now"); the placement may differ. A missing, truncated or
  // corrupt file is DataLoss naming it and the checksums. Every file is
  // verified before anything is restored, so a refused checkpoint leaves the
  // engine as it was. Loading from a root directory also removes what an
  // interrupted save left under it (a checkpoint without a manifest, or one
  // beyond the two newest), as that save would have. `info` (may be null)
  // receives what was saved. Training
  // then continues bitwise as the run that saved it. Cost: every file is read
  // twice (verify, restore) and the states are written to where they live.
  // With several ranks it is a collective, as SaveCheckpoint; the checkpoint
  // may have been saved by any number of ranks (train_batch_size, the global
  // batch, must match; the micro-batch and accumulation may differ), and
  // each rank reads the parameters and the states files overlapping its
  // partition.
  virtual Status LoadCheckpoint(const std::string& dir, CheckpointInfo* info) = 0;

  // The learning rate. Without a `scheduler` section it is
  // optimizer.params.lr until SetLearningRate changes it; with one it is the
  // schedule's value at the optimizer step count (config.h, ScheduleAt).
  //
  // SetLearningRate(lr): the lr of every later optimizer step (the next
  // Step() that ends a window, and on), until set again; the step in flight
  // keeps its own. Any time, also within a window (a framework's scheduler
  // steps after its optimizer's step). Not checkpointed: a resumed run sets
  // it again (a framework's scheduler restores its own state). Refused:
  // InvalidArgument for a negative or non-finite lr; FailedPrecondition when
  // the config has a `scheduler` section (one source of truth: the schedule
  // sets the lr at every step; remove the section to drive the lr from
  // outside).
  virtual Status SetLearningRate(double lr) = 0;
  // The same for one parameter group (InvalidArgument for a group that does
  // not exist); SetLearningRate(lr) sets every group's.
  virtual Status SetLearningRate(int group, double lr) = 0;
  // The lr the next optimizer step will use (group 0's, or `group`'s): the
  // last SetLearningRate, else the group's ParamGroupSpec::lr, else the
  // config's (or its schedule's).
  virtual double learning_rate() const = 0;
  virtual double learning_rate(int group) const = 0;

  // Multiply the loss by this before backward (1 unless fp16 is enabled).
  virtual double loss_scale() const = 0;
  // Device work of the framework is ordered on this stream (cudaStream_t on
  // CUDA, nullptr on the host device).
  virtual void* ComputeStream() const = 0;
  // Scratch device memory for activations and workspaces, counted against the
  // HBM budget. Freed by FreeWorkspace or at destruction.
  virtual StatusOr<void*> AllocateWorkspace(int64_t bytes) = 0;
  virtual Status FreeWorkspace(void* ptr) = 0;
  // "cuda:0 (NVIDIA H100 ...)" or "host".
  virtual std::string DeviceName() const = 0;
  virtual bool DeviceIsHost() const = 0;

  // Copies the fp32 master value of a parameter (numel floats) to `out`.
  // With several ranks (data parallelism) each rank keeps the masters of its
  // partition only: ReadParameter is then a collective, which every rank
  // calls for the same parameters in the same order.
  virtual Status ReadParameter(int id, std::span<float> out) = 0;
  // Sets parameter `id` to `values` (numel floats): its fp32 master and its
  // working-precision copy (rounded to nearest even), wherever they live;
  // exp_avg, exp_avg_sq and the step count are kept. For loading weights into
  // a running engine (a framework's load_state_dict). Before Plan() it
  // replaces the initial values. Like LoadCheckpoint: between windows (no
  // gradients pending, else FailedPrecondition); it finishes the step in
  // flight first. Cost: the sub-groups and the module holding the parameter
  // are read and written back once.
  virtual Status WriteParameter(int id, std::span<const float> values) = 0;
  virtual StatusOr<int> FindParameter(std::string_view name) const = 0;
  virtual int num_parameters() const = 0;
  virtual int64_t num_elements() const = 0;

  // Data parallelism: one process per rank, the ranks from torchrun's
  // variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; see
  // docs/design.md, "Data parallelism"). 0 and 1 without them.
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // A collective for reports (losses, maxima): each values[i] becomes the
  // mean, sum or maximum over the ranks (every rank calls it with as many
  // values, in the same order as its other collectives). One rank: unchanged.
  enum class OverRanks { kMean, kSum, kMax };
  virtual Status ReduceOverRanks(std::span<double> values, OverRanks op) = 0;

  // Statistics of the last Step(), and as JSON.
  virtual StepStats LastStepStats() const = 0;
  virtual std::string StatsJson() const = 0;
  // Writes the Chrome-trace timeline (strata.trace_path) now; also done at
  // destruction when a path is configured.
  virtual Status WriteTimeline() = 0;
  // The file WriteTimeline writes: strata.trace_path, or with several ranks
  // this rank's own, <trace_path>.rank-<k>; "" when no path is configured.
  virtual std::string TimelinePath() const = 0;
};

}  // namespace strata
