// `strata train --checkpoint-dir D --checkpoint-every 1 --resume` killed with
// SIGKILL at random points, then resumed to the end, gives bitwise the losses
// and final states of an uninterrupted run; a kill at each point of a save
// (STRATA_CHECKPOINT_CRASH_AT) leaves the previous checkpoint loadable.
#include <fcntl.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "src/common/crc32c.h"
#include "tests/test_util.h"
#include "tests/train/cli_process.h"

extern char** environ;

namespace strata {
namespace {

using cli_testing::ReadFile;
namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int kSteps = 8;

std::string WriteConfig(const std::string& dir, const std::string& opt, const std::string& par) {
  const std::string path = dir + "/c.json";
  std::ofstream(path) << R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "bf16": {"enabled": true}, "optimizer": {"params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": ")"
                      << opt << R"(", "nvme_path": ")" << dir << R"(/nvme"},
      "offload_param": {"device": ")"
                      << par << R"(", "nvme_path": ")" << dir << R"(/nvme", "buffer_count": 8},
      "sub_group_size": 20000, "stage3_max_live_parameters": 30000,
      "stage3_param_persistence_threshold": 1000, "reduce_bucket_size": 1e6},
    "strata": {"device": "host", "hbm_budget": "4M", "threads": 2,
      "model": {"layers": 2, "hidden": 32, "seq_len": 16}}})";
  return path;
}

// Starts `strata <args>` with stdout/stderr into files under dir; returns its pid.
pid_t Spawn(const std::vector<std::string>& args, const std::string& dir,
            const std::string& crash_at = "") {
  std::vector<std::string> argv_s = {STRATA_CLI_PATH};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s;
  for (char** e = environ; *e != nullptr; ++e)
    if (std::string(*e).rfind("STRATA_CHECKPOINT_CRASH_AT=", 0) != 0) env_s.push_back(*e);
  if (!crash_at.empty()) env_s.push_back("STRATA_CHECKPOINT_CRASH_AT=" + crash_at);
  std::vector<char*> envp;
  for (std::string& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, (dir + "/stdout").c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&fa, 2, (dir + "/stderr").c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  EXPECT_EQ(rc, 0);
  return pid;
}

struct Exit {
  bool killed = false;
  int code = -1;
};

Exit Wait(pid_t pid) {
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  Exit e;
  e.killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  e.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return e;
}

// Creates ckpt: --resume refuses a directory that does not exist. A restart
// loop: --resume-or-start, since a kill during the first save leaves data
// without a manifest, which --resume refuses.
std::vector<std::string> TrainArgs(const std::string& cfg, const std::string& ckpt, bool every) {
  fs::create_directories(ckpt);
  std::vector<std::string> a = {
      "train",  "--config",         cfg,  "--steps",          std::to_string(kSteps),
      "--json", "--checkpoint-dir", ckpt, "--resume-or-start"};
  if (every) a.insert(a.end(), {"--checkpoint-every", "1"});
  return a;
}

// The newest directory with a manifest under root ("" if none), and its
// manifest.
std::string Latest(const std::string& root) {
  std::string best;
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(root, ec)) {
    const std::string name = d.path().filename().string();
    if (name.rfind("ckpt-", 0) == 0 && fs::exists(d.path() / "MANIFEST.json") &&
        (best.empty() || name > fs::path(best).filename().string()))
      best = d.path().string();
  }
  return best;
}

struct Final {
  std::vector<double> losses;
  json files;  // the last checkpoint's data files: names, sizes, CRC-32C
};

// Runs to the end (resuming) and returns the losses and the final checkpoint.
Final RunToEnd(const std::string& cfg, const std::string& ckpt, const std::string& dir,
               bool every) {
  Final f;
  const Exit e = Wait(Spawn(TrainArgs(cfg, ckpt, every), dir));
  EXPECT_EQ(e.code, 0) << ReadFile(dir + "/stderr");
  if (e.code != 0) return f;
  const json j = json::parse(ReadFile(dir + "/stdout"));
  f.losses = j["losses"].get<std::vector<double>>();
  const std::string last = Latest(ckpt);
  EXPECT_FALSE(last.empty());
  if (last.empty()) return f;
  const json m = json::parse(ReadFile(last + "/MANIFEST.json"));
  EXPECT_EQ(m["optimizer_step"], kSteps);
  f.files = m["files"];
  return f;
}

bool BitwiseEqual(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

class CrashTest : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

TEST_P(CrashTest, KilledAtRandomPointsThenResumedIsBitwiseUninterrupted) {
  testing::ScratchDir dir;
  const auto [opt, par] = GetParam();
  const std::string cfg = WriteConfig(dir.str(), opt, par);
  // The uninterrupted run, timed: kills land anywhere inside such a run.
  const auto t0 = std::chrono::steady_clock::now();
  const Final want = RunToEnd(cfg, dir.str() + "/ref", dir.str(), /*every=*/false);
  const double run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(want.files.size(), 2u);

  uint64_t seed = 0;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  int kills = 0;
  for (int trial = 0; trial < 4; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const std::string ckpt = dir.str() + "/ckpt" + std::to_string(trial);
    // One to three kills at random times, each run resuming where the last
    // checkpoint left it.
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < n; ++k) {
      const pid_t pid = Spawn(TrainArgs(cfg, ckpt, true), dir.str());
      std::uniform_real_distribution<double> at(0.0, run_s * 1.2);
      std::this_thread::sleep_for(std::chrono::duration<double>(at(rng)));
      ::kill(pid, SIGKILL);
      const Exit e = Wait(pid);
      kills += e.killed;
      if (!e.killed) {  // it had finished
        EXPECT_EQ(e.code, 0) << ReadFile(dir.str() + "/stderr");
      }
    }
    const Final got = RunToEnd(cfg, ckpt, dir.str(), true);
    EXPECT_TRUE(BitwiseEqual(want.losses, got.losses));
    EXPECT_EQ(want.files, got.files);  // parameters and states: same sizes and CRC-32C
    // At most two checkpoints are left.
    int left = 0;
    for (const auto& d : fs::directory_iterator(ckpt)) left += d.is_directory();
    EXPECT_LE(left, 2);
  }
  EXPECT_GT(kills, 0);  // the test did kill something
}

INSTANTIATE_TEST_SUITE_P(Placements, CrashTest,
                         ::testing::Values(std::pair{"nvme", "nvme"}, std::pair{"cpu", "cpu"}),
                         [](const auto& info) {
                           return std::string(info.param.first) + "_" + info.param.second;
                         });

TEST(CheckpointCli, KilledDuringASaveLeavesThePreviousCheckpoint) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "nvme", "nvme");
  const Final want = RunToEnd(cfg, dir.str() + "/ref", dir.str(), false);
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
  // The save after step 1 dies at each point; with the manifest not yet in
  // place there is no checkpoint, after the rename there is one.
  for (const char* point : {"data", "manifest_tmp", "rename", "cleanup"}) {
    SCOPED_TRACE(point);
    const std::string ckpt = dir.str() + "/" + point;
    std::vector<std::string> args = TrainArgs(cfg, ckpt, true);
    args[4] = "3";  // --steps 3: checkpoints 1..3
    ASSERT_EQ(Wait(Spawn(args, dir.str())).code, 0) << ReadFile(dir.str() + "/stderr");
    const Exit e = Wait(Spawn(TrainArgs(cfg, ckpt, true), dir.str(), point));
    EXPECT_TRUE(e.killed);
    const bool committed = std::string(point) == "rename" || std::string(point) == "cleanup";
    const std::string latest = Latest(ckpt);
    ASSERT_FALSE(latest.empty());
    const json m = json::parse(ReadFile(latest + "/MANIFEST.json"));
    EXPECT_EQ(m["optimizer_step"], committed ? 4 : 3);
    EXPECT_EQ(fs::exists(ckpt + "/ckpt-00000004"), true);  // the save had begun
    if (!committed) {
      EXPECT_FALSE(fs::exists(ckpt + "/ckpt-00000004/MANIFEST.json"));
    }
    const Final got = RunToEnd(cfg, ckpt, dir.str(), true);
    EXPECT_TRUE(BitwiseEqual(want.losses, got.losses));
    EXPECT_EQ(want.files, got.files);
  }
}

TEST(CheckpointCli, BadCheckpointOptionsAreOneLineErrors) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "cpu", "cpu");
  EXPECT_EQ(Wait(Spawn({"train", "--config", cfg, "--resume"}, dir.str())).code, 2);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("--checkpoint-every need --checkpoint-dir"));
  EXPECT_EQ(Wait(Spawn({"train", "--config", cfg, "--checkpoint-dir", dir.str() + "/c",
                        "--checkpoint-every", "-1"},
                       dir.str()))
                .code,
            2);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"), ::testing::HasSubstr("--checkpoint-every: -1"));
  // A checkpoint of another config is refused, naming the difference.
  ASSERT_EQ(
      Wait(Spawn({"train", "--config", cfg, "--steps", "1", "--checkpoint-dir", dir.str() + "/c"},
                 dir.str()))
          .code,
      0);
  std::string text = ReadFile(cfg);
  text.replace(text.find("3e-3"), 4, "4e-3");
  std::ofstream(cfg) << text;
  EXPECT_EQ(Wait(Spawn({"train", "--config", cfg, "--steps", "2", "--checkpoint-dir",
                        dir.str() + "/c", "--resume"},
                       dir.str()))
                .code,
            1);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("optimizer.params.lr: 0.003 in the checkpoint, 0.004 now"));
  // The example model's section is compared too, every key at its effective
  // value (the seed, absent from the file, is 1234).
  text.replace(text.find("4e-3"), 4, "3e-3");
  text.replace(text.find(R"("seq_len": 16)"), 13, R"("seq_len": 8, "seed": 99)");
  std::ofstream(cfg) << text;
  EXPECT_EQ(Wait(Spawn({"train", "--config", cfg, "--steps", "2", "--checkpoint-dir",
                        dir.str() + "/c", "--resume"},
                       dir.str()))
                .code,
            1);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("strata.model.seed: 1234 in the checkpoint, 99 now (also: "
                                   "strata.model.seq_len)"));
}

// A checkpoint saved with another strata.optimizer_states resumes only with
// --convert-optimizer-states (which needs --resume).
TEST(CheckpointCli, AnotherStateFormatResumesOnlyWhenAsked) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "cpu", "cpu");
  const std::string fp32 = ReadFile(cfg);
  std::string bf16 = fp32;
  bf16.replace(bf16.find(R"("threads": 2,)"), 13, R"("threads": 2, "optimizer_states": "bf16",)");
  std::ofstream(cfg) << bf16;
  const std::string ckpt = dir.str() + "/c";
  ASSERT_EQ(
      Wait(Spawn({"train", "--config", cfg, "--steps", "1", "--checkpoint-dir", ckpt}, dir.str()))
          .code,
      0);
  std::ofstream(cfg) << fp32;
  EXPECT_EQ(Wait(Spawn({"train", "--config", cfg, "--steps", "2", "--checkpoint-dir", ckpt,
                        "--convert-optimizer-states"},
                       dir.str()))
                .code,
            2);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"), ::testing::HasSubstr("needs --resume"));
  EXPECT_EQ(
      Wait(Spawn({"train", "--config", cfg, "--steps", "2", "--checkpoint-dir", ckpt, "--resume"},
                 dir.str()))
          .code,
      1);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("strata.optimizer_states: bf16 in the checkpoint, fp32 now"));
  EXPECT_EQ(Wait(Spawn({"train", "--config", cfg, "--steps", "2", "--checkpoint-dir", ckpt,
                        "--resume", "--convert-optimizer-states", "--json"},
                       dir.str()))
                .code,
            0)
      << ReadFile(dir.str() + "/stderr");
  const json out = json::parse(ReadFile(dir.str() + "/stdout"), nullptr, false);
  ASSERT_FALSE(out.is_discarded());
  EXPECT_EQ(out["losses"].size(), 2u);  // step 1 from the checkpoint's note, step 2 trained
}

// A checkpoint directory belongs to one run: a fresh run refuses another's
// checkpoints (they stay) unless --overwrite; --resume keeps the run id; a
// directory locked by a live process is refused, naming it.
TEST(CheckpointCli, ADirectoryBelongsToOneRun) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "cpu", "cpu");
  const std::string ckpt = dir.str() + "/c";
  auto run = [&](std::vector<std::string> extra, const char* steps = "2") {
    std::vector<std::string> a = {
        "train", "--config",           cfg, "--steps", steps, "--json", "--checkpoint-dir",
        ckpt,    "--checkpoint-every", "1"};
    a.insert(a.end(), extra.begin(), extra.end());
    return Wait(Spawn(a, dir.str())).code;
  };
  auto run_id = [&] {
    return json::parse(ReadFile(dir.str() + "/stdout"))["checkpoint"]["run_id"];
  };
  ASSERT_EQ(run({}), 0) << ReadFile(dir.str() + "/stderr");
  const std::string first = run_id();
  EXPECT_EQ(run({}), 1);
  EXPECT_THAT(
      ReadFile(dir.str() + "/stderr"),
      ::testing::HasSubstr("--checkpoint-dir " + ckpt + " holds 2 checkpoints of run " + first +
                           " up to step 2: use --resume, another --checkpoint-dir, or "
                           "--overwrite"));
  EXPECT_TRUE(fs::exists(ckpt + "/ckpt-00000001/MANIFEST.json"));
  EXPECT_TRUE(fs::exists(ckpt + "/ckpt-00000002/MANIFEST.json"));
  ASSERT_EQ(run({"--resume"}, "3"), 0) << ReadFile(dir.str() + "/stderr");
  EXPECT_EQ(run_id(), first);
  ASSERT_EQ(run({"--overwrite"}), 0) << ReadFile(dir.str() + "/stderr");
  EXPECT_NE(run_id(), first);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("--overwrite: removed 2 checkpoints of run " + first));
  EXPECT_FALSE(fs::exists(ckpt + "/ckpt-00000003"));
  // A live holder of the lock: refused before training, naming it.
  const int fd = ::open((ckpt + "/LOCK").c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  const std::string holder = "pid 4242 run feedfacecafebeef\n";
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  ASSERT_EQ(::pwrite(fd, holder.data(), holder.size(), 0), static_cast<ssize_t>(holder.size()));
  EXPECT_EQ(run({"--resume"}, "9"), 5);  // I/O error: the directory is locked
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("is in use by another run (pid 4242 run feedfacecafebeef"));
  ::close(fd);
  EXPECT_EQ(run({"--resume", "--overwrite"}), 2);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"), ::testing::HasSubstr("exclude each other"));
}

// `strata checkpoint info --json` and `export` on what `strata train` saved;
// a corrupt states.bin is reported (exit 5, naming it) and not exported.
TEST(CheckpointCli, InfoAndExportReadACheckpointWithoutAnEngine) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "cpu", "cpu");
  const std::string ckpt = dir.str() + "/c";
  ASSERT_EQ(Wait(Spawn({"train", "--config", cfg, "--steps", "2", "--json", "--checkpoint-dir",
                        ckpt, "--checkpoint-every", "1"},
                       dir.str()))
                .code,
            0)
      << ReadFile(dir.str() + "/stderr");
  const std::string run_id = json::parse(ReadFile(dir.str() + "/stdout"))["checkpoint"]["run_id"];
  ASSERT_EQ(Wait(Spawn({"checkpoint", "info", ckpt, "--json"}, dir.str())).code, 0)
      << ReadFile(dir.str() + "/stderr");
  const json info = json::parse(ReadFile(dir.str() + "/stdout"));
  EXPECT_EQ(info["path"], ckpt + "/ckpt-00000002");
  EXPECT_EQ(info["valid"], true);
  EXPECT_EQ(info["optimizer_step"], 2);
  EXPECT_EQ(info["run_id"], run_id);
  EXPECT_EQ(info["format_version"], 4);  // a list of states files (one per saving rank)
  EXPECT_EQ(info["model_dtype"], "bf16");
  EXPECT_EQ(info["optimizer"]["lr"], 3e-3);
  EXPECT_GT(info["parameters"].get<int>(), 0);
  // What a resume compares: the keys left out, each with its reason.
  bool placement_free = false;
  for (const json& k : info["resume_compares"]["not_compared"]) {
    EXPECT_FALSE(k["reason"].get<std::string>().empty()) << k;
    placement_free |= k["key"] == "zero_optimization.offload_optimizer";
  }
  EXPECT_TRUE(placement_free) << info["resume_compares"];
  EXPECT_GT(info["elements"].get<int64_t>(), 0);
  ASSERT_EQ(info["files"].size(), 2u);
  for (const json& f : info["files"]) EXPECT_EQ(f["ok"], true) << f.dump();

  const std::string out = dir.str() + "/model.safetensors";
  ASSERT_EQ(Wait(Spawn({"checkpoint", "export", ckpt, "--out", out, "--json"}, dir.str())).code, 0)
      << ReadFile(dir.str() + "/stderr");
  const json exported = json::parse(ReadFile(dir.str() + "/stdout"));
  EXPECT_EQ(exported["tensors"], info["parameters"]);
  EXPECT_EQ(exported["bytes"].get<int64_t>(), static_cast<int64_t>(fs::file_size(out)));
  EXPECT_EQ(
      Wait(Spawn({"checkpoint", "export", ckpt, "--out", out, "--dtype", "fp8"}, dir.str())).code,
      2);

  // One byte of the newest checkpoint's states flipped: the root falls back
  // to the older one; the directory itself is invalid.
  const std::string states = ckpt + "/ckpt-00000002/states.bin";
  {
    std::fstream f(states, std::ios::in | std::ios::out | std::ios::binary);
    char c = 0;
    f.seekg(64);
    f.read(&c, 1);
    c = static_cast<char>(c ^ 1);
    f.seekp(64);
    f.write(&c, 1);
  }
  ASSERT_EQ(Wait(Spawn({"checkpoint", "info", ckpt, "--json"}, dir.str())).code, 0);
  const json older = json::parse(ReadFile(dir.str() + "/stdout"));
  EXPECT_EQ(older["path"], ckpt + "/ckpt-00000001");
  ASSERT_EQ(older["skipped"].size(), 1u);
  EXPECT_THAT(older["skipped"][0].get<std::string>(), ::testing::HasSubstr(states));
  EXPECT_EQ(Wait(Spawn({"checkpoint", "info", ckpt + "/ckpt-00000002", "--json"}, dir.str())).code,
            5);
  const json bad = json::parse(ReadFile(dir.str() + "/stdout"));
  EXPECT_EQ(bad["valid"], false);
  EXPECT_THAT(bad["error"].get<std::string>(), ::testing::HasSubstr(states));
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"), ::testing::HasSubstr(states));
  fs::remove(out);
  EXPECT_EQ(
      Wait(Spawn({"checkpoint", "export", ckpt + "/ckpt-00000002", "--out", out}, dir.str())).code,
      5);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"), ::testing::HasSubstr(states));
  EXPECT_FALSE(fs::exists(out));
}

mode_t ModeOf(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

std::vector<std::string> TwoSteps(const std::string& cfg, const std::string& ckpt) {
  return {"train", "--config", cfg, "--steps", "2", "--json", "--checkpoint-dir", ckpt};
}

// A symlink planted where strata train writes (the checkpoint directory's
// LOCK, a --plot file) is refused, naming it, and what it points to is left
// as it was.
TEST(CheckpointCli, PlantedSymlinksAreNeverFollowed) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "cpu", "cpu");
  const std::string victim = dir.str() + "/victim", ckpt = dir.str() + "/c";
  std::ofstream(victim) << "precious";
  fs::create_directories(ckpt);
  ASSERT_EQ(::symlink(victim.c_str(), (ckpt + "/LOCK").c_str()), 0);
  // (An I/O error: docs/cli.md's exit code 5.)
  EXPECT_EQ(Wait(Spawn(TwoSteps(cfg, ckpt), dir.str())).code, 5);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr(ckpt + "/LOCK: a symbolic link, not a regular file"));
  EXPECT_EQ(ReadFile(victim), "precious");
  const std::string plot = dir.str() + "/plot";
  fs::create_directories(plot);
  ASSERT_EQ(::symlink(victim.c_str(), (plot + "/loss.dat").c_str()), 0);
  EXPECT_NE(Wait(Spawn({"train", "--config", cfg, "--steps", "1", "--plot", plot}, dir.str())).code,
            0);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr(plot + "/loss.dat: a symbolic link is there"));
  EXPECT_EQ(ReadFile(victim), "precious");
}

// Checkpoints, the lock file and plots are readable by their user only
// (0600 files, 0700 directories created), whatever the umask lets through.
TEST(CheckpointCli, CheckpointsAndPlotsAreTheOwnersOnly) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "cpu", "cpu");
  const std::string ckpt = dir.str() + "/new/c", plot = dir.str() + "/plot";
  const mode_t old = ::umask(0);
  std::vector<std::string> a = TwoSteps(cfg, ckpt);
  a.insert(a.end(), {"--plot", plot});
  const Exit e = Wait(Spawn(a, dir.str()));
  ::umask(old);
  ASSERT_EQ(e.code, 0) << ReadFile(dir.str() + "/stderr");
  EXPECT_EQ(ModeOf(dir.str() + "/new"), 0700u);
  EXPECT_EQ(ModeOf(ckpt), 0700u);
  EXPECT_EQ(ModeOf(ckpt + "/LOCK"), 0600u);
  const std::string last = Latest(ckpt);
  ASSERT_FALSE(last.empty());
  EXPECT_EQ(ModeOf(last), 0700u);
  for (const auto& f : fs::directory_iterator(last)) EXPECT_EQ(ModeOf(f.path()), 0600u) << f.path();
  for (const auto& f : fs::directory_iterator(plot)) EXPECT_EQ(ModeOf(f.path()), 0600u) << f.path();
}

// A control character in a path option is a usage error naming the option;
// nothing is written (a newline once split the path in a rank exchange).
TEST(CheckpointCli, AControlCharacterInAPathIsAUsageError) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "cpu", "cpu");
  fs::create_directories(dir.str() + "/d");
  EXPECT_EQ(Wait(Spawn(TwoSteps(cfg, dir.str() + "/d\nx"), dir.str())).code, 2);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("--checkpoint-dir: the path holds a control character"));
  EXPECT_TRUE(fs::is_empty(dir.str() + "/d"));
  EXPECT_FALSE(fs::exists(dir.str() + "/d\nx"));
  // The same for `strata checkpoint info` and `export` (DIR and --out).
  EXPECT_EQ(Wait(Spawn({"checkpoint", "info", dir.str() + "/d\tx"}, dir.str())).code, 2);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("checkpoint info: DIR: the path holds a control character"));
  EXPECT_EQ(Wait(Spawn({"checkpoint", "export", dir.str() + "/d", "--out", dir.str() + "/o\x1b"},
                       dir.str()))
                .code,
            2);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("checkpoint export: --out: the path holds a control character"));
  EXPECT_TRUE(fs::is_empty(dir.str() + "/d"));
}

// --resume in a directory with checkpoint data but no manifest stops (exit
// 5) rather than start over; --resume-or-start starts from step 0.
TEST(CheckpointCli, ResumeFindingDataWithoutAManifestStops) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "cpu", "cpu");
  const std::string ckpt = dir.str() + "/c";
  ASSERT_EQ(Wait(Spawn(TwoSteps(cfg, ckpt), dir.str())).code, 0);
  const std::string last = Latest(ckpt);
  ASSERT_FALSE(last.empty());
  ASSERT_TRUE(fs::remove(last + "/MANIFEST.json"));
  std::vector<std::string> a = TwoSteps(cfg, ckpt);
  a[4] = "3";
  a.push_back("--resume");
  EXPECT_EQ(Wait(Spawn(a, dir.str())).code, 5);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("holds checkpoint data (" + last));
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"), ::testing::HasSubstr("--resume-or-start"));
  EXPECT_TRUE(fs::exists(last + "/params.bin"));
  a.back() = "--resume-or-start";
  ASSERT_EQ(Wait(Spawn(a, dir.str())).code, 0) << ReadFile(dir.str() + "/stderr");
  EXPECT_TRUE(json::parse(ReadFile(dir.str() + "/stdout"))["resumed_from_step"].is_null());
}

// --overwrite removes the files Strata wrote; another file stays, with its
// directory, and the warning names it.
TEST(CheckpointCli, OverwriteRemovesOnlyWhatStrataWrote) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "cpu", "cpu");
  const std::string ckpt = dir.str() + "/c";
  ASSERT_EQ(Wait(Spawn(TwoSteps(cfg, ckpt), dir.str())).code, 0);
  const std::string last = Latest(ckpt);
  ASSERT_FALSE(last.empty());
  std::ofstream(last + "/notes.txt") << "mine";
  std::vector<std::string> a = TwoSteps(cfg, ckpt);
  a.push_back("--overwrite");
  ASSERT_EQ(Wait(Spawn(a, dir.str())).code, 0) << ReadFile(dir.str() + "/stderr");
  EXPECT_EQ(ReadFile(last + "/notes.txt"), "mine");
  EXPECT_FALSE(fs::exists(last + "/params.bin"));
  EXPECT_FALSE(fs::exists(last + "/MANIFEST.json"));
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"), ::testing::HasSubstr("left notes.txt"));
}

// A manifest whose optimizer_step was changed and its checksum recomputed
// (the CRC-32C guards against accidents, not against an adversary) is still
// refused: strata train's data position is its optimizer step count.
TEST(CheckpointCli, AnOptimizerStepThatDoesNotMatchTheDataPositionIsRefused) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "cpu", "cpu");
  const std::string ckpt = dir.str() + "/c";
  ASSERT_EQ(Wait(Spawn(TwoSteps(cfg, ckpt), dir.str())).code, 0);
  const std::string manifest = Latest(ckpt) + "/MANIFEST.json";
  nlohmann::ordered_json m = nlohmann::ordered_json::parse(ReadFile(manifest));
  m["optimizer_step"] = 7;
  m.erase("manifest_crc32c");
  const std::string compact = m.dump();
  char crc[9];
  std::snprintf(crc, sizeof(crc), "%08x", Crc32c(compact.data(), compact.size()));
  m["manifest_crc32c"] = crc;
  std::ofstream(manifest, std::ios::trunc) << m.dump(1) << "\n";
  std::vector<std::string> a = TwoSteps(cfg, ckpt);
  a[4] = "4";
  a.push_back("--resume");
  EXPECT_EQ(Wait(Spawn(a, dir.str())).code, 5);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              ::testing::HasSubstr("optimizer_step 7 does not match data_position 2"));
}

// A forged manifest (its CRC-32C recomputed, as anyone who can write the
// directory can): info, export and train --resume each end with one line
// naming it and exit 5, and the resume removes its swap file.
TEST(CheckpointCli, ForgedManifestsAreOneLineErrorsWithExitFive) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "nvme", "cpu");
  const std::string ckpt = dir.str() + "/c";
  ASSERT_EQ(
      Wait(Spawn({"train", "--config", cfg, "--steps", "1", "--checkpoint-dir", ckpt}, dir.str()))
          .code,
      0)
      << ReadFile(dir.str() + "/stderr");
  const std::string manifest = ckpt + "/ckpt-00000001/MANIFEST.json";
  const std::string saved = ReadFile(manifest);
  auto forge = [&](const std::function<void(nlohmann::ordered_json&)>& edit) {
    nlohmann::ordered_json m = nlohmann::ordered_json::parse(saved);
    edit(m);
    m.erase("manifest_crc32c");
    const std::string content = m.dump();
    m["manifest_crc32c"] = fmt::format("{:08x}", Crc32c(content.data(), content.size()));
    std::ofstream(manifest, std::ios::trunc) << m.dump();
  };
  auto expect_refused = [&](const std::string& what) {
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"checkpoint", "info", ckpt + "/ckpt-00000001"},
          std::vector<std::string>{"checkpoint", "export", ckpt + "/ckpt-00000001", "--out",
                                   dir.str() + "/out.safetensors"},
          std::vector<std::string>{"train", "--config", cfg, "--steps", "2", "--checkpoint-dir",
                                   ckpt, "--resume"}}) {
      SCOPED_TRACE(args[0] + " " + args[1]);
      EXPECT_EQ(Wait(Spawn(args, dir.str())).code, 5);
      const std::string err = ReadFile(dir.str() + "/stderr");
      EXPECT_THAT(err, ::testing::HasSubstr(what));
      EXPECT_THAT(err, ::testing::HasSubstr(manifest));
      EXPECT_THAT(err, ::testing::Not(::testing::HasSubstr("internal error")));
      EXPECT_FALSE(fs::exists(dir.str() + "/out.safetensors"));
      for (const auto& e : fs::directory_iterator(dir.str() + "/nvme"))
        ADD_FAILURE() << "left behind: " << e.path();
    }
  };
  // 100,000 levels of nesting.
  {
    const size_t at = saved.find("\"note\"");
    ASSERT_NE(at, std::string::npos);
    std::ofstream(manifest, std::ios::trunc)
        << saved.substr(0, at) << "\"deep\": " << std::string(100000, '[')
        << std::string(100000, ']') << ", " << saved.substr(at);
  }
  expect_refused("nested deeper than");
  // A CRC-32C that is not hex.
  forge([](nlohmann::ordered_json& m) { m["files"][0]["crc32c"] = "not-hex!"; });
  expect_refused("crc32c is not 8 hex digits");
  // A file outside the directory.
  forge([](nlohmann::ordered_json& m) { m["files"][0]["name"] = "../../../../etc/shadow"; });
  expect_refused("the name is not one this format writes");
}

}  // namespace
}  // namespace strata
