// The training loop behind `strata train`, and the config and directories it
// runs with. See train.h.
#include "apps/strata/train/train.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "apps/strata/exit_codes.h"
#include "examples/train/model.h"
#include "src/common/log.h"
#include "src/common/private_fs.h"
#include "src/common/units.h"
#include "src/nvme/nvme.h"
#include "src/scheduler/checkpoint.h"
#include "src/scheduler/hyperparams.h"
#include "src/scheduler/layout.h"

namespace strata::cli {
namespace {

using example::Model;
using example::ModelConfig;
using example::ModelShape;
using nlohmann::json;

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// What the steps of one TrainInto share. Members are destroyed in reverse
// order: the model (its workspaces), the checkpoint directory's lock, then
// the engine (which removes its swap files).
struct Run {
  Run(Config c, const ModelShape& s, uint64_t model_seed, int64_t total_steps,
      const TrainCheckpoints& checkpoints, TrainResult* result)
      : config(std::move(c)),
        shape(s),
        dtype(example::ParamDTypeFromConfig(config)),
        seed(model_seed),
        steps(total_steps),
        ckpt(checkpoints),
        r(*result),
        data(model_seed) {}

  const Config config;  // with strata.model written out at its effective values
  const ModelShape shape;
  const DType dtype;
  const uint64_t seed;
  const int64_t steps;
  const TrainCheckpoints& ckpt;
  TrainResult& r;
  std::unique_ptr<Engine> engine;
  std::shared_ptr<scheduler::CheckpointDirLock> ckpt_lock;  // rank 0's, with a --checkpoint-dir
  std::string run_id;                                       // the checkpoints' lineage
  std::unique_ptr<Model> model;
  // What the losses' last bits depend on besides the config and the data.
  std::string arithmetic;
  const example::TextData data;
  std::vector<int32_t> inputs, targets;  // the micro-batch's, reused
};

// Rank 0 locks the checkpoint directory for the run's whole life (every rank
// saves into it together, Engine::SaveCheckpoint) and picks the run id: the
// newest complete checkpoint's with --resume, else a new one. A fresh run
// refuses a directory holding another run's checkpoints unless --overwrite
// (they are then removed). With several ranks, every rank fails when rank 0
// refuses.
Status ClaimCheckpointDir(Run& run) {
  const TrainCheckpoints& ckpt = run.ckpt;
  const Status dir_ok = [&]() -> Status {
    if (ckpt.dir.empty() || run.engine->rank() != 0) return Status();
    STRATA_ASSIGN_OR_RETURN(run.ckpt_lock, scheduler::LockCheckpointDir(ckpt.dir, ""));
    const std::vector<scheduler::CheckpointEntry> entries = scheduler::ListCheckpoints(ckpt.dir);
    if (ckpt.resume)
      for (const scheduler::CheckpointEntry& e : entries)
        if (e.complete) run.run_id = e.run_id;  // the newest's
    if (run.run_id.empty()) run.run_id = scheduler::NewCheckpointRunId();
    if (const std::string held = scheduler::OtherRunsCheckpoints(entries, run.run_id);
        !ckpt.resume && !held.empty()) {
      if (!ckpt.overwrite)
        return FailedPreconditionError("--checkpoint-dir " + ckpt.dir + " holds " + held +
                                       ": use --resume, another --checkpoint-dir, or --overwrite");
      STRATA_ASSIGN_OR_RETURN(run.r.checkpoints_overwritten,
                              scheduler::RemoveAllCheckpoints(ckpt.dir));
      STRATA_LOG_WARN("--overwrite: removed {} from {}", held, ckpt.dir);
    }
    run.ckpt_lock->SetRunId(run.run_id);
    return Status();
  }();
  if (!ckpt.dir.empty() && run.engine->world_size() > 1) {
    double refused = dir_ok.ok() ? 0 : 1;
    STRATA_RETURN_IF_ERROR(
        run.engine->ReduceOverRanks(std::span<double>(&refused, 1), Engine::OverRanks::kMax));
    if (dir_ok.ok() && refused != 0)
      return FailedPreconditionError("--checkpoint-dir " + ckpt.dir +
                                     ": refused by rank 0 (its error says why)");
  }
  return dir_ok;
}

// The result's figures that the plan fixes before the first step.
void DescribeRun(Run& run) {
  TrainResult& r = run.r;
  const Engine& engine = *run.engine;
  r.device = engine.DeviceName();
  r.dtype = run.dtype == DType::kBf16 ? "bf16" : run.dtype == DType::kFp16 ? "fp16" : "fp32";
  r.parameters = engine.num_elements();
  // Parameters and gradients in the model's dtype, the optimizer states in
  // their format (strata.optimizer_states).
  r.state_bytes = r.parameters * (2 * static_cast<int64_t>(run.dtype == DType::kFp32 ? 4 : 2)) +
                  scheduler::StateArrayBytes(run.config.strata.optimizer_states, r.parameters);
  r.budgets = engine.Budgets();
  for (const TierBudget& t : r.budgets)
    if (t.tier == "pinned" || t.tier == "dram" ||
        (t.tier == "hbm" && r.device.rfind("host", 0) == 0))
      r.planned_host_bytes += t.needed_bytes;
  r.predicted = engine.PredictedStep();
  for (const TierBudget& t : r.budgets)
    if (t.tier == "hbm") r.hbm_budget_bytes = t.available_bytes;
  r.workspace_bytes = run.model->workspace_bytes();
  r.rank = engine.rank();
  r.world_size = engine.world_size();
  r.tokens_per_step = run.shape.tokens() * run.config.gradient_accumulation_steps * r.world_size;
  run.arithmetic =
      engine.DeviceIsHost() ? "host: " + example::HostBlasArithmetic() : "cuda: " + r.device;
}

// Room for the checkpoints this run adds to the directory at its peak: a
// save writes the new one before the oldest of the kept ones goes.
Status CheckRoomForCheckpoints(Run& run) {
  const TrainCheckpoints& ckpt = run.ckpt;
  if (ckpt.dir.empty()) return Status();
  int64_t own = 0, saves = 0;
  for (const scheduler::CheckpointEntry& e : scheduler::ListCheckpoints(ckpt.dir))
    own += e.complete && e.run_id == run.run_id;
  for (int64_t s = 1; s <= run.steps; ++s)  // an upper bound when resuming
    saves += s == run.steps || (ckpt.every > 0 && s % ckpt.every == 0);
  const int64_t peak = std::min(own + saves, int64_t{scheduler::kCheckpointsKept} + 1);
  run.r.checkpoint_bytes = run.r.parameters * ((run.dtype == DType::kFp32 ? 4 : 2) +
                                               scheduler::kOptimizerStateBytesPerElem);
  return CheckCheckpointRoom(ckpt.dir, run.r.checkpoint_bytes + (int64_t{1} << 20), peak - own);
}

// With --resume, loads the newest checkpoint and returns its step (the
// losses so far come from its note); 0 when starting from the beginning.
StatusOr<int64_t> ResumeFromCheckpoint(Run& run) {
  const TrainCheckpoints& ckpt = run.ckpt;
  TrainResult& r = run.r;
  if (!ckpt.resume || ckpt.dir.empty()) return int64_t{0};
  CheckpointInfo info;
  info.convert_optimizer_states = ckpt.convert_optimizer_states;
  const double l0 = Seconds();
  Status ls = run.engine->LoadCheckpoint(ckpt.dir, &info);
  if (ls.code() == StatusCode::kNotFound) {
    // Checkpoint data without a manifest: the manifest was removed, or the
    // run's first save was interrupted. Starting over would lose the run's
    // steps, so it takes --resume-or-start.
    std::string data;
    for (const scheduler::CheckpointEntry& e : scheduler::ListCheckpoints(ckpt.dir, false)) {
      std::error_code ec;
      for (const std::filesystem::directory_entry& f :
           std::filesystem::directory_iterator(e.path, ec))
        if (const std::string name = f.path().filename().string();
            name.ends_with(".bin") || name.starts_with("MANIFEST")) {
          data += (data.empty() ? "" : ", ") + f.path().string();
          break;
        }
    }
    if (!data.empty() && !ckpt.resume_or_start)
      return DataLossError(
          "--resume: " + ckpt.dir + " holds checkpoint data (" + data +
          ") but no valid checkpoint (no MANIFEST.json: removed, or the first save was "
          "interrupted): restore the manifest, or use --resume-or-start to start from step 0");
    STRATA_LOG_WARN(
        "--resume: nothing to resume in {} (no checkpoint there{}): starting from step 0", ckpt.dir,
        data.empty() ? "" : "; checkpoint data without a manifest: " + data);
    return int64_t{0};
  }
  STRATA_RETURN_IF_ERROR(ls);
  const double load_s = Seconds() - l0;
  const int64_t first = info.data_position;
  const json note = json::parse(info.note, nullptr, false);
  if (!note.is_object() || !note.contains("losses") ||
      static_cast<int64_t>(note["losses"].size()) != first)
    return DataLossError("checkpoint " + info.path + ": its note is not this program's");
  // The data position is the optimizer steps the loop ran; the engine's
  // optimizer step counts those applied, which is every one of them but the
  // steps a dynamic loss scale skipped (fp16 with an overflow). A manifest
  // where the two disagree is not one this program wrote.
  const bool may_skip = run.config.fp16.enabled;
  if (info.optimizer_step > first || (!may_skip && info.optimizer_step != first))
    return DataLossError("checkpoint " + info.path + ": optimizer_step " +
                         std::to_string(info.optimizer_step) + " does not match data_position " +
                         std::to_string(first) + " (the optimizer steps this program ran" +
                         (may_skip ? ", overflows skipped included: optimizer_step cannot exceed it"
                                   : "; without loss scaling every one is applied") +
                         ")");
  if (first > run.steps)
    return OutOfRangeError("--steps " + std::to_string(run.steps) +
                           " is the total, and checkpoint " + info.path + " is at step " +
                           std::to_string(first) + " already: give --steps above " +
                           std::to_string(first) + " to train on");
  if (first == run.steps)
    STRATA_LOG_WARN("checkpoint {} is at step {}, which is --steps: nothing to train", info.path,
                    first);
  r.checkpoint_load_s = load_s;
  r.resumed_from_step = first;
  r.resumed_from = info.path;
  r.checkpoint_run_id = info.run_id;
  r.losses = note["losses"].get<std::vector<double>>();
  // Bitwise reproducible only on the same arithmetic (model.h,
  // HostBlasArithmetic): a resume elsewhere continues, and says so.
  if (note.contains("arithmetic") && note["arithmetic"].is_string() &&
      note["arithmetic"].get<std::string>() != run.arithmetic)
    STRATA_LOG_WARN(
        "checkpoint {} was written with other arithmetic ({}) than this run's ({}): the "
        "losses from step {} on may differ in their last bits from a run that was not "
        "interrupted",
        info.path, note["arithmetic"].get<std::string>(), run.arithmetic, first + 1);
  return first;
}

// Saves a checkpoint after `done` optimizer steps: the data position is the
// step count, the note the losses so far and the arithmetic.
Status SaveCheckpointAfter(Run& run, int64_t done) {
  CheckpointInfo info;
  info.data_position = done;
  info.run_id = run.r.checkpoint_run_id;
  info.note = json({{"losses", run.r.losses}, {"arithmetic", run.arithmetic}}).dump();
  const double s0 = Seconds();
  STRATA_RETURN_IF_ERROR(run.engine->SaveCheckpoint(run.ckpt.dir, info));
  run.r.checkpoint_save_s.push_back(Seconds() - s0);
  return Status();
}

// The counters one Step() reports for its micro-batch, added into `sum`.
void AddStepCounters(const StepStats& st, StepStats* sum) {
  sum->nvme_read_bytes += st.nvme_read_bytes;
  sum->nvme_written_bytes += st.nvme_written_bytes;
  sum->pcie_h2d_bytes += st.pcie_h2d_bytes;
  sum->pcie_d2h_bytes += st.pcie_d2h_bytes;
  sum->fetch_wait_s += st.fetch_wait_s;
  sum->compute_s += st.compute_s;
  sum->grad_offload_s += st.grad_offload_s;
  sum->optimizer_s += st.optimizer_s;
  sum->optimizer_wall_s += st.optimizer_wall_s;
  sum->optimizer_wait_s += st.optimizer_wait_s;
  sum->nvme_busy_s += st.nvme_busy_s;
  sum->pcie_busy_s += st.pcie_busy_s;
}

// One optimizer step's micro-batches: their losses summed, the last Step()'s
// statistics, and the window's traffic and busy times over its Step() calls.
struct Window {
  double loss_sum = 0;
  StepStats last;
  StepStats sum;
};

// Runs the micro-batches of optimizer step `s` (0-based), each followed by
// Engine::Step(); `*micro` counts the micro-batches of the run. The run's
// byte totals and high waters grow with each. Cancelled when `stop` is set
// before a micro-batch.
StatusOr<Window> RunMicroBatches(Run& run, int64_t s, int64_t* micro,
                                 const std::atomic<int>* stop) {
  TrainResult& r = run.r;
  Window w;
  for (int64_t k = 0; k < run.config.gradient_accumulation_steps; ++k) {
    if (const int sig = stop ? stop->load() : 0; sig != 0)
      return CancelledError("interrupted by " + SignalName(sig) + " after " + std::to_string(s) +
                            " completed step(s); step " + std::to_string(s + 1) + " abandoned");
    run.data.Batch((*micro)++ * r.world_size + r.rank, run.shape.batch, run.shape.seq_len,
                   &run.inputs, &run.targets);
    STRATA_ASSIGN_OR_RETURN(double loss, run.model->MicroBatch(run.inputs, run.targets));
    w.loss_sum += loss;
    StatusOr<StepStats> st = run.engine->Step();
    if (!st.ok()) return Status(st.status()).WithContext("step " + std::to_string(s + 1));
    w.last = *st;
    AddStepCounters(*st, &w.sum);
    r.nvme_read_bytes += st->nvme_read_bytes;
    r.nvme_written_bytes += st->nvme_written_bytes;
    r.pcie_h2d_bytes += st->pcie_h2d_bytes;
    r.pcie_d2h_bytes += st->pcie_d2h_bytes;
    r.hbm_high_water_bytes = std::max(r.hbm_high_water_bytes, st->hbm_high_water_bytes);
    r.pinned_high_water_bytes = std::max(r.pinned_high_water_bytes, st->pinned_high_water_bytes);
  }
  return w;
}

// The statistics of a whole window: the last Step()'s (the optimizer step's
// own figures and rates), with the window's sums (the engine's per-Step()
// figures cover one micro-batch), its wall time, and the overlap and the
// bound over the window.
StepStats WindowStats(const Window& w, double step_time_s) {
  StepStats window = w.last;
  window.step_time_s = step_time_s;
  window.nvme_read_bytes = w.sum.nvme_read_bytes;
  window.nvme_written_bytes = w.sum.nvme_written_bytes;
  window.pcie_h2d_bytes = w.sum.pcie_h2d_bytes;
  window.pcie_d2h_bytes = w.sum.pcie_d2h_bytes;
  window.fetch_wait_s = w.sum.fetch_wait_s;
  window.compute_s = w.sum.compute_s;
  window.grad_offload_s = w.sum.grad_offload_s;
  window.optimizer_s = w.sum.optimizer_s;
  window.optimizer_wall_s = w.sum.optimizer_wall_s;
  window.optimizer_wait_s = w.sum.optimizer_wait_s;
  window.nvme_busy_s = w.sum.nvme_busy_s;
  window.pcie_busy_s = w.sum.pcie_busy_s;
  // Same definition as StepStats::overlap_efficiency, over the window.
  const double busiest = std::max({window.compute_s, window.pcie_busy_s + window.grad_offload_s,
                                   window.optimizer_s, window.nvme_busy_s});
  window.overlap_efficiency =
      window.step_time_s > 0 ? std::min(1.0, busiest / window.step_time_s) : 0.0;
  // The engine's bound, over the window (rates are the last Step()'s).
  const StepBound bound = BoundOf(window);
  window.bound_s = bound.seconds;
  window.bound_by = bound.by;
  window.bound_efficiency =
      window.step_time_s > 0 ? std::min(1.0, bound.seconds / window.step_time_s) : 0.0;
  return window;
}

// Optimizer step `s` (0-based): its micro-batches, the global batch's mean
// loss (a collective: every rank, every step), the progress call, and the
// checkpoint due after it. `t0` is when the loop started.
Status TrainStep(Run& run, int64_t s, int64_t* micro, double t0, const std::atomic<int>* stop,
                 const ProgressFn& progress) {
  TrainResult& r = run.r;
  STRATA_ASSIGN_OR_RETURN(const Window w, RunMicroBatches(run, s, micro, stop));
  if (w.last.overflow) ++r.skipped_steps;
  const StepStats window = WindowStats(w, Seconds() - t0 - r.total_time_s);
  r.total_time_s += window.step_time_s;
  double loss = w.loss_sum / static_cast<double>(run.config.gradient_accumulation_steps);
  STRATA_RETURN_IF_ERROR(
      run.engine->ReduceOverRanks(std::span<double>(&loss, 1), Engine::OverRanks::kMean)
          .WithContext("step " + std::to_string(s + 1)));
  r.losses.push_back(loss);
  r.steps.push_back(window);
  if (progress) progress(s, run.steps, r.losses.back(), window, r);
  const TrainCheckpoints& ckpt = run.ckpt;
  if (!ckpt.dir.empty() && (s + 1 == run.steps || (ckpt.every > 0 && (s + 1) % ckpt.every == 0)))
    STRATA_RETURN_IF_ERROR(
        SaveCheckpointAfter(run, s + 1).WithContext("step " + std::to_string(s + 1)));
  return Status();
}

// After the last step: the optimizer step still running finished (its
// error, if any, reported here), the peak RSS and the loop's time with
// their maxima over the ranks, and the timeline written.
Status FinishRun(Run& run) {
  TrainResult& r = run.r;
  // strata.overlap_optimizer and DPU leave the last optimizer step running.
  STRATA_RETURN_IF_ERROR(run.engine->Synchronize().WithContext("the last optimizer step"));
  struct rusage ru {};
  if (getrusage(RUSAGE_SELF, &ru) == 0)
    r.peak_rss_bytes = static_cast<int64_t>(ru.ru_maxrss) * 1024;
  double maxima[] = {static_cast<double>(r.peak_rss_bytes), r.total_time_s};
  STRATA_RETURN_IF_ERROR(run.engine->ReduceOverRanks(maxima, Engine::OverRanks::kMax));
  r.max_peak_rss_bytes = static_cast<int64_t>(maxima[0]);
  r.max_total_time_s = maxima[1];
  if (!run.config.strata.trace_path.empty()) {
    STRATA_RETURN_IF_ERROR(run.engine->WriteTimeline());
    r.trace_path = run.engine->TimelinePath();  // with several ranks, this rank's file
  }
  return Status();
}

}  // namespace

std::string OneLine(std::string s) {
  std::string out;
  bool space = false;
  for (char c : s) {
    if (c == '\n' || c == '\r' || c == '\t') {
      if (!out.empty() && !space) out += "; ";
      space = true;
      continue;
    }
    if (space && c == ' ') continue;
    space = false;
    out += c;
  }
  while (!out.empty() && (out.back() == ' ' || out.back() == ';')) out.pop_back();
  return out;
}

std::string SignalName(int sig) {
  return sig == SIGINT    ? "SIGINT"
         : sig == SIGTERM ? "SIGTERM"
         : sig == SIGHUP  ? "SIGHUP"
                          : "signal " + std::to_string(sig);
}

std::string Human(double b) { return FormatBytes(static_cast<int64_t>(b)); }

Status PrepareNvmePaths(const Config& c, bool create_missing) {
  const auto& zo = c.zero_optimization;
  std::vector<std::string> paths;
  if (zo.offload_optimizer.device == OffloadDevice::kNvme) paths = zo.offload_optimizer.nvme_path;
  if (zo.offload_param.device == OffloadDevice::kNvme)
    paths.insert(paths.end(), zo.offload_param.nvme_path.begin(), zo.offload_param.nvme_path.end());
  for (const std::string& p : paths) {
    struct stat st {};
    if (!create_missing && stat(p.c_str(), &st) != 0) continue;  // another machine's
    if (Status s = MakeDirs(p, "nvme_path"); !s.ok()) return IOError(std::string(s.message()));
    if (access(p.c_str(), W_OK | X_OK) != 0)
      return IOError("nvme_path " + p + ": not writable (" + std::string(std::strerror(errno)) +
                     ")");
    // Leftover swap files of killed runs (unlocked) go before the plan counts
    // the directory's free space; live runs' files are left alone. One
    // notice per file (nvme::RemoveLeftoverSwapFiles).
    STRATA_RETURN_IF_ERROR(nvme::RemoveLeftoverSwapFiles(p).status());
  }
  return Status();
}

Status PrepareOutputDir(const std::string& what, const std::string& dir) {
  if (Status s = MakeDirs(dir, what); !s.ok()) return IOError(std::string(s.message()));
  if (access(dir.c_str(), W_OK | X_OK) != 0)
    return IOError(what + " " + dir + ": not writable (" + std::string(std::strerror(errno)) + ")");
  return Status();
}

Status CheckCheckpointRoom(const std::string& dir, int64_t checkpoint_bytes,
                           int64_t new_checkpoints, int64_t available_override) {
  if (new_checkpoints <= 0) return Status();
  int64_t available = available_override;
  if (available < 0) {
    struct statvfs st;
    if (statvfs(dir.c_str(), &st) != 0)
      return IOError("--checkpoint-dir " + dir + ": statvfs: " + std::strerror(errno));
    available = static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
  }
  const int64_t needed = checkpoint_bytes * new_checkpoints;
  if (available >= needed) return Status();
  return ResourceExhaustedError("--checkpoint-dir " + dir + ": " + std::to_string(needed) +
                                " bytes needed (" + std::to_string(new_checkpoints) +
                                " more checkpoint(s) of " + std::to_string(checkpoint_bytes) +
                                " bytes on disk at once during a save), " +
                                std::to_string(available) + " available");
}

StatusOr<TrainResult> Train(const Config& config, int64_t steps, const ProgressFn& progress,
                            const TrainCheckpoints& checkpoints) {
  TrainResult r;
  STRATA_RETURN_IF_ERROR(TrainInto(config, steps, &r, progress, nullptr, checkpoints));
  return r;
}

Status TrainInto(const Config& given, int64_t steps, TrainResult* result,
                 const ProgressFn& progress, const std::atomic<int>* stop,
                 const TrainCheckpoints& ckpt, const EngineTestHooks& hooks) {
  if (steps < 1) return InvalidArgumentError("steps: " + std::to_string(steps) + " must be >= 1");
  STRATA_ASSIGN_OR_RETURN(const ModelShape shape, example::ShapeFromConfig(given));
  STRATA_ASSIGN_OR_RETURN(const ModelConfig model_config, example::ModelConfigFromConfig(given));
  // strata.model with every key at its effective value: a checkpoint records
  // the config, and a default written out must compare equal to one left out.
  Config config = given;
  example::SetModelConfig(model_config, &config);
  STRATA_RETURN_IF_ERROR(PrepareNvmePaths(config));
  *result = TrainResult();
  Run run(config, shape, static_cast<uint64_t>(model_config.seed), steps, ckpt, result);
  STRATA_ASSIGN_OR_RETURN(run.engine, CreateEngine(config, hooks));
  STRATA_RETURN_IF_ERROR(ClaimCheckpointDir(run));
  STRATA_ASSIGN_OR_RETURN(run.model, Model::Create(run.engine.get(), shape, run.dtype, run.seed));
  DescribeRun(run);
  STRATA_RETURN_IF_ERROR(CheckRoomForCheckpoints(run));
  result->checkpoint_dir = ckpt.dir;
  result->checkpoint_run_id = run.run_id;
  STRATA_ASSIGN_OR_RETURN(const int64_t first, ResumeFromCheckpoint(run));
  int64_t micro = first * config.gradient_accumulation_steps;
  const double t0 = Seconds();
  for (int64_t s = first; s < steps; ++s)
    STRATA_RETURN_IF_ERROR(TrainStep(run, s, &micro, t0, stop, progress));
  return FinishRun(run);
}

StatusOr<Config> LoadCommandConfig(const std::string& path, const std::string& nvme_path,
                                   const std::string& device, int* exit_code) {
  *exit_code = kExitConfig;
  if (path.empty()) {
    *exit_code = kExitUsage;
    return InvalidArgumentError("--config is required");
  }
  STRATA_ASSIGN_OR_RETURN(Config config, LoadConfigFile(path));
  // strata.model is this program's section: the library keeps it as text.
  std::vector<std::string> model_warnings;
  StatusOr<ModelConfig> model = example::ModelConfigFromConfig(config, &model_warnings);
  if (!model.ok()) return model.status().WithContext(path);
  for (const std::string& w : model_warnings) STRATA_LOG_WARN("{}: {}", path, w);
  if (!nvme_path.empty()) {
    if (config.zero_optimization.offload_optimizer.device == OffloadDevice::kNvme)
      config.zero_optimization.offload_optimizer.nvme_path = {nvme_path};
    if (config.zero_optimization.offload_param.device == OffloadDevice::kNvme)
      config.zero_optimization.offload_param.nvme_path = {nvme_path};
  }
  if (!device.empty()) {
    if (device == "auto") {
      config.strata.device = DeviceKind::kAuto;
    } else if (device == "cuda") {
      config.strata.device = DeviceKind::kCuda;
    } else if (device == "host") {
      config.strata.device = DeviceKind::kHost;
    } else {
      *exit_code = kExitUsage;
      return InvalidArgumentError("--device: \"" + device + "\" is not one of auto, cuda, host");
    }
  }
  STRATA_RETURN_IF_ERROR(ValidateConfig(config));
  // The NVMe engine's own rules (aio.block_size a multiple of 4096, where
  // ValidateConfig accepts multiples of 512): a config error before any step.
  if (config.zero_optimization.offload_optimizer.device == OffloadDevice::kNvme ||
      config.zero_optimization.offload_param.device == OffloadDevice::kNvme)
    if (Status v = nvme::ValidateIoOptions(nvme::IoOptionsFromConfig(config)); !v.ok())
      return InvalidArgumentError(path + ": " + std::string(v.message()) +
                                  " (the NVMe engine's O_DIRECT unit; the config check accepts "
                                  "multiples of 512, DeepSpeed's rule)");
  STRATA_RETURN_IF_ERROR(example::ShapeFromConfig(config).status());
  return config;
}

}  // namespace strata::cli
