// strata train: trains the example model (examples/train) through the engine
// with the placement from the config, and reports what happened. The loop
// and the reports are apps/strata/train/; `--nproc-per-node N` starts N
// ranks of this same command (launch_ranks.h).
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "apps/strata/launch_ranks.h"
#include "apps/strata/train/train.h"
#include "examples/train/model.h"
#include "src/common/private_fs.h"
#include "strata/config.h"

namespace strata::cli {
namespace {

struct TrainCommandOptions {
  std::string config_path;
  int64_t steps = 0;  // 0: strata.model.steps, else 40 (the CLI refuses --steps 0)
  bool json = false;
  std::string plot_dir;
  std::string nvme_path;  // overrides both offload sections' nvme_path when set
  std::string device;     // overrides strata.device when set: auto, cuda, host
  // After SIGINT/SIGTERM, how long the run may take to stop at the next
  // micro-batch before the process exits anyway (a wait that blocks).
  double stop_grace_s = 30;
  std::string checkpoint_dir;    // --checkpoint-dir
  int64_t checkpoint_every = 0;  // --checkpoint-every
  bool resume = false;           // --resume
  bool resume_or_start = false;  // --resume-or-start
  bool convert_states = false;   // --convert-optimizer-states
  bool overwrite = false;        // --overwrite
};

// SIGINT/SIGTERM/SIGHUP (a closed terminal) while `strata train` runs. The handler only stores the
// signal number (a lock-free atomic: async-signal-safe); the training loop
// polls it before every micro-batch. A second signal exits at once
// (write + _exit only), except in a rank of `--nproc-per-node`
// (STRATA_LAUNCHER_PID is its parent) within kSameSignalS of the first: a
// Ctrl-C reaches the whole process group, the launcher included, which
// forwards it, so every rank gets it twice. A watchdog thread exits the process when the loop has
// not returned within the grace period after the first signal, so a wait
// that blocks cannot hang the exit forever; swap files left that way are
// unlocked leftovers, removed by the next run on their directory.
std::atomic<int> g_stop_signal{0};
std::atomic<int64_t> g_stop_ns{0};  // CLOCK_MONOTONIC of the first signal
bool g_launched_rank = false;       // set before the handlers are installed
constexpr int64_t kSameSignalNs = 2'000'000'000;
static_assert(std::atomic<int>::is_always_lock_free);
static_assert(std::atomic<int64_t>::is_always_lock_free);

int64_t MonotonicNs() {  // clock_gettime is async-signal-safe
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

extern "C" void OnStopSignal(int sig) {
  int expected = 0;
  const int64_t now = MonotonicNs();
  if (g_stop_signal.compare_exchange_strong(expected, sig)) {
    g_stop_ns.store(now);
    return;
  }
  if (g_launched_rank && now - g_stop_ns.load() < kSameSignalNs) return;  // the forwarded copy
  static const char kMsg[] = "strata train: second signal: exiting now, without cleanup\n";
  ssize_t ignored = write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
  (void)ignored;
  _exit(128 + sig);
}

class StopSignals {
 public:
  explicit StopSignals(double grace_s) : grace_s_(grace_s) {
    g_stop_signal.store(0);
    g_stop_ns.store(0);
    const char* launcher = std::getenv("STRATA_LAUNCHER_PID");
    g_launched_rank = launcher != nullptr && std::to_string(getppid()) == launcher;
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

// The command, its output written to `out` and `err`.
int RunTrain(const TrainCommandOptions& opt, std::ostream& out, std::ostream& err) {
  // One line on stderr; with --json also one object on stdout (no steps).
  auto fail = [&](int code, const Status& s) {
    err << "strata train: " << OneLine(s.ToString()) << std::endl;
    if (opt.json) out << ResultJson(TrainResult(), s) << std::endl;
    return code;
  };
  // A path with a control character is refused: a newline in it would read
  // as two in any line-based record, and none names a directory on purpose.
  for (const auto& [option, path] :
       {std::pair{"--config", &opt.config_path}, std::pair{"--nvme-path", &opt.nvme_path},
        std::pair{"--plot", &opt.plot_dir}, std::pair{"--checkpoint-dir", &opt.checkpoint_dir}})
    if (HasControlChar(*path))
      return fail(kExitUsage,
                  InvalidArgumentError(std::string(option) +
                                       ": the path holds a control character (a newline, tab, "
                                       "escape, ...); give a path without one"));
  int code = 0;
  StatusOr<Config> loaded = LoadCommandConfig(opt.config_path, opt.nvme_path, opt.device, &code);
  if (!loaded.ok()) return fail(code, loaded.status());
  Config config = *loaded;
  StatusOr<example::ModelConfig> model = example::ModelConfigFromConfig(config);
  if (!model.ok()) return fail(kExitConfig, model.status().WithContext(opt.config_path));
  int64_t steps = opt.steps > 0 ? opt.steps : model->steps > 0 ? model->steps : 40;
  if (opt.steps < 0)
    return fail(kExitUsage, InvalidArgumentError("--steps: " + std::to_string(opt.steps) +
                                                 " must be at least 1"));
  if (StatusOr<example::ModelShape> s = example::ShapeFromConfig(config); !s.ok())
    return fail(kExitConfig, s.status());
  if (Status s = PrepareNvmePaths(config); !s.ok()) return fail(ExitCodeOf(s), s);
  // --resume continues a directory that exists; a mistyped one is not
  // created and started afresh.
  const bool resume = opt.resume || opt.resume_or_start;
  if (resume && !opt.checkpoint_dir.empty() && !std::filesystem::exists(opt.checkpoint_dir))
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
  if (opt.checkpoint_dir.empty() && (resume || opt.checkpoint_every > 0 || opt.overwrite))
    return fail(kExitUsage, InvalidArgumentError("--resume, --resume-or-start, --overwrite and "
                                                 "--checkpoint-every need --checkpoint-dir"));
  if (opt.convert_states && !resume)
    return fail(kExitUsage,
                InvalidArgumentError("--convert-optimizer-states converts the checkpoint a run "
                                     "resumes from: it needs --resume or --resume-or-start"));
  if (resume && opt.overwrite)
    return fail(
        kExitUsage,
        InvalidArgumentError("--resume and --overwrite exclude each other: --resume continues the "
                             "checkpoints in --checkpoint-dir, --overwrite removes them"));
  TrainCheckpoints ckpt;
  ckpt.dir = opt.checkpoint_dir;
  ckpt.every = opt.checkpoint_every;
  ckpt.resume = opt.resume || opt.resume_or_start;
  ckpt.resume_or_start = opt.resume_or_start;
  ckpt.overwrite = opt.overwrite;
  ckpt.convert_optimizer_states = opt.convert_states;
  TrainResult result;
  Status status;
  int signal = 0;
  {
    StopSignals signals(opt.stop_grace_s);
    status =
        TrainInto(config, steps, &result, progress, signals.flag(), ckpt, DeveloperHooksFromEnv());
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

// The whole command: returns the exit code (0 ok, 2 bad input, 1 failure,
// 129/130/143 after SIGHUP/SIGINT/SIGTERM). The checkpoint and plot
// directories are created and checked before the first step, and the
// checkpoint directory's free space (CheckCheckpointRoom). While it runs,
// SIGINT, SIGTERM and SIGHUP stop the run at the next micro-batch (the swap
// files are removed as the Engine closes); a second signal, or a run that
// has not stopped within stop_grace_s, exits at once with 128 + the signal
// (the swap files are then leftovers, removed by the next run on their
// directory). With --json, a failed run still prints one object: the steps
// completed and "error". SIGPIPE is ignored while it runs: a closed stdout
// does not end the run; it is reported on stderr at the end, with exit code
// 5 (I/O) after a run that completed.
int RunTrainCommand(const TrainCommandOptions& opt, std::ostream& out, std::ostream& err) {
  IgnoreSigpipe ignore_sigpipe;
  const int code = RunTrain(opt, out, err);
  if (out.flush(); !out.good()) {
    err << "strata train: stdout: write failed (closed: EPIPE or similar); the run "
        << (code == 0 ? "completed" : "ended with exit code " + std::to_string(code))
        << " but its output was not all written" << std::endl;
    return code == 0 ? kExitIo : code;
  }
  return code;
}

CommandRegistrar reg("", [](CLI::App& app, CliResult& r) {
  auto* cmd = app.add_subcommand(
      "train",
      "Train the example byte-level language model with its states placed as the config says");
  auto opt = std::make_shared<TrainCommandOptions>();
  cmd->add_option("--config", opt->config_path,
                  "DeepSpeed/Strata JSON config (strata.model sets the size)")
      ->required();
  cmd->add_option("--steps", opt->steps, "Optimizer steps (default: strata.model.steps, else 40)")
      ->transform(CountSuffix(/*min=*/1));
  cmd->add_option(
      "--nvme-path", opt->nvme_path,
      "Directory for NVMe-offloaded states; overrides the config's nvme_path (created if missing)");
  cmd->add_option("--device", opt->device, "Override strata.device: auto, cuda or host");
  cmd->add_option("--plot", opt->plot_dir,
                  "Write loss and step-time plots (SVG via gnuplot) into this directory");
  cmd->add_option("--checkpoint-dir", opt->checkpoint_dir,
                  "Save checkpoints into this directory (after the last step, and every "
                  "--checkpoint-every steps)");
  cmd->add_option("--checkpoint-every", opt->checkpoint_every,
                  "Save a checkpoint every N optimizer steps");
  cmd->add_flag(
      "--resume", opt->resume,
      "Resume from the newest checkpoint in --checkpoint-dir (if any); --steps is the total");
  cmd->add_flag("--resume-or-start", opt->resume_or_start,
                "As --resume, but start from step 0 (with a warning) when --checkpoint-dir holds "
                "checkpoint data without a valid manifest, where --resume stops with an error");
  cmd->add_flag("--convert-optimizer-states", opt->convert_states,
                "With --resume: load a checkpoint saved with another strata.optimizer_states in "
                "this config's format (not between int8 and the others)");
  cmd->add_flag("--overwrite", opt->overwrite,
                "Without --resume: remove the checkpoints (of another run) already in "
                "--checkpoint-dir instead of refusing to start");
  cmd->add_flag("--json", opt->json, "Print one JSON object with the summary instead of the table");
  auto nproc = std::make_shared<int>(0);
  auto launch = std::make_shared<LaunchOptions>();
  cmd->add_option("--nproc-per-node", *nproc,
                  "Start this many local ranks (data parallelism, as torchrun does: RANK, "
                  "WORLD_SIZE, MASTER_ADDR, MASTER_PORT set for each); rank 0 prints")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--nnodes", launch->nnodes,
                  "Machines taking part (torchrun's --nnodes; default 1). Each runs this command "
                  "with its own --node-rank; the ranks meet at --master-addr:--master-port (a TCP "
                  "store node 0 serves), or through STRATA_GLOO_DIR when set")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--node-rank", launch->node_rank, "This machine's index, 0..nnodes-1 (default 0)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--master-addr", launch->master_addr,
                  "MASTER_ADDR for the ranks: node 0's address (default 127.0.0.1)");
  cmd->add_option("--master-port", launch->master_port,
                  "MASTER_PORT for the ranks (default: a free port on one machine, 29500 on "
                  "several)")
      ->check(CLI::Range(1, 65535));
  cmd->callback([&r, opt, nproc, launch] {
    if (launch->node_rank >= launch->nnodes) {
      std::cerr << "strata train: --node-rank " << launch->node_rank << " must be in 0.."
                << launch->nnodes - 1 << " (--nnodes " << launch->nnodes << ")\n";
      r.exit_code = kExitUsage;
      return;
    }
    if (*nproc <= 0 && launch->nnodes > 1) *nproc = 1;  // (torchrun's default)
    if (*nproc <= 0) {
      r.exit_code = RunTrainCommand(*opt, std::cout, std::cerr);
      r.stdout_reported = true;
      return;
    }
    // The same command line, run by every rank.
    std::vector<std::string> args = {"train", "--config", opt->config_path};
    auto add = [&](const char* flag, const std::string& v) {
      if (!v.empty()) args.insert(args.end(), {flag, v});
    };
    if (opt->steps > 0) add("--steps", std::to_string(opt->steps));
    add("--nvme-path", opt->nvme_path);
    add("--device", opt->device);
    add("--plot", opt->plot_dir);
    add("--checkpoint-dir", opt->checkpoint_dir);
    if (opt->checkpoint_every > 0) add("--checkpoint-every", std::to_string(opt->checkpoint_every));
    if (opt->resume) args.push_back("--resume");
    if (opt->resume_or_start) args.push_back("--resume-or-start");
    if (opt->overwrite) args.push_back("--overwrite");
    if (opt->convert_states) args.push_back("--convert-optimizer-states");
    if (opt->json) args.push_back("--json");
    // One GPU per local rank: refused here rather than by rank k failing to
    // open device k while the others wait for it.
    std::string device = opt->device;
    if (device.empty()) {
      StatusOr<Config> config = LoadConfigFile(opt->config_path);
      device = config.ok() ? std::string(DeviceKindName(config->strata.device)) : "host";
    }
    if (Status s = CheckGpusForLocalRanks(*nproc, device, "--nproc-per-node"); !s.ok()) {
      std::cerr << "strata train: " << s.ToString() << "\n";
      r.exit_code = kExitUsage;
      return;
    }
    launch->nproc = *nproc;
    r.exit_code = LaunchLocalRanks("train", *launch, args);
  });
});

}  // namespace
}  // namespace strata::cli
