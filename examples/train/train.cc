// The training loop and reports behind `strata train`. See train.h.
#include "examples/train/train.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <system_error>
#include <thread>

#include "apps/strata/exit_codes.h"
#include "examples/train/model.h"
#include "src/common/env_param.h"
#include "src/common/log.h"
#include "src/common/units.h"
#include "src/nvme/nvme.h"
#include "src/scheduler/checkpoint.h"
#include "src/scheduler/scheduler.h"

namespace strata::example {
namespace {

using nlohmann::json;

// Developer switches of `strata train`, read from the environment (not
// config keys: they exist for A/B runs and crash tests):
//   STRATA_FOLD_GRADS=auto|on|off   fold the window's last micro-batch into
//                                   the optimizer as the plan decides, wherever
//                                   possible, or never (bench/train_fold_ab.sh)
//   STRATA_CHECKPOINT_CRASH_AT=data|manifest_tmp|rename|cleanup
//                                   SIGKILL at that point of a checkpoint save
//                                   (tests/train/checkpoint_cli_test.cc)
EngineTestHooks DeveloperHooksFromEnv() {
  EngineTestHooks hooks;
  const std::string fold = EnvString("STRATA_FOLD_GRADS", "auto");
  hooks.fold_override = fold == "on" ? 1 : (fold == "off" ? 0 : -1);
  const std::string crash_at = EnvString("STRATA_CHECKPOINT_CRASH_AT", "");
  if (!crash_at.empty())
    hooks.checkpoint_point = [crash_at](std::string_view point) {
      if (point == crash_at) ::raise(SIGKILL);
    };
  return hooks;
}

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Human(double b) { return FormatBytes(static_cast<int64_t>(b)); }

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

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Steps after the first (which records the fetch trace and warms up), when there are any.
std::vector<const StepStats*> SteadySteps(const TrainResult& r) {
  std::vector<const StepStats*> out;
  for (size_t i = r.steps.size() > 1 ? 1 : 0; i < r.steps.size(); ++i) out.push_back(&r.steps[i]);
  return out;
}

std::string SignalName(int sig) {
  return sig == SIGINT    ? "SIGINT"
         : sig == SIGTERM ? "SIGTERM"
         : sig == SIGHUP  ? "SIGHUP"
                          : "signal " + std::to_string(sig);
}

// SIGINT/SIGTERM/SIGHUP (a closed terminal) while `strata train` runs. The handler only stores the
// signal number (a lock-free atomic: async-signal-safe); the training loop
// polls it before every micro-batch. A second signal exits at once
// (write + _exit only). A watchdog thread exits the process when the loop has
// not returned within the grace period after the first signal, so a wait
// that blocks cannot hang the exit forever; swap files left that way are
// unlocked leftovers, removed by the next run on their directory.
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void OnStopSignal(int sig) {
  int expected = 0;
  if (g_stop_signal.compare_exchange_strong(expected, sig)) return;
  static const char kMsg[] = "strata train: second signal: exiting now, without cleanup\n";
  ssize_t ignored = write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
  (void)ignored;
  _exit(128 + sig);
}

class StopSignals {
 public:
  explicit StopSignals(double grace_s) : grace_s_(grace_s) {
    g_stop_signal.store(0);
    struct sigaction sa {};
    sa.sa_handler = OnStopSignal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGHUP, &sa, &old_hup_);
    try {
      watchdog_ = std::thread([this] { Watch(); });
    } catch (const std::system_error& e) {
      // No watchdog: signals still stop the loop at the next micro-batch.
      std::fprintf(stderr, "strata train: no signal watchdog (%s)\n", e.what());
    }
  }
  ~StopSignals() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGHUP, &old_hup_, nullptr);
  }
  const std::atomic<int>* flag() const { return &g_stop_signal; }
  int signal() const { return g_stop_signal.load(); }

 private:
  void Watch() {
    std::unique_lock<std::mutex> lock(mu_);
    const auto stop_or_done = [&] { return done_ || signal() != 0; };
    while (!cv_.wait_for(lock, std::chrono::milliseconds(50), stop_or_done)) {
    }
    if (done_) return;
    const int sig = signal();
    if (cv_.wait_for(lock, std::chrono::duration<double>(grace_s_), [&] { return done_; })) return;
    std::fprintf(stderr,
                 "strata train: did not stop within %.0f s of %s (blocked in a wait); exiting "
                 "without cleanup: the next run on the nvme path removes the swap files\n",
                 grace_s_, SignalName(sig).c_str());
    std::fflush(stderr);
    _exit(128 + sig);
  }

  const double grace_s_;
  struct sigaction old_int_ {
  }, old_term_{}, old_hup_{};
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;  // GUARDED_BY(mu_)
  std::thread watchdog_;
};

}  // namespace

Status PrepareNvmePaths(const Config& c) {
  const auto& zo = c.zero_optimization;
  std::vector<std::string> paths;
  if (zo.offload_optimizer.device == OffloadDevice::kNvme) paths = zo.offload_optimizer.nvme_path;
  if (zo.offload_param.device == OffloadDevice::kNvme)
    paths.insert(paths.end(), zo.offload_param.nvme_path.begin(), zo.offload_param.nvme_path.end());
  for (const std::string& p : paths) {
    std::error_code ec;
    std::filesystem::create_directories(p, ec);
    if (ec) return IOError("nvme_path " + p + ": cannot create the directory: " + ec.message());
    if (!std::filesystem::is_directory(p, ec))
      return IOError("nvme_path " + p + ": not a directory");
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
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IOError(what + " " + dir + ": cannot create the directory: " + ec.message());
  if (!std::filesystem::is_directory(dir, ec))
    return IOError(what + " " + dir + ": not a directory");
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
                 const TrainCheckpoints& ckpt) {
  if (steps < 1) return InvalidArgumentError("steps: " + std::to_string(steps) + " must be >= 1");
  STRATA_ASSIGN_OR_RETURN(ModelShape shape, ShapeFromConfig(given));
  STRATA_ASSIGN_OR_RETURN(const ModelConfig model_config, ModelConfigFromConfig(given));
  // strata.model with every key at its effective value: a checkpoint records
  // the config, and a default written out must compare equal to one left out.
  Config config = given;
  SetModelConfig(model_config, &config);
  const DType dtype = ParamDTypeFromConfig(config);
  STRATA_RETURN_IF_ERROR(PrepareNvmePaths(config));
  TrainResult& r = *result;
  r = TrainResult();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          CreateEngine(config, DeveloperHooksFromEnv()));
  // The checkpoint directory is this run's for its whole life: rank 0 locks
  // it (every rank saves into it together, Engine::SaveCheckpoint).
  std::shared_ptr<scheduler::CheckpointDirLock> ckpt_lock;
  std::string run_id;
  const Status dir_ok = [&]() -> Status {
    if (ckpt.dir.empty() || engine->rank() != 0) return Status();
    STRATA_ASSIGN_OR_RETURN(ckpt_lock, scheduler::LockCheckpointDir(ckpt.dir, ""));
    const std::vector<scheduler::CheckpointEntry> entries = scheduler::ListCheckpoints(ckpt.dir);
    if (ckpt.resume)
      for (const scheduler::CheckpointEntry& e : entries)
        if (e.complete) run_id = e.run_id;  // the newest's
    if (run_id.empty()) run_id = scheduler::NewCheckpointRunId();
    if (const std::string held = scheduler::OtherRunsCheckpoints(entries, run_id);
        !ckpt.resume && !held.empty()) {
      if (!ckpt.overwrite)
        return FailedPreconditionError("--checkpoint-dir " + ckpt.dir + " holds " + held +
                                       ": use --resume, another --checkpoint-dir, or --overwrite");
      STRATA_ASSIGN_OR_RETURN(r.checkpoints_overwritten, scheduler::RemoveAllCheckpoints(ckpt.dir));
      STRATA_LOG_WARN("--overwrite: removed {} from {}", held, ckpt.dir);
    }
    ckpt_lock->SetRunId(run_id);
    return Status();
  }();
  if (!ckpt.dir.empty() && engine->world_size() > 1) {
    double refused = dir_ok.ok() ? 0 : 1;
    STRATA_RETURN_IF_ERROR(
        engine->ReduceOverRanks(std::span<double>(&refused, 1), Engine::OverRanks::kMax));
    if (dir_ok.ok() && refused != 0)
      return FailedPreconditionError("--checkpoint-dir " + ckpt.dir +
                                     ": refused by rank 0 (its error says why)");
  }
  STRATA_RETURN_IF_ERROR(dir_ok);

  const uint64_t seed = static_cast<uint64_t>(model_config.seed);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Model> model,
                          Model::Create(engine.get(), shape, dtype, seed));

  r.device = engine->DeviceName();
  r.dtype = dtype == DType::kBf16 ? "bf16" : dtype == DType::kFp16 ? "fp16" : "fp32";
  r.parameters = engine->num_elements();
  r.state_bytes = r.parameters * (2 * static_cast<int64_t>(dtype == DType::kFp32 ? 4 : 2) + 12);
  r.budgets = engine->Budgets();
  for (const TierBudget& t : r.budgets)
    if (t.tier == "pinned" || t.tier == "dram" ||
        (t.tier == "hbm" && r.device.rfind("host", 0) == 0))
      r.planned_host_bytes += t.needed_bytes;
  r.predicted = engine->PredictedStep();
  for (const TierBudget& t : r.budgets)
    if (t.tier == "hbm") r.hbm_budget_bytes = t.available_bytes;
  r.workspace_bytes = model->workspace_bytes();
  r.rank = engine->rank();
  r.world_size = engine->world_size();
  r.tokens_per_step = shape.tokens() * config.gradient_accumulation_steps * r.world_size;
  if (!ckpt.dir.empty()) {
    // Room for the checkpoints this run adds to the directory at its peak:
    // a save writes the new one before the oldest of the kept ones goes.
    int64_t own = 0, saves = 0;
    for (const scheduler::CheckpointEntry& e : scheduler::ListCheckpoints(ckpt.dir))
      own += e.complete && e.run_id == run_id;
    for (int64_t s = 1; s <= steps; ++s)  // an upper bound when resuming
      saves += s == steps || (ckpt.every > 0 && s % ckpt.every == 0);
    const int64_t peak = std::min(own + saves, int64_t{scheduler::kCheckpointsKept} + 1);
    r.checkpoint_bytes =
        r.parameters * ((dtype == DType::kFp32 ? 4 : 2) + scheduler::kOptimizerStateBytesPerElem);
    STRATA_RETURN_IF_ERROR(
        CheckCheckpointRoom(ckpt.dir, r.checkpoint_bytes + (int64_t{1} << 20), peak - own));
  }

  // What the losses' last bits depend on besides the config and the data.
  const std::string arithmetic =
      engine->DeviceIsHost() ? "host: " + HostBlasArithmetic() : "cuda: " + r.device;
  TextData data(seed);
  std::vector<int32_t> inputs, targets;
  int64_t first = 0;
  r.checkpoint_dir = ckpt.dir;
  r.checkpoint_run_id = run_id;
  if (ckpt.resume && !ckpt.dir.empty()) {
    CheckpointInfo info;
    const double l0 = Seconds();
    Status ls = engine->LoadCheckpoint(ckpt.dir, &info);
    if (ls.ok()) {
      const double load_s = Seconds() - l0;
      first = info.data_position;
      const json note = json::parse(info.note, nullptr, false);
      if (!note.is_object() || !note.contains("losses") ||
          static_cast<int64_t>(note["losses"].size()) != first)
        return DataLossError("checkpoint " + info.path + ": its note is not this program's");
      if (first > steps)
        return OutOfRangeError("--steps " + std::to_string(steps) +
                               " is the total, and checkpoint " + info.path + " is at step " +
                               std::to_string(first) + " already: give --steps above " +
                               std::to_string(first) + " to train on");
      if (first == steps)
        STRATA_LOG_WARN("checkpoint {} is at step {}, which is --steps: nothing to train",
                        info.path, first);
      r.checkpoint_load_s = load_s;
      r.resumed_from_step = first;
      r.resumed_from = info.path;
      r.checkpoint_run_id = info.run_id;
      r.losses = note["losses"].get<std::vector<double>>();
      // Bitwise reproducible only on the same arithmetic (model.h,
      // HostBlasArithmetic): a resume elsewhere continues, and says so.
      if (note.contains("arithmetic") && note["arithmetic"].is_string() &&
          note["arithmetic"].get<std::string>() != arithmetic)
        STRATA_LOG_WARN(
            "checkpoint {} was written with other arithmetic ({}) than this run's ({}): the "
            "losses from step {} on may differ in their last bits from a run that was not "
            "interrupted",
            info.path, note["arithmetic"].get<std::string>(), arithmetic, first + 1);
    } else if (ls.code() == StatusCode::kNotFound) {
      STRATA_LOG_WARN(
          "--resume: nothing to resume in {} (no checkpoint there): starting from step 0",
          ckpt.dir);
    } else {
      return ls;
    }
  }
  auto save = [&](int64_t done) -> Status {
    CheckpointInfo info;
    info.data_position = done;
    info.run_id = r.checkpoint_run_id;
    info.note = json({{"losses", r.losses}, {"arithmetic", arithmetic}}).dump();
    const double s0 = Seconds();
    STRATA_RETURN_IF_ERROR(engine->SaveCheckpoint(ckpt.dir, info));
    r.checkpoint_save_s.push_back(Seconds() - s0);
    return Status();
  };
  int64_t micro = first * config.gradient_accumulation_steps;
  const double t0 = Seconds();
  for (int64_t s = first; s < steps; ++s) {
    double loss_sum = 0;
    StepStats last;
    StepStats sum;  // this window's traffic and busy times, over its Step() calls
    for (int64_t k = 0; k < config.gradient_accumulation_steps; ++k) {
      if (const int sig = stop ? stop->load() : 0; sig != 0)
        return CancelledError("interrupted by " + SignalName(sig) + " after " + std::to_string(s) +
                              " completed step(s); step " + std::to_string(s + 1) + " abandoned");
      data.Batch(micro++ * r.world_size + r.rank, shape.batch, shape.seq_len, &inputs, &targets);
      STRATA_ASSIGN_OR_RETURN(double loss, model->MicroBatch(inputs, targets));
      loss_sum += loss;
      StatusOr<StepStats> st = engine->Step();
      if (!st.ok()) return Status(st.status()).WithContext("step " + std::to_string(s + 1));
      last = *st;
      sum.nvme_read_bytes += st->nvme_read_bytes;
      sum.nvme_written_bytes += st->nvme_written_bytes;
      sum.pcie_h2d_bytes += st->pcie_h2d_bytes;
      sum.pcie_d2h_bytes += st->pcie_d2h_bytes;
      sum.fetch_wait_s += st->fetch_wait_s;
      sum.compute_s += st->compute_s;
      sum.grad_offload_s += st->grad_offload_s;
      sum.optimizer_s += st->optimizer_s;
      sum.optimizer_wall_s += st->optimizer_wall_s;
      sum.optimizer_wait_s += st->optimizer_wait_s;
      sum.nvme_busy_s += st->nvme_busy_s;
      sum.pcie_busy_s += st->pcie_busy_s;
      r.nvme_read_bytes += st->nvme_read_bytes;
      r.nvme_written_bytes += st->nvme_written_bytes;
      r.pcie_h2d_bytes += st->pcie_h2d_bytes;
      r.pcie_d2h_bytes += st->pcie_d2h_bytes;
      r.hbm_high_water_bytes = std::max(r.hbm_high_water_bytes, st->hbm_high_water_bytes);
      r.pinned_high_water_bytes = std::max(r.pinned_high_water_bytes, st->pinned_high_water_bytes);
    }
    if (last.overflow) ++r.skipped_steps;
    // Step time of the whole window (all its micro-batches).
    StepStats window = last;
    window.step_time_s = Seconds() - t0 - r.total_time_s;
    // The engine's per-Step() figures cover one micro-batch; a window is the sum.
    window.nvme_read_bytes = sum.nvme_read_bytes;
    window.nvme_written_bytes = sum.nvme_written_bytes;
    window.pcie_h2d_bytes = sum.pcie_h2d_bytes;
    window.pcie_d2h_bytes = sum.pcie_d2h_bytes;
    window.fetch_wait_s = sum.fetch_wait_s;
    window.compute_s = sum.compute_s;
    window.grad_offload_s = sum.grad_offload_s;
    window.optimizer_s = sum.optimizer_s;
    window.optimizer_wall_s = sum.optimizer_wall_s;
    window.optimizer_wait_s = sum.optimizer_wait_s;
    window.nvme_busy_s = sum.nvme_busy_s;
    window.pcie_busy_s = sum.pcie_busy_s;
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
    r.total_time_s += window.step_time_s;
    double loss = loss_sum / static_cast<double>(config.gradient_accumulation_steps);
    // The global batch's mean loss (a collective: every rank, every step).
    STRATA_RETURN_IF_ERROR(
        engine->ReduceOverRanks(std::span<double>(&loss, 1), Engine::OverRanks::kMean)
            .WithContext("step " + std::to_string(s + 1)));
    r.losses.push_back(loss);
    r.steps.push_back(window);
    if (progress) progress(s, steps, r.losses.back(), window, r);
    if (!ckpt.dir.empty() && (s + 1 == steps || (ckpt.every > 0 && (s + 1) % ckpt.every == 0))) {
      STRATA_RETURN_IF_ERROR(save(s + 1).WithContext("step " + std::to_string(s + 1)));
    }
  }
  // The last optimizer step may still be running (strata.overlap_optimizer,
  // DPU): finish it, so that its error, if any, is reported here.
  STRATA_RETURN_IF_ERROR(engine->Synchronize().WithContext("the last optimizer step"));
  struct rusage ru {};
  if (getrusage(RUSAGE_SELF, &ru) == 0)
    r.peak_rss_bytes = static_cast<int64_t>(ru.ru_maxrss) * 1024;
  {
    double maxima[] = {static_cast<double>(r.peak_rss_bytes), r.total_time_s};
    STRATA_RETURN_IF_ERROR(engine->ReduceOverRanks(maxima, Engine::OverRanks::kMax));
    r.max_peak_rss_bytes = static_cast<int64_t>(maxima[0]);
    r.max_total_time_s = maxima[1];
  }
  if (!config.strata.trace_path.empty()) {
    STRATA_RETURN_IF_ERROR(engine->WriteTimeline());
    r.trace_path = r.world_size > 1  // the engine's file for this rank
                       ? config.strata.trace_path + ".rank-" + std::to_string(r.rank)
                       : config.strata.trace_path;
  }
  return Status();
}

double MedianStepTime(const TrainResult& r) {
  std::vector<double> v;
  for (const StepStats* s : SteadySteps(r)) v.push_back(s->step_time_s);
  return Median(v);
}

double MeasuredAmount(const TrainResult& r, const std::string& resource) {
  std::vector<double> v;
  for (const StepStats* s : SteadySteps(r)) {
    if (resource == "pcie_h2d")
      v.push_back(static_cast<double>(s->pcie_h2d_bytes));
    else if (resource == "pcie_d2h")
      v.push_back(static_cast<double>(s->pcie_d2h_bytes));
    else if (resource == "nvme_read")
      v.push_back(static_cast<double>(s->nvme_read_bytes));
    else if (resource == "nvme_write")
      v.push_back(static_cast<double>(s->nvme_written_bytes));
    else
      return -1;
  }
  return v.empty() ? -1 : Median(v);
}

double MedianOverlap(const TrainResult& r) {
  std::vector<double> v;
  for (const StepStats* s : SteadySteps(r)) v.push_back(s->overlap_efficiency);
  return Median(v);
}

double MedianBoundEfficiency(const TrainResult& r) {
  std::vector<double> v;
  for (const StepStats* s : SteadySteps(r)) v.push_back(s->bound_efficiency);
  return Median(v);
}

std::string MostCommonBound(const TrainResult& r) {
  std::map<std::string, int> count;
  for (const StepStats* s : SteadySteps(r)) ++count[s->bound_by];
  std::string best;
  int n = 0;
  for (const auto& [by, c] : count)
    if (c > n) best = by, n = c;
  return best;
}

std::string ResultJson(const TrainResult& r, const Status& error) {
  const double step_time = MedianStepTime(r);
  json j;
  if (!error.ok()) j["error"] = OneLine(error.ToString());
  j["device"] = r.device;
  j["dtype"] = r.dtype;
  j["parameters"] = r.parameters;
  j["state_bytes"] = r.state_bytes;
  j["hbm_budget_bytes"] = r.hbm_budget_bytes;
  j["workspace_bytes"] = r.workspace_bytes;
  j["steps"] = static_cast<int64_t>(r.losses.size());
  // null when no step ran (and, as for every NaN in the output, for a NaN).
  j["initial_loss"] = r.losses.empty() ? json(nullptr) : json(r.losses.front());
  j["final_loss"] = r.losses.empty() ? json(nullptr) : json(r.losses.back());
  j["losses"] = r.losses;
  j["step_time_s"] = step_time;
  j["total_time_s"] = r.total_time_s;
  j["tokens_per_step"] = r.tokens_per_step;
  j["tokens_per_s"] = step_time > 0 ? static_cast<double>(r.tokens_per_step) / step_time : 0.0;
  j["overlap_efficiency"] = MedianOverlap(r);
  j["bound_efficiency"] = MedianBoundEfficiency(r);
  j["bound_by"] = MostCommonBound(r);
  if (!r.steps.empty()) {
    j["h2d_gbytes_per_s"] = r.steps.back().h2d_gbytes_per_s;
    j["d2h_gbytes_per_s"] = r.steps.back().d2h_gbytes_per_s;
    j["nvme_gbytes_per_s"] = r.steps.back().nvme_gbytes_per_s;
    j["nvme_read_gbytes_per_s"] = r.steps.back().nvme_read_gbytes_per_s;
    j["nvme_write_gbytes_per_s"] = r.steps.back().nvme_write_gbytes_per_s;
  }
  j["skipped_steps"] = r.skipped_steps;
  j["hbm_high_water_bytes"] = r.hbm_high_water_bytes;
  j["pinned_high_water_bytes"] = r.pinned_high_water_bytes;
  j["peak_rss_bytes"] = r.peak_rss_bytes;
  if (r.world_size > 1) {
    j["rank"] = r.rank;
    j["world_size"] = r.world_size;
    j["max_peak_rss_bytes"] = r.max_peak_rss_bytes;
    j["max_total_time_s"] = r.max_total_time_s;
  }
  j["planned_host_bytes"] = r.planned_host_bytes;
  j["nvme_read_bytes"] = r.nvme_read_bytes;
  j["nvme_written_bytes"] = r.nvme_written_bytes;
  j["pcie_h2d_bytes"] = r.pcie_h2d_bytes;
  j["pcie_d2h_bytes"] = r.pcie_d2h_bytes;
  const double t = r.total_time_s > 0 ? r.total_time_s : 1;
  j["gbytes_per_s"] = {{"nvme_read", r.nvme_read_bytes / t * 1e-9},
                       {"nvme_write", r.nvme_written_bytes / t * 1e-9},
                       {"pcie_h2d", r.pcie_h2d_bytes / t * 1e-9},
                       {"pcie_d2h", r.pcie_d2h_bytes / t * 1e-9}};
  json per_step = json::array();
  for (const StepStats& s : r.steps)
    per_step.push_back({{"step_time_s", s.step_time_s},
                        {"compute_s", s.compute_s},
                        {"fetch_wait_s", s.fetch_wait_s},
                        {"optimizer_wall_s", s.optimizer_wall_s},
                        {"optimizer_wait_s", s.optimizer_wait_s},
                        {"grad_offload_s", s.grad_offload_s},
                        {"nvme_busy_s", s.nvme_busy_s},
                        {"pcie_busy_s", s.pcie_busy_s},
                        {"overlap_efficiency", s.overlap_efficiency},
                        {"bound_s", s.bound_s},
                        {"bound_efficiency", s.bound_efficiency},
                        {"bound_by", s.bound_by},
                        {"grad_norm", s.grad_norm},
                        {"lr", s.lr},
                        {"loss_scale", s.loss_scale}});
  if (r.world_size > 1)
    for (size_t i = 0; i < r.steps.size(); ++i) {
      per_step[i]["comm_s"] = r.steps[i].comm_s;
      per_step[i]["comm_busy_s"] = r.steps[i].comm_busy_s;
      per_step[i]["comm_ring_bytes"] = r.steps[i].comm_ring_bytes;
      per_step[i]["comm_gbytes_per_s"] = r.steps[i].comm_gbytes_per_s;
      per_step[i]["comm_reduced_bytes"] = r.steps[i].comm_reduced_bytes;
      per_step[i]["comm_overlapped_bytes"] = r.steps[i].comm_overlapped_bytes;
      per_step[i]["comm_gathered_bytes"] = r.steps[i].comm_gathered_bytes;
    }
  j["per_step"] = per_step;
  json budgets = json::array();
  for (const TierBudget& b : r.budgets)
    budgets.push_back({{"tier", b.tier},
                       {"needed_bytes", b.needed_bytes},
                       {"available_bytes", b.available_bytes},
                       {"detail", b.detail}});
  j["budgets"] = budgets;
  json predicted = json::array();
  for (const PredictedTerm& t : r.predicted)
    predicted.push_back({{"resource", t.resource},
                         {"amount", t.amount},
                         {"seconds", t.seconds},
                         {"what", t.what},
                         {"measured_amount", MeasuredAmount(r, t.resource)}});
  j["predicted_step"] = predicted;
  if (!r.trace_path.empty()) j["trace_path"] = r.trace_path;
  if (!r.checkpoint_dir.empty()) {
    // null unless a checkpoint was loaded and training went on from it.
    j["resumed_from_step"] = r.resumed_from.empty() ? json(nullptr) : json(r.resumed_from_step);
    j["checkpoint"] = {{"dir", r.checkpoint_dir},
                       {"run_id", r.checkpoint_run_id},
                       {"overwritten", r.checkpoints_overwritten},
                       {"resumed_from", r.resumed_from},
                       {"load_s", r.checkpoint_load_s},
                       {"saves", r.checkpoint_save_s.size()},
                       {"save_s_median", Median(r.checkpoint_save_s)},
                       {"save_s", r.checkpoint_save_s}};
  }
  return j.dump();
}

std::string ResultTable(const TrainResult& r) {
  std::ostringstream o;
  char buf[1024];  // the plan rows are long
  const double step_time = MedianStepTime(r);
  std::snprintf(buf, sizeof(buf), "\nstrata train: %zu steps on %s, %.2fM parameters (%s)\n",
                r.losses.size(), r.device.c_str(), static_cast<double>(r.parameters) * 1e-6,
                r.dtype.c_str());
  o << buf;
  std::snprintf(buf, sizeof(buf), "  model states      %s (%.1fx the HBM budget of %s)\n",
                Human(static_cast<double>(r.state_bytes)).c_str(),
                r.hbm_budget_bytes > 0
                    ? static_cast<double>(r.state_bytes) / static_cast<double>(r.hbm_budget_bytes)
                    : 0.0,
                Human(static_cast<double>(r.hbm_budget_bytes)).c_str());
  o << buf;
  if (!r.losses.empty()) {
    std::snprintf(buf, sizeof(buf), "  loss              %.4f -> %.4f\n", r.losses.front(),
                  r.losses.back());
    o << buf;
  }
  std::snprintf(buf, sizeof(buf),
                "  step time         %.3f s median (%.1f s total), %.0f tokens/s\n", step_time,
                r.total_time_s,
                step_time > 0 ? static_cast<double>(r.tokens_per_step) / step_time : 0.0);
  o << buf;
  std::snprintf(buf, sizeof(buf),
                "  overlap           %.2f (busiest of compute, PCIe, CPU optimizer, NVMe / step "
                "time; median)\n",
                MedianOverlap(r));
  o << buf;
  if (!r.steps.empty()) {
    const StepStats& l = r.steps.back();
    std::snprintf(
        buf, sizeof(buf),
        "  bound             %.2f of the step (lower bound / step time; median), bound by "
        "%s (h2d %.1f GB/s, d2h %.1f GB/s, nvme read %.2f write %.2f GB/s)\n",
        MedianBoundEfficiency(r), MostCommonBound(r).c_str(), l.h2d_gbytes_per_s,
        l.d2h_gbytes_per_s, l.nvme_read_gbytes_per_s, l.nvme_write_gbytes_per_s);
    o << buf;
  }
  if (r.skipped_steps) o << "  skipped steps     " << r.skipped_steps << " (fp16 overflow)\n";
  const double t = r.total_time_s > 0 ? r.total_time_s : 1;
  o << "  link              bytes moved      GB/s\n";
  auto link = [&](const char* name, int64_t b) {
    std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %8.3f\n", name,
                  Human(static_cast<double>(b)).c_str(), static_cast<double>(b) / t * 1e-9);
    o << buf;
  };
  link("nvme read", r.nvme_read_bytes);
  link("nvme write", r.nvme_written_bytes);
  link("pcie h2d", r.pcie_h2d_bytes);
  link("pcie d2h", r.pcie_d2h_bytes);
  if (!r.predicted.empty()) {
    // The plan's prediction (at the rates measured when it planned) against
    // the steady steps' medians; busy seconds where the engine measures them.
    o << "  per step          predicted     measured  predicted s  (plan vs run; fetches: upper "
         "bound)\n";
    for (const PredictedTerm& t : r.predicted) {
      const double m = MeasuredAmount(r, t.resource);
      const bool elems = t.resource == "cpu_optimizer";
      auto amount = [&](double a) {
        if (a < 0) return std::string("-");
        return elems ? std::to_string(static_cast<int64_t>(a)) : Human(a);
      };
      char secs[32] = "-";
      if (t.seconds > 0) std::snprintf(secs, sizeof(secs), "%.4f s", t.seconds);
      std::snprintf(buf, sizeof(buf), "  %-16s  %9s  %11s  %11s\n", t.resource.c_str(),
                    amount(t.amount).c_str(), amount(m).c_str(), secs);
      o << buf;
    }
    std::vector<double> opt, nvme, h2d, comm, comm_busy;
    for (const StepStats* s : SteadySteps(r)) {
      opt.push_back(s->optimizer_s);
      nvme.push_back(s->nvme_busy_s);
      h2d.push_back(s->pcie_busy_s);
      comm.push_back(s->comm_s);
      comm_busy.push_back(s->comm_busy_s);
    }
    std::snprintf(buf, sizeof(buf),
                  "  measured busy     CPU optimizer %.3f s, NVMe %.3f s, PCIe h2d %.3f s%s "
                  "(medians)\n",
                  Median(opt), Median(nvme), Median(h2d),
                  r.world_size > 1
                      ? fmt::format(", collectives {:.3f} s (waited for {:.3f} s; bus bandwidth "
                                    "{:.2f} GB/s)",
                                    Median(comm_busy), Median(comm),
                                    r.steps.empty() ? 0.0 : r.steps.back().comm_gbytes_per_s)
                            .c_str()
                      : "");
    o << buf;
  }
  o << "  tier              high water       budget / needed by the plan\n";
  std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %12s\n", "hbm",
                Human(static_cast<double>(r.hbm_high_water_bytes)).c_str(),
                Human(static_cast<double>(r.hbm_budget_bytes)).c_str());
  o << buf;
  for (const TierBudget& b : r.budgets)
    if (b.tier == "pinned") {
      // The plan's pinned placement: the pools, and what crosses PCIe.
      std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %12s (%s)\n", "pinned",
                    Human(static_cast<double>(r.pinned_high_water_bytes)).c_str(),
                    Human(static_cast<double>(b.needed_bytes)).c_str(), b.detail.c_str());
      o << buf;
    }
  // The plan's gradient path: the part of the pinned or dram row that says
  // whether the last micro-batch is folded into the optimizer.
  for (const TierBudget& b : r.budgets)
    for (const char* key : {"gradient landing ", "last micro-batch accumulated "}) {
      const size_t at = b.detail.find(key);
      if (at == std::string::npos) continue;
      const size_t end = b.detail.find(" + ", at);
      o << "  gradients         "
        << b.detail.substr(at, end == std::string::npos ? std::string::npos : end - at) << " ["
        << b.tier << "]\n";
    }
  for (const TierBudget& b : r.budgets)
    if (b.tier == "dram") {
      std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %12s (%s)\n", "dram", "-",
                    Human(static_cast<double>(b.needed_bytes)).c_str(), b.detail.c_str());
      o << buf;
    }
  if (r.peak_rss_bytes > 0) {
    // What the process holds against what the plan allocates on the host.
    std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %12s (peak RSS; planned: pinned + dram%s)\n",
                  "host", Human(static_cast<double>(r.peak_rss_bytes)).c_str(),
                  Human(static_cast<double>(r.planned_host_bytes)).c_str(),
                  r.device.rfind("host", 0) == 0 ? " + hbm of the host device" : "");
    o << buf;
  }
  for (const TierBudget& b : r.budgets)
    if (b.tier == "nvme") {
      std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %12s needed (%s)\n", "nvme", "-",
                    Human(static_cast<double>(b.needed_bytes)).c_str(), b.detail.c_str());
      o << buf;
    }
  if (r.world_size > 1) {
    // Rank 0's table; the maxima over the ranks beside it.
    std::snprintf(buf, sizeof(buf),
                  "  ranks             %d (this is rank %d; loss: the mean over the ranks); "
                  "over the ranks: peak RSS at most %s, loop %.2f s at most\n",
                  r.world_size, r.rank, Human(static_cast<double>(r.max_peak_rss_bytes)).c_str(),
                  r.max_total_time_s);
    o << buf;
  }
  if (!r.trace_path.empty())
    o << "  timeline          " << r.trace_path << " (open in ui.perfetto.dev)\n";
  if (!r.checkpoint_dir.empty()) {
    std::snprintf(buf, sizeof(buf), "  checkpoints       %zu saved in %s (run %s), %.3f s median",
                  r.checkpoint_save_s.size(), r.checkpoint_dir.c_str(), r.checkpoint_run_id.c_str(),
                  Median(r.checkpoint_save_s));
    o << buf;
    if (!r.resumed_from.empty()) {
      std::snprintf(buf, sizeof(buf), "; resumed from step %lld (%s, loaded in %.3f s)",
                    static_cast<long long>(r.resumed_from_step), r.resumed_from.c_str(),
                    r.checkpoint_load_s);
      o << buf;
    }
    o << "\n";
  }
  return o.str();
}

StatusOr<std::vector<std::string>> WritePlots(const TrainResult& r, const std::string& dir,
                                              std::string* note) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IOError("--plot " + dir + ": cannot create the directory: " + ec.message());
  std::vector<std::string> files;
  const std::string loss_dat = dir + "/loss.dat", time_dat = dir + "/step_time.dat";
  {
    std::ofstream f(loss_dat);
    f << "# step loss\n";
    for (size_t i = 0; i < r.losses.size(); ++i) f << i + 1 << " " << r.losses[i] << "\n";
    if (!f) return IOError(loss_dat + ": write failed");
  }
  {
    std::ofstream f(time_dat);
    f << "# step step_time_s compute_s fetch_wait_s optimizer_s other_s\n";
    for (size_t i = 0; i < r.steps.size(); ++i) {
      const StepStats& s = r.steps[i];
      // Optimizer: what the step blocked on it (in Step(), and hooks waiting
      // for the new parameters of a step overlapping the forward pass).
      const double opt = s.optimizer_wall_s + s.optimizer_wait_s;
      const double other = std::max(0.0, s.step_time_s - s.compute_s - s.fetch_wait_s - opt);
      f << i + 1 << " " << s.step_time_s << " " << s.compute_s << " " << s.fetch_wait_s << " "
        << opt << " " << other << "\n";
    }
    if (!f) return IOError(time_dat + ": write failed");
  }
  files.push_back(loss_dat);
  files.push_back(time_dat);
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    *note =
        "gnuplot not found on PATH: wrote the .dat files only (apt-get install gnuplot-nox for "
        "SVGs)";
    return files;
  }
  const std::string script = dir + "/plot.gp";
  {
    // X from step 1 to the last step (ticks every `every` steps from 1); the
    // step-time bars are boxes at x = step, stacked by drawing the running
    // sums tallest first, and the legend sits outside the plot, right of it.
    const size_t n = std::max<size_t>(1, std::max(r.losses.size(), r.steps.size()));
    const size_t every = std::max<size_t>(1, (n + 9) / 10);
    std::ofstream f(script);
    f << "set terminal svg size 800,450 dynamic\n"
      << "set output '" << dir << "/loss.svg'\n"
      << "set title 'strata train: loss (" << r.device
      << ")'\nset xlabel 'step'\nset ylabel 'loss'\n"
      << "set xrange [" << (n > 1 ? "1" : "0.5") << ":" << (n > 1 ? std::to_string(n) : "1.5")
      << "]\nset xtics 1," << every << "\nset key outside right top vertical\n"
      << "plot '" << loss_dat << "' using 1:2 with linespoints title 'loss'\n"
      << "set output '" << dir << "/step_time.svg'\n"
      << "set title 'strata train: step time by phase'\nset xlabel 'step'\nset ylabel 'seconds'\n"
      << "set xrange [0.5:" << n << ".5]\nset yrange [0:*]\n"
      << "set style fill solid 0.8 noborder\nset boxwidth 0.8\n"
      << "plot '" << time_dat << "' using 1:($3+$4+$5+$6) with boxes title 'other', "
      << "'' using 1:($3+$4+$5) with boxes title 'waiting for the optimizer', "
      << "'' using 1:($3+$4) with boxes title 'fetch wait (PCIe/NVMe)', "
      << "'' using 1:3 with boxes title 'compute'\n";
  }
  const std::string cmd = "gnuplot '" + script + "' 2>&1";
  if (std::system(cmd.c_str()) != 0) return IOError("gnuplot " + script + " failed");
  files.push_back(dir + "/loss.svg");
  files.push_back(dir + "/step_time.svg");
  return files;
}

namespace {
// The command, its output written to `out` and `err`.
int RunTrain(const TrainCommandOptions& opt, std::ostream& out, std::ostream& err);
}  // namespace

// SIGPIPE ignored while the command runs: a closed stdout (`| head`) makes
// writes fail with EPIPE, which the command reports, instead of killing the
// process with the engine's swap files in place.
class IgnoreSigpipe {
 public:
  IgnoreSigpipe() {
    struct sigaction sa {};
    sa.sa_handler = SIG_IGN;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGPIPE, &sa, &old_);
  }
  ~IgnoreSigpipe() { sigaction(SIGPIPE, &old_, nullptr); }

 private:
  struct sigaction old_ {};
};

StatusOr<Config> LoadCommandConfig(const std::string& path, const std::string& nvme_path,
                                   const std::string& device, int* exit_code) {
  using namespace cli;  // the exit codes (apps/strata/exit_codes.h)
  *exit_code = kExitConfig;
  if (path.empty()) {
    *exit_code = kExitUsage;
    return InvalidArgumentError("--config is required");
  }
  STRATA_ASSIGN_OR_RETURN(Config config, LoadConfigFile(path));
  // strata.model is this program's section: the library keeps it as text.
  std::vector<std::string> model_warnings;
  StatusOr<ModelConfig> model = ModelConfigFromConfig(config, &model_warnings);
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
  STRATA_RETURN_IF_ERROR(ShapeFromConfig(config).status());
  return config;
}

int RunTrainCommand(const TrainCommandOptions& opt, std::ostream& out, std::ostream& err) {
  IgnoreSigpipe ignore_sigpipe;
  const int code = RunTrain(opt, out, err);
  if (out.flush(); !out.good()) {
    err << "strata train: stdout: write failed (closed: EPIPE or similar); the run "
        << (code == 0 ? "completed" : "ended with exit code " + std::to_string(code))
        << " but its output was not all written" << std::endl;
    return code == 0 ? cli::kExitIo : code;
  }
  return code;
}

namespace {

int RunTrain(const TrainCommandOptions& opt, std::ostream& out, std::ostream& err) {
  using namespace cli;  // the exit codes (apps/strata/exit_codes.h)
  // One line on stderr; with --json also one object on stdout (no steps).
  auto fail = [&](int code, const Status& s) {
    err << "strata train: " << OneLine(s.ToString()) << std::endl;
    if (opt.json) out << ResultJson(TrainResult(), s) << std::endl;
    return code;
  };
  int code = 0;
  StatusOr<Config> loaded = LoadCommandConfig(opt.config_path, opt.nvme_path, opt.device, &code);
  if (!loaded.ok()) return fail(code, loaded.status());
  Config config = *loaded;
  StatusOr<ModelConfig> model = ModelConfigFromConfig(config);
  if (!model.ok()) return fail(kExitConfig, model.status().WithContext(opt.config_path));
  int64_t steps = opt.steps > 0 ? opt.steps : model->steps > 0 ? model->steps : 40;
  if (opt.steps < 0)
    return fail(kExitUsage, InvalidArgumentError("--steps: " + std::to_string(opt.steps) +
                                                 " must be at least 1"));
  if (StatusOr<ModelShape> s = ShapeFromConfig(config); !s.ok())
    return fail(kExitConfig, s.status());
  if (Status s = PrepareNvmePaths(config); !s.ok()) return fail(ExitCodeOf(s), s);
  // --resume continues a directory that exists; a mistyped one is not
  // created and started afresh.
  if (opt.resume && !opt.checkpoint_dir.empty() && !std::filesystem::exists(opt.checkpoint_dir))
    return fail(kExitUsage, NotFoundError("--resume: --checkpoint-dir " + opt.checkpoint_dir +
                                          " does not exist (without --resume it is created)"));
  // Output directories are usable before the first step, not found unusable
  // after the last.
  if (!opt.checkpoint_dir.empty())
    if (Status s = PrepareOutputDir("--checkpoint-dir", opt.checkpoint_dir); !s.ok())
      return fail(ExitCodeOf(s), s);
  if (!opt.plot_dir.empty())
    if (Status s = PrepareOutputDir("--plot", opt.plot_dir); !s.ok()) return fail(ExitCodeOf(s), s);

  // Progress: stdout for people; stderr when stdout carries the JSON object.
  std::ostream& prog = opt.json ? err : out;
  ProgressFn progress = [&prog](int64_t s, int64_t n, double loss, const StepStats& st,
                                const TrainResult& r) {
    if (r.rank != 0) return;  // rank 0 speaks for the ranks
    char buf[320];
    std::snprintf(
        buf, sizeof(buf),
        "step %4lld/%lld  loss %.4f  lr %.3e  %7.0f tok/s  %.3f s  overlap %.2f  nvme r %s w %s  "
        "pcie h2d %s d2h %s%s",
        static_cast<long long>(s + 1), static_cast<long long>(n), loss, st.lr,
        st.step_time_s > 0 ? static_cast<double>(r.tokens_per_step) / st.step_time_s : 0.0,
        st.step_time_s, st.overlap_efficiency,
        Human(static_cast<double>(st.nvme_read_bytes)).c_str(),
        Human(static_cast<double>(st.nvme_written_bytes)).c_str(),
        Human(static_cast<double>(st.pcie_h2d_bytes)).c_str(),
        Human(static_cast<double>(st.pcie_d2h_bytes)).c_str(),
        st.overflow ? "  (overflow: skipped)" : "");
    prog << buf << std::endl;
  };
  if (opt.checkpoint_every < 0)
    return fail(kExitUsage,
                InvalidArgumentError("--checkpoint-every: " + std::to_string(opt.checkpoint_every) +
                                     " must be >= 0"));
  if (opt.checkpoint_dir.empty() && (opt.resume || opt.checkpoint_every > 0 || opt.overwrite))
    return fail(
        kExitUsage,
        InvalidArgumentError("--resume, --overwrite and --checkpoint-every need --checkpoint-dir"));
  if (opt.resume && opt.overwrite)
    return fail(
        kExitUsage,
        InvalidArgumentError("--resume and --overwrite exclude each other: --resume continues the "
                             "checkpoints in --checkpoint-dir, --overwrite removes them"));
  TrainCheckpoints ckpt;
  ckpt.dir = opt.checkpoint_dir;
  ckpt.every = opt.checkpoint_every;
  ckpt.resume = opt.resume;
  ckpt.overwrite = opt.overwrite;
  TrainResult result;
  Status status;
  int signal = 0;
  {
    StopSignals signals(opt.stop_grace_s);
    status = TrainInto(config, steps, &result, progress, signals.flag(), ckpt);
    signal = signals.signal();
  }
  // A run that ends with a NaN loss failed, whatever it printed on the way.
  if (status.ok() && signal == 0 && !result.losses.empty() &&
      !std::isfinite(result.losses.back())) {
    size_t from = result.losses.size();
    while (from > 0 && !std::isfinite(result.losses[from - 1])) --from;
    status = FailedPreconditionError(
        std::string("the loss is ") + (std::isnan(result.losses.back()) ? "NaN" : "infinite") +
        " from step " + std::to_string(from + 1) + " to the last, step " +
        std::to_string(result.losses.size()) +
        ": the run diverged (a lower learning rate, gradient_clipping, or fp32 may help)");
  }
  // The Engine is gone (its swap files removed): report.
  if (!status.ok() || signal != 0) {
    if (status.ok())
      status = CancelledError("interrupted by " + SignalName(signal) + " after the last step");
    err << "strata train: " << OneLine(status.ToString()) << std::endl;
    if (opt.json) out << ResultJson(result, status) << std::endl;
    if (signal != 0) return kExitSignalBase + signal;
    // --steps below the checkpoint's step (TrainInto) is the command line's.
    return status.code() == StatusCode::kOutOfRange ? kExitUsage : ExitCodeOf(status);
  }
  const TrainResult* r = &result;
  if (opt.json) {
    out << ResultJson(*r) << std::endl;
  } else {
    out << ResultTable(*r);
  }
  if (!opt.plot_dir.empty()) {
    std::string note;
    StatusOr<std::vector<std::string>> files = WritePlots(*r, opt.plot_dir, &note);
    if (!files.ok()) return fail(ExitCodeOf(files.status()), files.status());
    if (!note.empty()) err << "strata train: " << note << std::endl;
    if (!opt.json)
      for (const std::string& f : *files) out << "  plot              " << f << "\n";
  }
  return 0;
}

}  // namespace

}  // namespace strata::example
