// Engine::Create and Plan() under low process limits, each in a forked child:
// RLIMIT_NPROC (threads cannot start) and RLIMIT_AS (memory cannot be
// mapped) give a Status naming what could not be had, never an abort
// (std::terminate from a std::system_error, SIGABRT) or a hang. The C API
// gives an error code and message the same way. The child reports its exit
// code and the message through a pipe; the parent asserts on both.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "strata/engine.h"
#include "strata/strata_c.h"
#include "tests/test_util.h"

namespace strata {
namespace {

constexpr int kCreated = 0;  // the child's exit code: everything succeeded
constexpr int kStatus = 3;   // a Status (or C API error) came back
constexpr int kSetupFailed = 4;

struct ChildResult {
  bool exited = false;  // else killed by a signal (abort, segfault) or the timeout
  int code = -1;
  int signal = 0;
  std::string message;
};

// Runs `body` in a forked child after `limit`; body returns the exit code
// and fills the message. The child is killed after `timeout_s` (a hang).
ChildResult RunInChild(const std::function<bool()>& limit,
                       const std::function<int(std::string*)>& body, double timeout_s = 60) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  EXPECT_GE(pid, 0);
  if (pid == 0) {
    close(fds[0]);
    std::string msg;
    int code = kSetupFailed;
    if (limit())
      code = body(&msg);
    else
      msg = std::string("setting the limit failed: ") + std::strerror(errno);
    ssize_t ignored = write(fds[1], msg.data(), msg.size());
    (void)ignored;
    _exit(code);
  }
  close(fds[1]);
  ChildResult r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  char buf[4096];
  for (;;) {
    pollfd p{fds[0], POLLIN, 0};
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          deadline - std::chrono::steady_clock::now())
                                          .count());
    if (left <= 0 || poll(&p, 1, left) <= 0) {
      kill(pid, SIGKILL);
      r.message += "[timed out: the child hung]";
      break;
    }
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n <= 0) break;
    r.message.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  // The pipe may close before the child exits (or hangs): wait with the
  // same deadline, then kill it.
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      r.message += "[timed out: the child hung after closing its pipe]";
      waitpid(pid, &status, 0);
      break;
    }
    usleep(10'000);
  }
  r.exited = WIFEXITED(status);
  if (r.exited) r.code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  return r;
}

// As root RLIMIT_NPROC is not enforced: the child becomes nobody first
// (whose process count is tiny), then lowers the limit to `n`.
bool LimitProcesses(rlim_t n) {
  if (geteuid() == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) return false;
  }
  rlimit rl{n, n};
  return setrlimit(RLIMIT_NPROC, &rl) == 0;
}

uint64_t VmSizeBytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  return 0;
}

// The address space in use now plus `extra` bytes.
bool LimitAddressSpace(uint64_t extra) {
  const rlim_t n = static_cast<rlim_t>(VmSizeBytes() + extra);
  rlimit rl{n, n};
  return setrlimit(RLIMIT_AS, &rl) == 0;
}

std::string ConfigJson(const std::string& nvme_dir) {
  return R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
         nvme_dir + R"("},
      "offload_param": {"device": "nvme", "nvme_path": ")" +
         nvme_dir + R"(", "buffer_count": 4},
      "sub_group_size": 20000, "reduce_bucket_size": 1e5},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "aio": {"queue_depth": 8},
    "strata": {"device": "host", "hbm_budget": "16M", "threads": 2, "io_engine": "posix"}})";
}

// Engine::CreateFromJson, a few parameters, Plan(): the exit code says how
// far it got and the message says why it stopped.
int CreateAndPlan(const std::string& nvme_dir, std::string* msg) {
  StatusOr<std::unique_ptr<Engine>> e = Engine::CreateFromJson(ConfigJson(nvme_dir));
  if (!e.ok()) {
    *msg = e.status().ToString();
    return kStatus;
  }
  for (int m = 0; m < 4; ++m) {
    ParamSpec s;
    s.name = "w";
    s.name += std::to_string(m);  // (GCC 12 -Wrestrict misfires on "w" + std::string)
    s.numel = 50000;
    s.dtype = DType::kBf16;
    s.module = m;
    s.initializer = [](std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); };
    StatusOr<int> id = (*e)->RegisterParameter(s);
    if (!id.ok()) {
      *msg = id.status().ToString();
      return kStatus;
    }
  }
  if (Status p = (*e)->Plan(); !p.ok()) {
    *msg = p.ToString();
    return kStatus;
  }
  *msg = "created and planned";
  return kCreated;
}

int CreateThroughCApi(const std::string& nvme_dir, std::string* msg) {
  strata_engine* e = nullptr;
  const int rc = strata_engine_create_from_json(ConfigJson(nvme_dir).c_str(), &e);
  if (rc != STRATA_OK) {
    *msg = strata_last_error();
    return kStatus;
  }
  int id = 0;
  if (strata_register_parameter(e, "w", 50000, STRATA_BF16, 0, nullptr, &id) != STRATA_OK ||
      strata_plan(e) != STRATA_OK) {
    *msg = strata_last_error();
    strata_engine_destroy(e);
    return kStatus;
  }
  strata_engine_destroy(e);
  *msg = "created and planned";
  return kCreated;
}

class ResourceLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // World-writable: the child may run as nobody.
    ASSERT_EQ(chmod(dir_.str().c_str(), 0777), 0);
  }
  testing::ScratchDir dir_{"strata-limits"};
};

// Not one thread to spare: the first thread the engine starts fails.
TEST_F(ResourceLimitsTest, NoThreadsLeftIsAStatusNamingTheThreads) {
  const ChildResult r = RunInChild([] { return LimitProcesses(1); },
                                   [&](std::string* m) { return CreateAndPlan(dir_.str(), m); });
  ASSERT_TRUE(r.exited) << "killed by signal " << r.signal << ": " << r.message;
  ASSERT_EQ(r.code, kStatus) << r.message;
  EXPECT_NE(r.message.find("ResourceExhausted"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("thread"), std::string::npos) << r.message;
}

// A few threads to spare: the engine fails somewhere further along (or
// succeeds), always through a Status.
TEST_F(ResourceLimitsTest, SomeThreadsLeftIsAStatusWhereverItStops) {
  for (rlim_t n : {2, 3, 4, 6, 9, 14}) {
    SCOPED_TRACE("RLIMIT_NPROC " + std::to_string(n));
    const ChildResult r = RunInChild([n] { return LimitProcesses(n); },
                                     [&](std::string* m) { return CreateAndPlan(dir_.str(), m); });
    ASSERT_TRUE(r.exited) << "killed by signal " << r.signal << ": " << r.message;
    EXPECT_TRUE(r.code == kStatus || r.code == kCreated) << r.code << ": " << r.message;
    std::printf("  NPROC %d: %s\n", static_cast<int>(n), r.message.c_str());
    if (r.code == kStatus) {
      EXPECT_NE(r.message.find("ResourceExhausted"), std::string::npos) << r.message;
    }
  }
}

// Little address space left: every step from creation to the plan either
// fits or fails with a Status.
TEST_F(ResourceLimitsTest, LowAddressSpaceIsAStatusNotAnAbort) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's own allocator dies under RLIMIT_AS (its shadow memory)";
#endif
  // At least 1 MiB beyond what is mapped: with none at all even the error's
  // message may find no heap left (how much is free at the fork depends on
  // what the parent allocated before), and the message is the point.
  int statuses = 0;
  for (uint64_t extra_mib : {1, 8, 32, 64, 128, 256}) {
    SCOPED_TRACE("RLIMIT_AS: mapped + " + std::to_string(extra_mib) + " MiB");
    const ChildResult r = RunInChild([extra_mib] { return LimitAddressSpace(extra_mib << 20); },
                                     [&](std::string* m) { return CreateAndPlan(dir_.str(), m); });
    ASSERT_TRUE(r.exited) << "killed by signal " << r.signal << ": " << r.message;
    EXPECT_TRUE(r.code == kStatus || r.code == kCreated) << r.code << ": " << r.message;
    statuses += r.code == kStatus;
    std::printf("  AS +%llu MiB: %s\n", static_cast<unsigned long long>(extra_mib),
                r.message.c_str());
  }
  EXPECT_GE(statuses, 1) << "no limit was low enough to fail";
}

TEST_F(ResourceLimitsTest, CApiGivesAnErrorCodeAndMessage) {
  ChildResult r = RunInChild([] { return LimitProcesses(1); },
                             [&](std::string* m) { return CreateThroughCApi(dir_.str(), m); });
  ASSERT_TRUE(r.exited) << "killed by signal " << r.signal << ": " << r.message;
  ASSERT_EQ(r.code, kStatus) << r.message;
  EXPECT_NE(r.message.find("thread"), std::string::npos) << r.message;
#if !defined(__SANITIZE_ADDRESS__)  // see LowAddressSpaceIsAStatusNotAnAbort
  r = RunInChild([] { return LimitAddressSpace(1 << 20); },
                 [&](std::string* m) { return CreateThroughCApi(dir_.str(), m); });
  ASSERT_TRUE(r.exited) << "killed by signal " << r.signal << ": " << r.message;
  EXPECT_EQ(r.code, kStatus) << r.message;
  EXPECT_FALSE(r.message.empty());
#endif
}

}  // namespace
}  // namespace strata
