// PinnedPool on both backends: planning against the budget, size classes,
// exhaustion, regions for io_uring, and the pageable fallback when the kernel
// refuses to page-lock (RLIMIT_MEMLOCK without CAP_IPC_LOCK — for real).
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <set>

#include "src/common/aligned_buffer.h"
#include "src/gpu/device.h"
#include "tests/gpu/device_test_util.h"
#include "tests/test_util.h"

namespace strata::gpu::testing {
namespace {

template <typename B>
using PinnedPoolTest = DeviceTest<B>;
TYPED_TEST_SUITE(PinnedPoolTest, Backends);

TYPED_TEST(PinnedPoolTest, SizeClassesExhaustionAndRegions) {
  PinnedPoolOptions o;
  o.classes = {{64 << 10, 3}, {1 << 20, 1}};
  o.budget_bytes = 4 << 20;
  auto pool = PinnedPool::Create(o, &this->dev());
  ASSERT_TRUE(pool.ok()) << pool.status();
  PinnedPool& p = **pool;
  EXPECT_EQ(p.total_bytes(), (3u << 16) + (1u << 20));
  ASSERT_EQ(p.Regions().size(), 2u);
  EXPECT_EQ(p.Regions()[0].bytes, 3u << 16);
  EXPECT_EQ(p.Regions()[1].bytes, 1u << 20);

  std::vector<PinnedBuffer> held;
  std::set<void*> seen;
  for (int i = 0; i < 3; ++i) {
    auto b = p.Acquire(1000);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->size(), 64u << 10);
    EXPECT_TRUE(IsAligned(b->data(), 4096));
    // Inside its region.
    const auto& r = p.Regions()[b->region()];
    EXPECT_GE(b->as<char>(), static_cast<char*>(r.data));
    EXPECT_LE(b->as<char>() + b->size(), static_cast<char*>(r.data) + r.bytes);
    EXPECT_TRUE(seen.insert(b->data()).second);
    std::memset(b->data(), i, b->size());  // usable memory
    held.push_back(std::move(b).value());
  }
  // The small class is empty: the next larger class serves.
  auto big = p.Acquire(10);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->size(), 1u << 20);
  auto none = p.Acquire(10);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(none.status().message()).find("in use"), std::string::npos);
  EXPECT_EQ(p.Acquire(2 << 20).status().code(), StatusCode::kInvalidArgument);  // no class fits
  held.pop_back();  // returns one small buffer
  auto again = p.Acquire(64 << 10);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->size(), 64u << 10);
  const auto stats = p.GetStats();
  EXPECT_EQ(stats.acquired, 5u);
  EXPECT_EQ(stats.exhausted, 2u);
}

TYPED_TEST(PinnedPoolTest, PlanOverBudgetFailsBeforeAllocating) {
  PinnedPoolOptions o = PlanPinnedPool(8 << 20, 3 << 20);  // two 3 MiB buffers
  ASSERT_EQ(o.classes.size(), 1u);
  EXPECT_EQ(o.classes[0].count, 2u);
  o.classes[0].count = 3;  // now 9 MiB > 8 MiB
  auto pool = PinnedPool::Create(o, &this->dev());
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kResourceExhausted);
  const std::string msg(pool.status().message());
  EXPECT_NE(msg.find("9437184 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("8388608 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("strata.pinned_budget is"), std::string::npos) << msg;
  o.classes[0].buffer_bytes = 1000;  // not a page multiple
  EXPECT_EQ(PinnedPool::Create(o, &this->dev()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PinnedPool::Create(PinnedPoolOptions{}, &this->dev()).status().code(),
            StatusCode::kInvalidArgument);
}

// Pinned buffers feed device copies.
TYPED_TEST(PinnedPoolTest, BuffersCarryCopies) {
  Device& d = this->dev();
  auto pool = PinnedPool::Create(PlanPinnedPool(2 << 20, 1 << 20), &d).value();
  auto a = pool->Acquire(1 << 20).value();
  auto b = pool->Acquire(1 << 20).value();
  auto rng = strata::testing::MakeRng();
  auto data = strata::testing::RandomBytes(rng, a.size());
  std::memcpy(a.data(), data.data(), data.size());
  auto x = d.Allocate(a.size()).value();
  ASSERT_OK(d.CopyH2D(x.data(), a.data(), a.size(), d.h2d()));
  ASSERT_OK(d.h2d().Synchronize());
  ASSERT_OK(d.CopyD2H(b.data(), x.data(), b.size(), d.d2h()));
  ASSERT_OK(d.d2h().Synchronize());
  EXPECT_EQ(0, std::memcmp(b.data(), data.data(), data.size()));
}

// Drops CAP_IPC_LOCK from this thread's effective set (mlock then obeys
// RLIMIT_MEMLOCK even for root) and lowers the soft limit; restores both.
class MemlockRestriction {
 public:
  explicit MemlockRestriction(rlim_t soft) {
    getrlimit(RLIMIT_MEMLOCK, &saved_);
    struct rlimit rl = saved_;
    rl.rlim_cur = soft;
    ok_ = setrlimit(RLIMIT_MEMLOCK, &rl) == 0;
    hdr_.version = _LINUX_CAPABILITY_VERSION_3;
    hdr_.pid = 0;
    if (syscall(SYS_capget, &hdr_, caps_) == 0 && (caps_[0].effective & (1u << CAP_IPC_LOCK))) {
      __user_cap_data_struct dropped[2] = {caps_[0], caps_[1]};
      dropped[0].effective &= ~(1u << CAP_IPC_LOCK);
      cap_dropped_ = syscall(SYS_capset, &hdr_, dropped) == 0;
      ok_ = ok_ && cap_dropped_;
    }
  }
  ~MemlockRestriction() {
    if (cap_dropped_) syscall(SYS_capset, &hdr_, caps_);
    setrlimit(RLIMIT_MEMLOCK, &saved_);
  }
  bool ok() const { return ok_; }

 private:
  struct rlimit saved_ {};
  __user_cap_header_struct hdr_{};
  __user_cap_data_struct caps_[2]{};
  bool ok_ = false, cap_dropped_ = false;
};

TEST(PinnedPoolFallbackTest, RefusedMlockFallsBackToPageableOrFails) {
  DeviceOptions opt;
  opt.kind = DeviceKind::kHost;
  opt.hbm_budget_bytes = 16 << 20;
  auto d = CreateDevice(opt).value();
  PinnedPoolOptions o = PlanPinnedPool(8 << 20, 1 << 20);
  {
    MemlockRestriction r(64 << 10);
    if (!r.ok()) GTEST_SKIP() << "cannot restrict RLIMIT_MEMLOCK / CAP_IPC_LOCK here";
    // Sanitizer runtimes intercept mlock and make it a no-op: then there is
    // no refusal to test.
    {
      std::vector<char> probe(1 << 20, 1);
      if (mlock(probe.data(), probe.size()) == 0) {
        munlock(probe.data(), probe.size());
        GTEST_SKIP() << "mlock of 1 MiB succeeded despite a 64 KiB RLIMIT_MEMLOCK (sanitizer "
                        "interceptor?); the refusal path cannot be exercised here";
      }
    }
    auto pool = PinnedPool::Create(o, d.get());
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_FALSE((*pool)->pinned());
    auto b = (*pool)->Acquire(1 << 20);
    ASSERT_TRUE(b.ok()) << b.status();
    std::memset(b->data(), 7, b->size());  // still usable memory
    // Without fallback: an error that says how to raise the limit.
    o.allow_pageable_fallback = false;
    auto strict = PinnedPool::Create(o, d.get());
    ASSERT_FALSE(strict.ok());
    EXPECT_EQ(strict.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(std::string(strict.status().message()).find("ulimit -l"), std::string::npos)
        << strict.status();
    // It names the config key that exists (strata.pinned_budget).
    EXPECT_NE(std::string(strict.status().message()).find("strata.pinned_budget"),
              std::string::npos)
        << strict.status();
    EXPECT_EQ(std::string(strict.status().message()).find("pinned_budget_bytes"), std::string::npos)
        << strict.status();
    // Direct mlock (no device) takes the same path.
    auto direct = PinnedPool::Create(o, nullptr);
    EXPECT_EQ(direct.status().code(), StatusCode::kResourceExhausted);
  }
  // Limits restored: a small pool pins again.
  o.allow_pageable_fallback = true;
  auto pool = PinnedPool::Create(PlanPinnedPool(1 << 20, 1 << 20), d.get());
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_TRUE((*pool)->pinned());
}

}  // namespace
}  // namespace strata::gpu::testing
