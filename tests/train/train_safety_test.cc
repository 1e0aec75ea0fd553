// `strata train` guards: output directories checked before the first step,
// the checkpoint directory's free space, SIGHUP ending the run like SIGTERM,
// and a closed stdout that does not kill the run.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "apps/strata/train/train.h"
#include "tests/test_util.h"
#include "tests/train/cli_process.h"

namespace strata {
namespace {

using cli_testing::ReadFile;
using cli_testing::SwapFilesIn;
using cli_testing::WaitFor;
using ::testing::HasSubstr;

std::string WriteConfig(const std::string& dir) {
  const std::string path = dir + "/c.json";
  std::ofstream(path) << R"({"train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")"
                      << dir << R"(/nvme"},
      "offload_param": {"device": "nvme", "nvme_path": ")"
                      << dir << R"(/nvme"}},
    "strata": {"device": "host", "hbm_budget": "4M", "threads": 2,
      "model": {"layers": 2, "hidden": 32, "seq_len": 16}}})";
  return path;
}

// Runs `strata <args>` through sh with stdout/stderr into dir; with
// `pipe_to`, stdout goes into that pipeline instead and the exit code into
// dir/rc. Returns the shell's pid.
pid_t Spawn(const std::string& args, const std::string& dir, const std::string& pipe_to = "") {
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string run = std::string(STRATA_CLI_PATH) + " " + args + " 2>" + dir + "/stderr";
    const std::string cmd = pipe_to.empty() ? "exec " + run + " >" + dir + "/stdout"
                                            : "(" + run + "; echo $? >" + dir + "/rc) | " + pipe_to;
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

int Wait(pid_t pid, bool* signaled = nullptr) {
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  if (signaled) *signaled = WIFSIGNALED(status);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(TrainChecks, CheckpointRoomNamesBytesNeededAndAvailable) {
  testing::ScratchDir dir;
  Status s = cli::CheckCheckpointRoom(dir.str(), 600, 2, /*available_override=*/1000);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("--checkpoint-dir " + dir.str() + ": 1200 bytes needed"));
  EXPECT_THAT(s.ToString(), HasSubstr("1000 available"));
  EXPECT_TRUE(cli::CheckCheckpointRoom(dir.str(), 600, 1, 1000).ok());
  EXPECT_TRUE(cli::CheckCheckpointRoom(dir.str(), 600, 0, 0).ok());
  EXPECT_TRUE(cli::CheckCheckpointRoom(dir.str(), 4096, 1).ok());  // measured
  s = cli::CheckCheckpointRoom(dir.str(), int64_t{1} << 62, 1);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
}

TEST(TrainChecks, UnusableOutputDirectoriesFailBeforeTheFirstStep) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str());
  std::ofstream(dir.str() + "/file") << "x";
  for (const std::string& bad :
       {"--checkpoint-dir " + dir.str() + "/file", std::string("--plot /proc/plot"),
        "--plot " + dir.str() + "/file/sub"}) {
    SCOPED_TRACE(bad);
    EXPECT_EQ(Wait(Spawn("train --config " + cfg + " --steps 2 " + bad, dir.str())), 5);  // I/O
    const std::string err = ReadFile(dir.str() + "/stderr");
    EXPECT_THAT(err, HasSubstr("strata train: IOError: " + bad.substr(0, bad.find(' ')) + " "));
    size_t lines = 0;
    for (size_t at = err.find("strata train:"); at != std::string::npos;
         at = err.find("strata train:", at + 1))
      ++lines;
    EXPECT_EQ(lines, 1u) << err;
    EXPECT_THAT(ReadFile(dir.str() + "/stdout"), ::testing::Not(HasSubstr("step")));
  }
}

// A closed terminal: SIGHUP stops the run at the next micro-batch, the
// engine closes (swap files removed), exit 129.
TEST(TrainChecks, SighupEndsTheRunCleanly) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str());
  const pid_t pid = Spawn("train --config " + cfg + " --steps 1000000", dir.str());
  ASSERT_TRUE(WaitFor(dir.str() + "/stdout", "step    1/")) << ReadFile(dir.str() + "/stderr");
  EXPECT_EQ(SwapFilesIn(dir.str() + "/nvme"), 1u);
  ASSERT_EQ(kill(pid, SIGHUP), 0);
  bool signaled = false;
  EXPECT_EQ(Wait(pid, &signaled), 129);
  EXPECT_FALSE(signaled);
  EXPECT_EQ(SwapFilesIn(dir.str() + "/nvme"), 0u);
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"), HasSubstr("interrupted by SIGHUP"));
}

// `strata train ... | head -c 1`: stdout closed early. The run is not
// killed by SIGPIPE: it trains to the end (its checkpoint saved), removes
// its swap files, says on stderr that its output was lost, and exits 5 (I/O
// error).
TEST(TrainChecks, ClosedStdoutDoesNotKillTheRun) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str());
  const pid_t pid =
      Spawn("train --config " + cfg + " --steps 2 --checkpoint-dir " + dir.str() + "/ckpt",
            dir.str(), "head -c 1 >/dev/null");
  EXPECT_EQ(Wait(pid), 0);
  EXPECT_EQ(ReadFile(dir.str() + "/rc"), "5\n");  // I/O error
  EXPECT_THAT(ReadFile(dir.str() + "/stderr"),
              HasSubstr("stdout: write failed (closed: EPIPE or similar); the run completed"));
  EXPECT_TRUE(std::filesystem::exists(dir.str() + "/ckpt/ckpt-00000001/MANIFEST.json"));
  EXPECT_EQ(SwapFilesIn(dir.str() + "/nvme"), 0u);
}

// The crash points of the checkpoint tests (STRATA_CHECKPOINT_CRASH_AT,
// apps/strata/train/train.h) are compiled into the tests' build of the
// command only: the installed `strata` saves its checkpoint whatever the
// environment says.
TEST(TrainChecks, InstalledCommandHasNoCrashPoints) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str());
  ASSERT_EQ(setenv("STRATA_CHECKPOINT_CRASH_AT", "data", 1), 0);
  const pid_t pid = Spawn(
      "train --config " + cfg + " --steps 1 --checkpoint-dir " + dir.str() + "/ckpt", dir.str());
  unsetenv("STRATA_CHECKPOINT_CRASH_AT");
  bool signaled = false;
  EXPECT_EQ(Wait(pid, &signaled), 0) << ReadFile(dir.str() + "/stderr");
  EXPECT_FALSE(signaled);
  EXPECT_TRUE(std::filesystem::exists(dir.str() + "/ckpt/ckpt-00000001/MANIFEST.json"));
}

}  // namespace
}  // namespace strata
