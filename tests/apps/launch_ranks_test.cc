// The local-rank launcher (apps/strata/launch_ranks.cc) through `strata train
// --nproc-per-node 2`: it returns when a rank is stopped (SIGSTOP) and never
// continues, its ranks do not outlive it when it is killed (SIGKILL), and a
// Ctrl-C to the whole group stops them cleanly.
// Each case bounds its own waits and kills what it started, so that a
// launcher that hangs fails the case instead of the whole run.
#include "apps/strata/launch_ranks.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

// The collectives' timeout the ranks run with (STRATA_COMM_TIMEOUT_S).
constexpr int kCommTimeoutS = 3;

std::string ReadFile(const std::string& path) {
  std::stringstream ss;
  ss << std::ifstream(path).rdbuf();
  return ss.str();
}

// Two ranks of a tiny model on the host device, each one micro-batch of the
// global batch.
std::string WriteConfig(const std::string& dir) {
  const std::string path = dir + "/c.json";
  std::ofstream(path) << R"({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 4,
    "bf16": {"enabled": true}, "optimizer": {"params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "strata": {"device": "host", "hbm_budget": "8M", "threads": 1,
      "model": {"layers": 2, "hidden": 32, "seq_len": 16}}})";
  return path;
}

// Starts `strata train` for many steps on two local ranks (the launcher
// itself, no shell), its stdout and stderr into dir; returns its pid.
pid_t StartLauncher(const std::string& dir) {
  const std::string cfg = WriteConfig(dir);
  const std::string out = dir + "/stdout", err = dir + "/stderr";
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);  // a process group of its own, as a shell's job has
    setenv("STRATA_COMM_TIMEOUT_S", std::to_string(kCommTimeoutS).c_str(), 1);
    const int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (o < 0 || e < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0) _exit(127);
    execl(STRATA_CLI_PATH, STRATA_CLI_PATH, "train", "--config", cfg.c_str(), "--steps", "1000000",
          "--nproc-per-node", "2", static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// Waits up to `limit_s` until `file` contains `text`.
bool WaitForText(const std::string& file, const std::string& text, double limit_s) {
  const auto end = Clock::now() + std::chrono::duration<double>(limit_s);
  while (Clock::now() < end) {
    if (ReadFile(file).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// A process as /proc/<pid>/stat shows it: its parent, its state and its
// start time (which tells a reused pid from the process seen before).
struct ProcStat {
  bool exists = false;
  char state = '?';
  pid_t ppid = 0;
  unsigned long long start = 0;
};

ProcStat StatOf(pid_t pid) {
  ProcStat p;
  const std::string s = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  const size_t close = s.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return p;
  std::istringstream in(s.substr(close + 2));
  in >> p.state >> p.ppid;
  std::string skip;
  for (int field = 5; field < 22; ++field) in >> skip;  // fields 5..21
  in >> p.start;                                        // field 22
  p.exists = static_cast<bool>(in);
  return p;
}

// The children of `parent`, as seen now.
std::vector<pid_t> ChildrenOf(pid_t parent) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    const ProcStat st = StatOf(pid);
    if (st.exists && st.ppid == parent) out.push_back(pid);
  }
  return out;
}

// A rank the launcher started: running until its pid is gone, a zombie, or
// another process's.
struct Rank {
  pid_t pid = 0;
  unsigned long long start = 0;
  bool Alive() const {
    const ProcStat st = StatOf(pid);
    return st.exists && st.start == start && st.state != 'Z';
  }
};

std::vector<Rank> RanksOf(pid_t launcher) {
  std::vector<Rank> out;
  for (pid_t pid : ChildrenOf(launcher)) out.push_back({pid, StatOf(pid).start});
  return out;
}

// Reaps the launcher within `limit_s`; -1 when it has not exited by then.
int WaitExit(pid_t pid, double limit_s) {
  const auto end = Clock::now() + std::chrono::duration<double>(limit_s);
  while (Clock::now() < end) {
    int st = 0;
    const pid_t got = waitpid(pid, &st, WNOHANG);
    if (got == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (got < 0) return -2;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

// Kills whatever of a launch is left (a failed case must not leave it
// running); `launcher` is 0 once it has been reaped.
void KillAll(pid_t launcher, const std::vector<Rank>& ranks) {
  for (const Rank& r : ranks)
    if (r.Alive()) kill(r.pid, SIGKILL);
  if (launcher > 0 && kill(launcher, SIGKILL) == 0) waitpid(launcher, nullptr, 0);
}

// Rank 1 stopped mid-run: rank 0 fails at the collectives' timeout, and the
// launcher ends rank 1 (SIGTERM, SIGCONT, then SIGKILL after its grace)
// instead of waiting for it forever, and exits with a failure.
TEST(LaunchRanks, AStoppedRankDoesNotHangTheLauncher) {
  testing::ScratchDir dir;
  const pid_t launcher = StartLauncher(dir.str());
  ASSERT_GT(launcher, 0);
  std::vector<Rank> ranks;
  if (!WaitForText(dir.str() + "/stdout", "step    2/", 60)) {
    KillAll(launcher, RanksOf(launcher));
    FAIL() << "no step 2 within 60 s: " << ReadFile(dir.str() + "/stderr");
  }
  ranks = RanksOf(launcher);
  ASSERT_EQ(ranks.size(), 2u);
  // Rank 1 is the child started second (fork order: the larger pid unless
  // pids wrapped); either way one rank stops and the other waits for it.
  ASSERT_EQ(kill(ranks.back().pid, SIGSTOP), 0);
  const double limit_s = kCommTimeoutS + cli::kRankStopGraceS + 20;
  const int code = WaitExit(launcher, limit_s);
  KillAll(code == -1 ? launcher : 0, ranks);
  ASSERT_NE(code, -1) << "the launcher did not exit within " << limit_s
                      << " s of a rank's SIGSTOP: " << ReadFile(dir.str() + "/stderr");
  EXPECT_NE(code, 0) << ReadFile(dir.str() + "/stderr");
  EXPECT_LT(code, 128) << "the launcher exits with a rank's failure, not by a signal";
  for (const Rank& r : ranks) EXPECT_FALSE(r.Alive()) << "rank pid " << r.pid;
}

// `kill -9` of the launcher: its ranks are killed with it (PR_SET_PDEATHSIG)
// within seconds, instead of training on as orphans.
TEST(LaunchRanks, RanksDieWithTheirLauncher) {
  testing::ScratchDir dir;
  const pid_t launcher = StartLauncher(dir.str());
  ASSERT_GT(launcher, 0);
  if (!WaitForText(dir.str() + "/stdout", "step    2/", 60)) {
    KillAll(launcher, RanksOf(launcher));
    FAIL() << "no step 2 within 60 s: " << ReadFile(dir.str() + "/stderr");
  }
  const std::vector<Rank> ranks = RanksOf(launcher);
  ASSERT_EQ(ranks.size(), 2u);
  ASSERT_EQ(kill(launcher, SIGKILL), 0);
  ASSERT_EQ(waitpid(launcher, nullptr, 0), launcher);
  const auto end = Clock::now() + std::chrono::seconds(5);
  auto any_alive = [&] {
    for (const Rank& r : ranks)
      if (r.Alive()) return true;
    return false;
  };
  while (any_alive() && Clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  for (const Rank& r : ranks) EXPECT_FALSE(r.Alive()) << "rank pid " << r.pid << " outlived it";
  KillAll(0, ranks);
}

// Ctrl-C in a terminal signals the whole process group: the launcher (which
// forwards SIGINT to its ranks) and the ranks themselves. Each rank takes
// the two copies for one signal and stops at its next micro-batch, instead
// of taking the second for a "stop now" and exiting without cleanup.
TEST(LaunchRanks, CtrlCToTheGroupStopsTheRanksCleanly) {
  testing::ScratchDir dir;
  const pid_t launcher = StartLauncher(dir.str());
  ASSERT_GT(launcher, 0);
  if (!WaitForText(dir.str() + "/stdout", "step    2/", 60)) {
    KillAll(launcher, RanksOf(launcher));
    FAIL() << "no step 2 within 60 s: " << ReadFile(dir.str() + "/stderr");
  }
  const std::vector<Rank> ranks = RanksOf(launcher);
  ASSERT_EQ(ranks.size(), 2u);
  ASSERT_EQ(kill(-launcher, SIGINT), 0);  // the group, as the terminal does
  const int code = WaitExit(launcher, 60);
  KillAll(code == -1 ? launcher : 0, ranks);
  const std::string err = ReadFile(dir.str() + "/stderr");
  ASSERT_NE(code, -1) << "the launcher did not exit within 60 s of SIGINT: " << err;
  EXPECT_EQ(code, 130) << err;
  EXPECT_EQ(err.find("second signal"), std::string::npos) << err;
  EXPECT_NE(err.find("interrupted by SIGINT"), std::string::npos) << err;
}

}  // namespace
}  // namespace strata
