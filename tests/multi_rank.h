// Tests with several ranks as processes: each rank is a forked child of the
// test process (forked before any device, engine or Gloo state exists in the
// parent, so the child starts single-threaded) that runs one scenario and
// exits with 0, or prints what went wrong to stderr and exits with 1.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "strata/status.h"
#include "tests/test_util.h"

namespace strata::testing {

// A failed check in a rank: the message goes to stderr, the rank exits 1.
struct RankFailure {
  std::string what;
};
#define RANK_CHECK(cond, ...)                                                                      \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      throw ::strata::testing::RankFailure{fmt::format("{}:{}: {}: ", __FILE__, __LINE__, #cond) + \
                                           fmt::format(__VA_ARGS__)};                              \
  } while (0)
#define RANK_OK(expr)                         \
  do {                                        \
    const ::strata::Status s_ = (expr);       \
    RANK_CHECK(s_.ok(), "{}", s_.ToString()); \
  } while (0)

// One rank's place in a run: its rank, the ranks, a directory every rank of
// the run shares (rendezvous, results) and the collectives' timeout.
struct RankEnv {
  int rank = 0;
  int world = 1;
  std::string dir;
  double timeout_s = 20;
};

// Starts `world` ranks running `body`, waits for all (killing any left after
// `limit_s`, a test failure), and returns each rank's wait status.
inline std::vector<int> RunRanks(int world, const std::function<void(const RankEnv&)>& body,
                                 double timeout_s = 20, double limit_s = 60,
                                 const std::string& dir_tag = "strata-ranks") {
  ScratchDir dir(dir_tag);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << std::strerror(errno);
      break;
    }
    if (pid == 0) {
      int code = 0;
      try {
        body(RankEnv{r, world, dir.str(), timeout_s});
      } catch (const RankFailure& f) {
        std::fprintf(stderr, "rank %d: %s\n", r, f.what.c_str());
        code = 1;
      }
      std::fflush(stderr);
      _exit(code);  // no destructors or atexit handlers of the parent's state
    }
    pids.push_back(pid);
  }
  std::vector<int> status(pids.size(), -1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit_s);
  size_t left = pids.size();
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (status[i] != -1) continue;
      int st = 0;
      if (waitpid(pids[i], &st, WNOHANG) == pids[i]) {
        status[i] = st;
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (status[i] == -1) {
          ADD_FAILURE() << "rank " << i << " still running after " << limit_s << " s: killed";
          kill(pids[i], SIGKILL);
          waitpid(pids[i], &status[i], 0);
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return status;
}

inline void ExpectAllExitedZero(const std::vector<int>& status) {
  for (size_t r = 0; r < status.size(); ++r)
    EXPECT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)
        << "rank " << r << " wait status " << status[r] << " (see its stderr above)";
}

}  // namespace strata::testing
