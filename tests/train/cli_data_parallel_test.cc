// `strata train` with several ranks: `--nproc-per-node` on one machine and
// `--nnodes` across "machines" train as one rank accumulating the ranks'
// batches, checkpoints resume at another number of ranks, and a signal to
// the launcher stops every rank.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/test_util.h"
#include "tests/train/cli_process.h"

namespace strata {
namespace {

using cli_testing::ReadFile;
using cli_testing::RunResult;
using cli_testing::Spawn;
using cli_testing::Strata;
using cli_testing::SwapFilesIn;
using cli_testing::WaitFor;
using ::testing::HasSubstr;
using json = nlohmann::json;

// ---- Data parallelism through --nproc-per-node ----------------------------------

// A config for `ranks` ranks of `gas` micro-batches each (train_batch_size
// is the global batch).
std::string DataParallelConfig(const std::string& dir, const std::string& name, int gas, int ranks,
                               const std::string& zero) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": )"
                      << gas << R"(, "train_batch_size": )" << 2 * gas * ranks << R"(,
    "bf16": {"enabled": true}, "gradient_clipping": 1.0, "optimizer": {"params": {"lr": 3e-3}},
    "zero_optimization": )"
                      << zero << R"(,
    "strata": {"device": "host", "hbm_budget": "8M", "threads": 2,
      "model": {"layers": 2, "hidden": 32, "seq_len": 16}}})";
  return path;
}

// Two local ranks of one micro-batch train as one rank accumulating both:
// the same losses, bit for bit (the example sums its micro-batches'
// gradients; with two ranks the average of 2 g0 and 2 g1 is g0 + g1 exactly).
TEST(TrainCli, TwoLocalRanksTrainAsOneRankAccumulatingTheirBatches) {
  testing::ScratchDir dir;
  std::filesystem::create_directories(dir.str() + "/nvme");
  const std::string zeros[] = {
      R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})",
      R"({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.str() +
          R"(/nvme"}, "offload_param": {"device": "cpu"}, "sub_group_size": 20000})",
      R"({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.str() +
          R"(/nvme"}, "offload_param": {"device": "nvme", "nvme_path": ")" + dir.str() +
          R"(/nvme"}})"};
  for (const std::string& zero : zeros) {
    SCOPED_TRACE(zero);
    const RunResult one =
        Strata("train --config " + DataParallelConfig(dir.str(), "one.json", 2, 1, zero) +
                   " --steps 4 --json",
               dir.str());
    ASSERT_EQ(one.exit_code, 0) << one.err;
    const RunResult two =
        Strata("train --config " + DataParallelConfig(dir.str(), "two.json", 1, 2, zero) +
                   " --steps 4 --json --nproc-per-node 2",
               dir.str());
    ASSERT_EQ(two.exit_code, 0) << two.err;
    const json a = json::parse(one.out), b = json::parse(two.out);  // rank 0 alone prints
    EXPECT_EQ(b["world_size"], 2);
    EXPECT_EQ(b["rank"], 0);
    EXPECT_EQ(a["tokens_per_step"], b["tokens_per_step"]);
    ASSERT_EQ(a["losses"].size(), 4u);
    for (size_t i = 0; i < 4; ++i)
      EXPECT_EQ(a["losses"][i].get<double>(), b["losses"][i].get<double>()) << "step " << i + 1;
    EXPECT_GE(b["max_peak_rss_bytes"].get<int64_t>(), b["peak_rss_bytes"].get<int64_t>());
    // Stage 3 with offload_param cpu: each rank's host copies hold its part
    // of the parameters, and fetches gather the modules.
    if (zero.find(R"("offload_param": {"device": "cpu"})") != std::string::npos) {
      std::string host_rows;
      for (const json& t : b["budgets"]) host_rows += t["detail"].get<std::string>() + "; ";
      EXPECT_NE(host_rows.find("parameter gather"), std::string::npos) << host_rows;
    }
    // Only rank 0 reports progress.
    size_t progress = 0;
    for (size_t at = 0; (at = two.err.find("step    1/4", at)) != std::string::npos; ++at)
      ++progress;
    EXPECT_EQ(progress, 1u) << two.err;
  }
}

// Two "machines" of one rank each (two launchers with --nnodes 2 and their
// --node-rank, meeting at --master-addr/--master-port through a shared
// STRATA_GLOO_DIR) train as one rank accumulating both batches, bit for
// bit; node 0's rank 0 alone prints. A --node-rank outside --nnodes is a
// usage error.
TEST(TrainCli, TwoNodesTrainAsOneRankAccumulatingTheirBatches) {
  testing::ScratchDir dir;
  const std::string zero = R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})";
  const RunResult one =
      Strata("train --config " + DataParallelConfig(dir.str(), "one.json", 2, 1, zero) +
                 " --steps 3 --json",
             dir.str());
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const std::string two = DataParallelConfig(dir.str(), "two.json", 1, 2, zero);
  std::filesystem::create_directories(dir.str() + "/rdv");
  std::filesystem::permissions(dir.str() + "/rdv", std::filesystem::perms::owner_all);
  // A port free a moment ago, and both nodes' commands.
  const int port = 20000 + static_cast<int>(getpid() % 20000);
  pid_t node[2];
  for (int k = 0; k < 2; ++k) {
    std::filesystem::create_directories(dir.str() + "/node" + std::to_string(k));
    node[k] = fork();
    if (node[k] == 0) {
      const std::string out = dir.str() + "/node" + std::to_string(k);
      const std::string cmd = "STRATA_GLOO_DIR=" + dir.str() + "/rdv exec " + STRATA_CLI_PATH +
                              " train --config " + two +
                              " --steps 3 --json --nnodes 2 --nproc-per-node 1 --node-rank " +
                              std::to_string(k) + " --master-addr 127.0.0.1 --master-port " +
                              std::to_string(port) + " >" + out + "/stdout 2>" + out + "/stderr";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  for (int k = 0; k < 2; ++k) {
    int st = 0;
    ASSERT_EQ(waitpid(node[k], &st, 0), node[k]);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0)
        << "node " << k << ": " << ReadFile(dir.str() + "/node" + std::to_string(k) + "/stderr");
  }
  EXPECT_EQ(ReadFile(dir.str() + "/node1/stdout"), "");  // global rank 1 prints nothing
  const json a = json::parse(one.out), b = json::parse(ReadFile(dir.str() + "/node0/stdout"));
  EXPECT_EQ(b["world_size"], 2);
  ASSERT_EQ(a["losses"].size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(a["losses"][i].get<double>(), b["losses"][i].get<double>()) << "step " << i + 1;

  const RunResult bad = Strata("train --config " + two + " --nnodes 2 --node-rank 2", dir.str());
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--node-rank 2 must be in 0..1 (--nnodes 2)"));
}

// A checkpoint saved by two ranks resumes on one rank accumulating both
// micro-batches (the same global batch), and one saved by one rank resumes
// on two: the losses are those of the run that was not interrupted.
TEST(TrainCli, CheckpointsResumeAtAnotherNumberOfRanks) {
  testing::ScratchDir dir;
  const std::string zero = R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})";
  const std::string one = DataParallelConfig(dir.str(), "one.json", 2, 1, zero);
  const std::string two = DataParallelConfig(dir.str(), "two.json", 1, 2, zero);
  const RunResult whole = Strata("train --config " + one + " --steps 4 --json", dir.str());
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const json ref = json::parse(whole.out);
  struct Case {
    std::string first, second;
  } cases[] = {{two + " --nproc-per-node 2", one}, {one, two + " --nproc-per-node 2"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.first + " then " + c.second);
    const std::string ckpt = dir.str() + "/ckpt-" + std::to_string(&c - cases);
    const RunResult a = Strata(
        "train --config " + c.first + " --steps 2 --json --checkpoint-dir " + ckpt, dir.str());
    ASSERT_EQ(a.exit_code, 0) << a.err;
    const RunResult b =
        Strata("train --config " + c.second + " --steps 4 --json --resume --checkpoint-dir " + ckpt,
               dir.str());
    ASSERT_EQ(b.exit_code, 0) << b.err;
    const json r = json::parse(b.out);
    EXPECT_EQ(r["resumed_from_step"], 2);
    ASSERT_EQ(r["losses"].size(), 4u);
    for (size_t i = 0; i < 4; ++i)
      EXPECT_EQ(r["losses"][i].get<double>(), ref["losses"][i].get<double>()) << "step " << i + 1;
  }
}

// SIGINT to the launcher reaches every rank: all stop, exit 130, and their
// swap files (each under nvme_path/rank-<k>) are gone.
TEST(TrainCli, SigintToTheLauncherStopsEveryRank) {
  testing::ScratchDir dir;
  std::filesystem::create_directories(dir.str() + "/nvme");
  const std::string cfg =
      DataParallelConfig(dir.str(), "c.json", 1, 2,
                         R"({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                             dir.str() + R"(/nvme"}})");
  const pid_t pid =
      Spawn("train --config " + cfg + " --steps 1000000 --nproc-per-node 2", dir.str());
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(WaitFor(dir.str() + "/stdout", "step    2/")) << ReadFile(dir.str() + "/stderr");
  EXPECT_EQ(SwapFilesIn(dir.str() + "/nvme/rank-0"), 1u);
  EXPECT_EQ(SwapFilesIn(dir.str() + "/nvme/rank-1"), 1u);
  ASSERT_EQ(kill(pid, SIGINT), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 130) << ReadFile(dir.str() + "/stderr");
  EXPECT_EQ(SwapFilesIn(dir.str() + "/nvme/rank-0"), 0u);
  EXPECT_EQ(SwapFilesIn(dir.str() + "/nvme/rank-1"), 0u);
}

}  // namespace
}  // namespace strata
