// Arena: budget enforcement, best fit, coalescing, statistics — CPU only
// (the arena never touches the memory it manages).
#include "src/gpu/arena.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "tests/test_util.h"

namespace strata::gpu {
namespace {

// A fake base address: the arena only does arithmetic on it.
void* FakeBase() { return reinterpret_cast<void*>(uintptr_t{1} << 40); }

TEST(ArenaTest, BudgetIsHardAndErrorNamesTheNumbers) {
  Arena a(FakeBase(), 1 << 20, "HBM arena (test)");
  auto p1 = a.Allocate(600 << 10);
  ASSERT_TRUE(p1.ok()) << p1.status();
  auto p2 = a.Allocate(500 << 10);
  ASSERT_FALSE(p2.ok());
  EXPECT_EQ(p2.status().code(), StatusCode::kResourceExhausted);
  const std::string msg(p2.status().message());
  EXPECT_NE(msg.find("HBM arena (test)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("512000 bytes"), std::string::npos) << msg;   // asked
  EXPECT_NE(msg.find("614400 bytes"), std::string::npos) << msg;   // in use
  EXPECT_NE(msg.find("1048576 bytes"), std::string::npos) << msg;  // budget
  ArenaStats s = a.Stats();
  EXPECT_EQ(s.in_use_bytes, 600u << 10);
  EXPECT_EQ(s.failed_allocations, 1u);
  EXPECT_EQ(s.allocations, 1u);
  // Far past the budget (overflow-safe).
  EXPECT_EQ(a.Allocate(SIZE_MAX).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(a.Allocate(0).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(a.Free(*p1).ok());
  EXPECT_TRUE(a.Allocate(1 << 20).ok());  // the whole budget fits again
}

TEST(ArenaTest, HighWaterAndReset) {
  Arena a(FakeBase(), 1 << 20, "a");
  void* x = a.Allocate(1000).value();  // rounds to 1024
  void* y = a.Allocate(256).value();
  EXPECT_EQ(a.Stats().in_use_bytes, 1280u);
  EXPECT_EQ(a.Stats().high_water_bytes, 1280u);
  ASSERT_TRUE(a.Free(x).ok());
  EXPECT_EQ(a.Stats().in_use_bytes, 256u);
  EXPECT_EQ(a.Stats().high_water_bytes, 1280u);
  a.ResetHighWater();
  EXPECT_EQ(a.Stats().high_water_bytes, 256u);
  ASSERT_TRUE(a.Free(y).ok());
  EXPECT_EQ(a.Stats().total_allocations, 2u);
}

TEST(ArenaTest, UnknownFreeIsAnErrorAndChangesNothing) {
  Arena a(FakeBase(), 1 << 20, "a");
  void* x = a.Allocate(4096).value();
  EXPECT_EQ(a.Free(static_cast<char*>(x) + 256).code(), StatusCode::kInternal);
  EXPECT_EQ(a.Free(reinterpret_cast<void*>(16)).code(), StatusCode::kInternal);
  ASSERT_TRUE(a.Free(x).ok());
  EXPECT_EQ(a.Free(x).code(), StatusCode::kInternal);  // double free
  EXPECT_EQ(a.Stats().largest_free_bytes, 1u << 20);
}

TEST(ArenaTest, FragmentationIsReported) {
  Arena a(FakeBase(), 4096, "a");
  std::vector<void*> v;
  for (int i = 0; i < 16; ++i) v.push_back(a.Allocate(256).value());
  for (int i = 0; i < 16; i += 2) ASSERT_TRUE(a.Free(v[i]).ok());
  auto r = a.Allocate(512);  // 2048 free, but in 256-byte holes
  ASSERT_FALSE(r.ok());
  EXPECT_NE(std::string(r.status().message()).find("fragmented"), std::string::npos);
  EXPECT_EQ(a.Stats().largest_free_bytes, 256u);
}

TEST(ArenaTest, RandomAllocFreeKeepsBlocksDisjointAndCoalesces) {
  uint64_t seed;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE(seed);
  const size_t budget = 8 << 20;
  Arena a(FakeBase(), budget, "a");
  std::map<uintptr_t, size_t> live;  // address → rounded size
  std::uniform_int_distribution<size_t> size_dist(1, 256 << 10);
  for (int step = 0; step < 20000; ++step) {
    if (!live.empty() && (rng() % 3 == 0 || live.size() > 60)) {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(a.Free(reinterpret_cast<void*>(it->first)).ok());
      live.erase(it);
    } else {
      const size_t n = size_dist(rng);
      auto p = a.Allocate(n);
      if (!p.ok()) {
        ASSERT_EQ(p.status().code(), StatusCode::kResourceExhausted);
        continue;
      }
      const uintptr_t u = reinterpret_cast<uintptr_t>(*p);
      ASSERT_EQ(u % Arena::kAlign, 0u);
      ASSERT_TRUE(a.Contains(*p, n));
      // Disjoint from its neighbours.
      auto next = live.lower_bound(u);
      if (next != live.end()) {
        ASSERT_LE(u + n, next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, u);
      }
      live[u] = (n + 255) / 256 * 256;
    }
    size_t sum = 0;
    for (auto& [k, v] : live) sum += v;
    ASSERT_EQ(a.Stats().in_use_bytes, sum);
  }
  for (auto& [k, v] : live) ASSERT_TRUE(a.Free(reinterpret_cast<void*>(k)).ok());
  // Everything coalesced back into one block.
  EXPECT_EQ(a.Stats().largest_free_bytes, budget);
  EXPECT_EQ(a.Stats().in_use_bytes, 0u);
}

TEST(ArenaTest, ContainsChecksTheWholeRange) {
  Arena a(FakeBase(), 1 << 20, "a");
  char* b = static_cast<char*>(FakeBase());
  EXPECT_TRUE(a.Contains(b, 1 << 20));
  EXPECT_FALSE(a.Contains(b, (1 << 20) + 1));
  EXPECT_FALSE(a.Contains(b + 1, 1 << 20));
  EXPECT_FALSE(a.Contains(b - 1, 1));
  EXPECT_FALSE(a.Contains(nullptr, 0));
  EXPECT_TRUE(a.Contains(b + (1 << 20) - 1, 1));
}

}  // namespace
}  // namespace strata::gpu
