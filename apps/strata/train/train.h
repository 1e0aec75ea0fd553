// apps/strata/train/train.h — the training loop behind `strata train`:
// builds the Engine and the example model (examples/train, public API only)
// from a config, trains, and reports (progress lines, a summary table or one
// JSON object, a timeline, plots). `strata plan` (cmd_plan.cc) shares the
// config loading. The command itself is apps/strata/cmd_train.cc.
//
// Threading: call from one thread. Errors are Status; nothing throws.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "src/scheduler/scheduler.h"
#include "strata/config.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::cli {

struct TrainResult {
  std::string device;       // Engine::DeviceName()
  std::string dtype;        // "bf16", "fp16", "fp32"
  int64_t parameters = 0;   // elements
  int64_t state_bytes = 0;  // params + grads (dtype) + optimizer states (their format)
  int64_t hbm_budget_bytes = 0;
  int64_t workspace_bytes = 0;  // activations allocated as engine workspaces
  int64_t tokens_per_step = 0;
  std::vector<double> losses;    // one per optimizer step: mean over its micro-batches
  std::vector<StepStats> steps;  // the Step() that ended each optimizer step
  std::vector<TierBudget> budgets;
  std::vector<PredictedTerm> predicted;  // Engine::PredictedStep
  // Sums over every Step() call (all micro-batches).
  int64_t nvme_read_bytes = 0, nvme_written_bytes = 0, pcie_h2d_bytes = 0, pcie_d2h_bytes = 0;
  int64_t hbm_high_water_bytes = 0, pinned_high_water_bytes = 0;
  // The process's peak resident set (getrusage) at the end of the loop, and
  // the host memory the plan allocates: pinned + dram (+ hbm on the host
  // device, whose "device" memory is host memory).
  int64_t peak_rss_bytes = 0, planned_host_bytes = 0;
  int64_t skipped_steps = 0;  // fp16 overflow
  double total_time_s = 0;    // wall time of the training loop
  std::string trace_path;     // written timeline, if any
  // Checkpoints (TrainCheckpoints): the step the run resumed from (0: from
  // the start; `losses` then also holds the steps before it, from the
  // checkpoint), the checkpoint loaded, and each save's time and bytes.
  int64_t resumed_from_step = 0;
  std::string resumed_from;
  double checkpoint_load_s = 0;
  std::vector<double> checkpoint_save_s;
  int64_t checkpoint_bytes = 0;  // data bytes of one checkpoint
  std::string checkpoint_dir;
  std::string checkpoint_run_id;    // the run (lineage) its checkpoints belong to
  int checkpoints_overwritten = 0;  // another run's checkpoints removed (--overwrite)
  // Data parallelism (Engine::world_size() > 1): this rank, the ranks, and
  // the maxima over the ranks of the peak RSS and of the loop's wall time.
  // `losses` are then the means over the ranks (each rank's micro-batches
  // are its share of the global batch: micro-batch k of step s on rank r is
  // the data's (s * accumulation + k) * ranks + r), and tokens_per_step the
  // global batch's.
  int rank = 0, world_size = 1;
  int64_t max_peak_rss_bytes = 0;
  double max_total_time_s = 0;
};

// Checkpoints of a training run (Engine::SaveCheckpoint / LoadCheckpoint).
// The data position saved is the number of optimizer steps done (micro-batch
// i of the data is the same in every run); the note holds the losses so far.
//
// The directory belongs to one run lineage: a run id, new at a fresh start
// and kept by --resume, recorded in every checkpoint. The run locks the
// directory (CheckpointDirLock) before its first step and holds it to the
// end; a directory another process holds is refused, naming it. A fresh run
// (no `resume`) in a directory holding checkpoints refuses, naming their run
// and last step, unless `overwrite` (then they are removed first, and said
// so); only the run's own old checkpoints are ever pruned.
struct TrainCheckpoints {
  std::string dir;      // empty: none
  int64_t every = 0;    // save after every N optimizer steps (and after the last); 0: last only
  bool resume = false;  // first load the newest checkpoint in dir (none there: start at step 0)
  // With `resume`: start at step 0 also when dir holds checkpoint data
  // (ckpt-<N> directories with data files) but no manifest; without it,
  // that is DataLoss.
  bool resume_or_start = false;
  bool overwrite = false;  // a fresh run removes the checkpoints already in dir
  // With `resume`: a checkpoint saved with another strata.optimizer_states
  // is loaded in this run's format (CheckpointInfo::convert_optimizer_states).
  bool convert_optimizer_states = false;
};

// Called after every optimizer step (index from 0) with its loss and stats.
using ProgressFn = std::function<void(int64_t step, int64_t steps, double loss, const StepStats& st,
                                      const TrainResult& so_far)>;

// Creates the NVMe directories the config names (mkdir -p) so that a fresh
// build tree works; an unusable path is an error naming it. create_missing
// false (planning another machine: strata plan for a GPU not here) leaves a
// directory that does not exist alone.
Status PrepareNvmePaths(const Config& config, bool create_missing = true);

// Creates `dir` (mkdir -p) and checks that it is a writable directory;
// `what` names the option in the error ("--plot /proc/x: cannot create the
// directory: ...").
Status PrepareOutputDir(const std::string& what, const std::string& dir);

// Whether the file system of `dir` has room for `new_checkpoints` more
// checkpoints of `checkpoint_bytes` each (statvfs, blocks available to an
// unprivileged user): ResourceExhausted "--checkpoint-dir D: N bytes
// needed (...), M available" when not. `available_override` >= 0 replaces
// the free space measured (tests).
Status CheckCheckpointRoom(const std::string& dir, int64_t checkpoint_bytes,
                           int64_t new_checkpoints, int64_t available_override = -1);

// Trains `steps` optimizer steps (gradient_accumulation_steps micro-batches
// each). Fails before the first step when the engine, the plan or the
// activations cannot be set up.
// With `checkpoints.resume`, `steps` is the total: a run resumed at step k
// trains steps k+1..steps.
StatusOr<TrainResult> Train(const Config& config, int64_t steps,
                            const ProgressFn& progress = nullptr,
                            const TrainCheckpoints& checkpoints = {});

// Train, filling `*result` as it goes: on an error it holds the steps that
// completed (their losses and stats). `stop` (optional) is polled before
// every micro-batch: once it is non-zero (a signal number, set by a signal
// handler), the step in progress is abandoned and Cancelled is returned
// naming the signal and the steps completed. The Engine (created with
// `hooks`) is destroyed before this returns, which removes its swap files.
Status TrainInto(const Config& config, int64_t steps, TrainResult* result,
                 const ProgressFn& progress = nullptr, const std::atomic<int>* stop = nullptr,
                 const TrainCheckpoints& checkpoints = {}, const EngineTestHooks& hooks = {});

// The engine hooks `strata train` runs with, from developer switches in the
// environment (not config keys; they exist for A/B runs):
//   STRATA_FOLD_GRADS=auto|on|off   fold the window's last micro-batch into
//                                   the optimizer as the plan decides, wherever
//                                   possible, or never (bench/train_fold_ab.sh)
// In the test build of the command (`strata-test-hooks`, compiled with
// STRATA_TEST_HOOKS; never installed) also the crash points of the tests:
//   STRATA_CHECKPOINT_CRASH_AT=data|manifest_tmp|rename|cleanup
//                                   SIGKILL at that point of a checkpoint save
//                                   (tests/train/checkpoint_cli_test.cc)
// Defined in developer_hooks.cc, which each executable compiles itself.
EngineTestHooks DeveloperHooksFromEnv();

// Medians and summary figures of a result.
double MedianStepTime(const TrainResult& r);
double MedianOverlap(const TrainResult& r);
// Median of the steady steps' bound_s / step time, and the component that
// bounds most of them (StepBound).
double MedianBoundEfficiency(const TrainResult& r);
std::string MostCommonBound(const TrainResult& r);

// The `--json` object (keys: final_loss, initial_loss, steps, step_time_s,
// overlap_efficiency, tokens_per_s, hbm_high_water_bytes,
// pinned_high_water_bytes, nvme_read_bytes, nvme_written_bytes,
// pcie_h2d_bytes, pcie_d2h_bytes, device, losses, step_times_s, ...). When
// `error` is not OK (a failed or interrupted run) it also has "error" (the
// message) and "steps"/"losses" cover the steps that completed.
std::string ResultJson(const TrainResult& r, const Status& error = Status());
// The human summary table.
std::string ResultTable(const TrainResult& r);
// What `strata train` measured per optimizer step for a PredictedStep
// resource: the median over the steady steps of its bytes (pcie_h2d,
// pcie_d2h, nvme_read, nvme_write); -1 for one whose amount the run does not
// count separately (cpu_accumulate, cpu_optimizer: their busy times are in
// the steps' statistics).
double MeasuredAmount(const TrainResult& r, const std::string& resource);
// Writes loss.dat, step_time.dat and, with gnuplot on PATH, loss.svg and
// step_time.svg into dir. Returns the files written; a missing gnuplot is
// not an error (`note` says so).
StatusOr<std::vector<std::string>> WritePlots(const TrainResult& r, const std::string& dir,
                                              std::string* note);

// The config a command (train, plan) runs with: read from `path` (strata.model
// checked, its unknown keys warned about), nvme_path and device ("auto",
// "cuda", "host"; "" keeps the config's) overriding, validated with the NVMe
// engine's rules and the model's shape. On error *exit_code is the exit code
// (usage for a bad option, config otherwise).
StatusOr<Config> LoadCommandConfig(const std::string& path, const std::string& nvme_path,
                                   const std::string& device, int* exit_code);

// One line of a multi-line message (newlines and tabs become "; ").
std::string OneLine(std::string s);
// "SIGINT", "SIGTERM", "SIGHUP" or "signal N".
std::string SignalName(int sig);
// FormatBytes of a byte count held in a double.
std::string Human(double bytes);

}  // namespace strata::cli
