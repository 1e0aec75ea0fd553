// CheckHostMemory: MemAvailable and the RLIMIT_AS headroom, each refusing
// with the bytes asked and available.
#include "src/common/host_memory.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

namespace strata {
namespace {

TEST(HostMemoryTest, ReadsTheMachineAndTheProcess) {
  const HostMemoryInfo m = ReadHostMemory();
  ASSERT_TRUE(m.mem_known);
  EXPECT_GT(m.mem_available, 0u);
  EXPECT_GT(m.vm_size, 0u);
  if (!m.as_limited) {
    EXPECT_EQ(m.as_headroom(), UINT64_MAX);
  }
}

TEST(HostMemoryTest, MoreThanMemAvailableIsRefusedNamingBothSides) {
  EXPECT_TRUE(CheckHostMemory("a small thing", 4096).ok());
  const uint64_t too_much = ReadHostMemory().mem_available * 2 + (1ull << 30);
  Status s = CheckHostMemory("the arrays", too_much);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  const std::string msg(s.message());
  EXPECT_NE(msg.find("the arrays needs " + std::to_string(too_much) + " bytes"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("MemAvailable"), std::string::npos) << msg;
}

// In a child: RLIMIT_AS = mapped + 64 MiB. 32 MiB fits, 32 MiB + 64 MiB of
// address space does not, and the message names the limit.
TEST(HostMemoryTest, AddressSpaceUnderRlimitAsIsChecked) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const rlim_t lim = ReadHostMemory().vm_size + (64u << 20);
    rlimit rl{lim, lim};
    if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(2);
    if (!CheckHostMemory("small", 32u << 20).ok()) _exit(3);
    Status s = CheckHostMemory("buffers", 32u << 20, 64u << 20);
    if (s.code() != StatusCode::kResourceExhausted) _exit(4);
    if (std::string(s.message()).find("RLIMIT_AS") == std::string::npos) _exit(5);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace strata
