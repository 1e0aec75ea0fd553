// SwapStore: striped round trips, byte ranges, shards larger than any buffer,
// extent reuse, cleanup, and every refusal (missing, read-only, not a
// directory, not enough space, full store, truncated underneath).
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "src/nvme/nvme.h"
#include "tests/nvme/nvme_test_util.h"

namespace strata::nvme {
namespace {

using strata::testing::MakeRng;
using strata::testing::ScratchDir;
using namespace strata::nvme::testing;

class SwapStoreTest : public ::testing::TestWithParam<EngineKind> {
 protected:
  void SetUp() override {
    SKIP_IF_NO_URING(GetParam());
    rng_ = MakeRng(&seed_);
    auto s = IoService::Create(SmallOptions(GetParam(), 16 << 10, 8));
    ASSERT_TRUE(s.ok()) << s.status();
    io_ = std::move(s).value();
  }
  std::unique_ptr<SwapStore> Open(std::vector<std::string> paths, uint64_t cap, uint64_t stripe = 16 << 10) {
    SwapStoreOptions o;
    o.paths = std::move(paths);
    o.capacity_bytes = cap;
    o.stripe_unit = stripe;
    auto s = SwapStore::Open(o, io_.get());
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  std::unique_ptr<IoService> io_;
};

TEST_P(SwapStoreTest, StripedRoundTripOverThreeDirectories) {
  SCOPED_TRACE(seed_);
  ScratchDir a("strata-swap-a"), b("strata-swap-b"), c("strata-swap-c");
  auto store = Open({a.str(), b.str(), c.str()}, 8 << 20);
  ASSERT_NE(store, nullptr);
  ASSERT_EQ(store->swap_files().size(), 3u);
  // Odd sizes: below one stripe, a few stripes with a ragged end, many stripes.
  const uint64_t sizes[] = {1, 5000, 16 << 10, (16 << 10) * 7 + 123, (1 << 20) + 4097};
  std::vector<AlignedBuffer> src;
  for (size_t i = 0; i < std::size(sizes); ++i) {
    ASSERT_TRUE(store->Allocate("s" + std::to_string(i), sizes[i]).ok());
    src.push_back(RandomBuffer(rng_, sizes[i]));
  }
  std::vector<IoHandle> hs;
  for (size_t i = 0; i < std::size(sizes); ++i)
    hs.push_back(store->Write("s" + std::to_string(i), 0, src[i].data(), sizes[i]));
  ASSERT_TRUE(WaitAll(hs).ok());
  for (size_t i = 0; i < std::size(sizes); ++i) {
    auto dst = PoisonBuffer(sizes[i]);
    Status s = store->Read("s" + std::to_string(i), 0, dst.data(), sizes[i]).Wait();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(SameBytes(src[i].data(), dst.data(), sizes[i])) << "shard " << i;
  }
  // The big shard really is spread: every swap file holds some of it.
  for (const auto& path : store->swap_files()) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> head(16 << 10);
    in.read(head.data(), head.size());
    bool nonzero = false;
    for (char ch : head) nonzero |= ch != 0;
    EXPECT_TRUE(nonzero) << path << " got no data";
  }
}

TEST_P(SwapStoreTest, ByteRangesAndShardLargerThanAnyBuffer) {
  SCOPED_TRACE(seed_);
  ScratchDir a("strata-swap-a"), b("strata-swap-b");
  auto store = Open({a.str(), b.str()}, 16 << 20);
  ASSERT_NE(store, nullptr);
  const uint64_t shard = (6 << 20) + 12345;
  ASSERT_TRUE(store->Allocate("big", shard).ok());
  auto whole = RandomBuffer(rng_, shard);
  // Write it through a 1 MiB + 3 "pool" buffer, range by range (DeepSpeed #3506).
  const size_t chunk = (1 << 20) + 3;
  auto pool = PoisonBuffer(chunk);
  for (uint64_t off = 0; off < shard; off += chunk) {
    size_t n = std::min<uint64_t>(chunk, shard - off);
    std::memcpy(pool.data(), whole.as<char>() + off, n);
    Status s = store->Write("big", off, pool.data(), n).Wait();
    ASSERT_TRUE(s.ok()) << s;
  }
  // Read back random ranges, odd offsets and lengths included.
  std::uniform_int_distribution<uint64_t> pick(0, shard - 1);
  for (int i = 0; i < 20; ++i) {
    uint64_t off = pick(rng_);
    size_t n = std::min<uint64_t>(shard - off, 1 + pick(rng_) % (300 << 10));
    auto dst = PoisonBuffer(n);
    Status s = store->Read("big", off, dst.data(), n).Wait();
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(SameBytes(whole.as<char>() + off, dst.data(), n)) << "range " << off << "+" << n;
  }
  auto dst = PoisonBuffer(shard);
  ASSERT_TRUE(store->Read("big", 0, dst.data(), shard).Wait().ok());
  EXPECT_TRUE(SameBytes(whole.data(), dst.data(), shard));
  // Outside the shard: OutOfRange, nothing submitted.
  Status s = store->Read("big", shard - 10, dst.data(), 11).Wait();
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_EQ(store->Read("nope", 0, dst.data(), 1).Wait().code(), StatusCode::kNotFound);
}

TEST_P(SwapStoreTest, ExtentsAreReusedAndFullStoreIsRefused) {
  ScratchDir a("strata-swap-a");
  auto store = Open({a.str()}, 1 << 20);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->capacity(), 1u << 20);
  ASSERT_TRUE(store->Allocate("x", 600 << 10).ok());
  Status full = store->Allocate("y", 600 << 10);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("614400"), std::string::npos) << full;  // bytes asked
  EXPECT_EQ(store->Allocate("x", 10).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(store->Free("x").ok());
  EXPECT_EQ(store->Free("x").code(), StatusCode::kNotFound);
  EXPECT_EQ(store->free_bytes(), 1u << 20);
  ASSERT_TRUE(store->Allocate("y", 600 << 10).ok());
  auto src = RandomBuffer(rng_, 600 << 10);
  auto dst = PoisonBuffer(600 << 10);
  ASSERT_TRUE(store->Write("y", 0, src.data(), 600 << 10).Wait().ok());
  ASSERT_TRUE(store->Read("y", 0, dst.data(), 600 << 10).Wait().ok());
  EXPECT_TRUE(SameBytes(src.data(), dst.data(), 600 << 10));
  EXPECT_EQ(store->num_shards(), 1u);
}

TEST_P(SwapStoreTest, CloseRemovesSwapFiles) {
  ScratchDir a("strata-swap-a"), b("strata-swap-b");
  std::vector<std::string> files;
  {
    auto store = Open({a.str(), b.str()}, 2 << 20);
    ASSERT_NE(store, nullptr);
    files = store->swap_files();
    for (auto& f : files) {
      EXPECT_TRUE(std::filesystem::exists(f));
      EXPECT_GE(std::filesystem::file_size(f), 1u << 20) << "preallocated";
    }
    ASSERT_TRUE(store->Close().ok());
    for (auto& f : files) EXPECT_FALSE(std::filesystem::exists(f)) << f;
    EXPECT_EQ(store->Allocate("late", 10).code(), StatusCode::kFailedPrecondition);
    char b1[1];
    EXPECT_EQ(store->Read("late", 0, b1, 1).Wait().code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(store->Close().ok());
  }
  {
    auto store = Open({a.str()}, 1 << 20);  // destructor alone also cleans up
    ASSERT_NE(store, nullptr);
    files = store->swap_files();
  }
  for (auto& f : files) EXPECT_FALSE(std::filesystem::exists(f)) << f;
}

TEST_P(SwapStoreTest, RefusesBadPathsWithClearErrors) {
  ScratchDir a("strata-swap-a");
  SwapStoreOptions o;
  o.capacity_bytes = 1 << 20;
  o.paths = {a.str() + "/missing"};
  auto s = SwapStore::Open(o, io_.get());
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound) << s.status();
  EXPECT_NE(s.status().message().find(a.str() + "/missing"), std::string::npos);

  std::string file = a.str() + "/plain-file";
  std::ofstream(file) << "x";
  o.paths = {file};
  s = SwapStore::Open(o, io_.get());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << s.status();
  EXPECT_NE(s.status().message().find("not a directory"), std::string::npos) << s.status();

  o.paths = {a.str(), a.str()};
  EXPECT_EQ(SwapStore::Open(o, io_.get()).status().code(), StatusCode::kInvalidArgument);

  o.paths = {};
  EXPECT_EQ(SwapStore::Open(o, io_.get()).status().code(), StatusCode::kInvalidArgument);
}

TEST_P(SwapStoreTest, RefusesReadOnlyDirectory) {
  ScratchDir a("strata-swap-ro");
  std::string ro = a.str();
  if (geteuid() == 0) {
    // root ignores mode bits; sysfs refuses file creation even to root.
    if (access("/sys/kernel", F_OK) != 0) GTEST_SKIP() << "running as root and /sys is absent";
    ro = "/sys/kernel";
  } else {
    ASSERT_EQ(chmod(ro.c_str(), 0555), 0);
  }
  SwapStoreOptions o;
  o.capacity_bytes = 1 << 20;
  o.paths = {ro};
  auto s = SwapStore::Open(o, io_.get());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find(ro), std::string::npos) << s.status();
  if (geteuid() != 0) chmod(ro.c_str(), 0755);
}

TEST_P(SwapStoreTest, RefusesWithoutEnoughSpaceNamingRequiredAndAvailable) {
  ScratchDir a("strata-swap-a");
  SwapStoreOptions o;
  o.paths = {a.str()};
  o.capacity_bytes = uint64_t{1} << 60;  // an exabyte
  auto s = SwapStore::Open(o, io_.get());
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().message().find(std::to_string(uint64_t{1} << 60)), std::string::npos) << s.status();
  EXPECT_NE(s.status().message().find("available"), std::string::npos) << s.status();
  EXPECT_TRUE(std::filesystem::is_empty(a.path())) << "no swap file may be left behind";
}

TEST_P(SwapStoreTest, TruncatedSwapFileIsAnErrorNotStaleBytes) {
  SCOPED_TRACE(seed_);
  ScratchDir a("strata-swap-a");
  auto store = Open({a.str()}, 4 << 20);
  ASSERT_NE(store, nullptr);
  const uint64_t n = 3 << 20;
  ASSERT_TRUE(store->Allocate("w", n).ok());
  auto src = RandomBuffer(rng_, n);
  ASSERT_TRUE(store->Write("w", 0, src.data(), n).Wait().ok());
  ASSERT_EQ(truncate(store->swap_files()[0].c_str(), 1 << 20), 0);
  auto dst = PoisonBuffer(n);
  Status s = store->Read("w", 0, dst.data(), n).Wait();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(store->swap_files()[0]), std::string::npos) << s;
  // What could be read is right; the rest was never filled with stale bytes.
  EXPECT_TRUE(SameBytes(src.data(), dst.data(), 1 << 20));
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapStoreTest,
                         ::testing::Values(EngineKind::kUring, EngineKind::kPosix), EngineParamName);

}  // namespace
}  // namespace strata::nvme
