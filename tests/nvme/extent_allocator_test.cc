#include "src/nvme/extent_allocator.h"

#include <gtest/gtest.h>

#include <map>

#include "tests/test_util.h"

namespace strata::nvme {
namespace {
uint64_t AlignUp4k(uint64_t n) { return (n + 4095) / 4096 * 4096; }

TEST(ExtentAllocatorTest, FirstFitCoalesceAndReuse) {
  ExtentAllocator a(64 << 10, 4096);
  auto x = a.Allocate(1);
  auto y = a.Allocate(8192);
  auto z = a.Allocate(4097);
  ASSERT_TRUE(x.ok() && y.ok() && z.ok());
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, 4096u);
  EXPECT_EQ(*z, 12288u);
  EXPECT_EQ(a.free_bytes(), (64u << 10) - 4096 - 8192 - 8192);
  ASSERT_TRUE(a.Free(*y, 8192).ok());
  EXPECT_EQ(a.Free(*y, 8192).code(), StatusCode::kInvalidArgument);  // double free
  EXPECT_EQ(*a.Allocate(8000), 4096u);                             // reused hole
  ASSERT_TRUE(a.Free(4096, 8000).ok());
  ASSERT_TRUE(a.Free(*x, 1).ok());
  ASSERT_TRUE(a.Free(*z, 4097).ok());
  EXPECT_EQ(a.free_extents(), 1u) << "neighbours must coalesce";
  EXPECT_EQ(a.largest_free(), 64u << 10);
  auto big = a.Allocate((64 << 10) + 1);
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
}

TEST(ExtentAllocatorTest, RandomAllocFreeKeepsExtentsDisjoint) {
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(seed);
  const uint64_t cap = 4 << 20;
  ExtentAllocator a(cap, 4096);
  std::map<uint64_t, uint64_t> live;  // offset → asked bytes
  for (int i = 0; i < 3000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      uint64_t n = 1 + rng() % (200 << 10);
      auto off = a.Allocate(n);
      if (!off.ok()) continue;
      auto next = live.lower_bound(*off);
      if (next != live.end()) {
        ASSERT_LE(*off + AlignUp4k(n), next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + AlignUp4k(prev->second), *off);
      }
      ASSERT_LE(*off + n, cap);
      live[*off] = n;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(a.Free(it->first, it->second).ok());
      live.erase(it);
    }
  }
  for (auto& [off, n] : live) ASSERT_TRUE(a.Free(off, n).ok());
  EXPECT_EQ(a.free_bytes(), cap);
  EXPECT_EQ(a.free_extents(), 1u);
}

}  // namespace
}  // namespace strata::nvme
