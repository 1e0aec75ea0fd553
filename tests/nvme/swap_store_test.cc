// SwapStore: striped round trips, byte ranges, shards larger than any buffer,
// extent reuse, cleanup, and every refusal (missing, read-only, not a
// directory, not enough space, full store, truncated underneath). Ownership:
// unique exclusive names, locks, leftovers of killed runs removed, live files
// of other runs left alone, a failed delete reported.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

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
  std::unique_ptr<SwapStore> Open(std::vector<std::string> paths, uint64_t cap,
                                  uint64_t stripe = 16 << 10) {
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
  // Write it through a 1 MiB + 3 "pool" buffer, range by range (the case of
  // github.com/microsoft/DeepSpeed/issues/3506).
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
  EXPECT_NE(s.status().message().find(std::to_string(uint64_t{1} << 60)), std::string::npos)
      << s.status();
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

// The swap file's name carries a random token and the pid; the file is locked
// while the store lives, and ListSwapFiles reports it live.
TEST_P(SwapStoreTest, SwapFileIsUniquelyNamedAndLockedForTheStoresLife) {
  ScratchDir a("strata-swap-a");
  auto s1 = Open({a.str()}, 1 << 20);
  auto s2 = Open({a.str()}, 1 << 20);
  ASSERT_NE(s1, nullptr);
  ASSERT_NE(s2, nullptr);
  const std::string f1 = s1->swap_files()[0], f2 = s2->swap_files()[0];
  EXPECT_NE(f1, f2);
  const std::string name = std::filesystem::path(f1).filename();
  EXPECT_TRUE(IsSwapFileName(name)) << name;
  // strata-swap-<16 hex>-<pid>-<n>.bin
  const std::string pid = "-" + std::to_string(getpid()) + "-";
  EXPECT_NE(name.find(pid), std::string::npos) << name;
  EXPECT_EQ(name.find(pid), std::string("strata-swap-").size() + 16) << name;
  // Another open file description cannot take the lock.
  int fd = open(f1.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_NE(flock(fd, LOCK_EX | LOCK_NB), 0);
  EXPECT_EQ(errno, EWOULDBLOCK);
  close(fd);
  auto list = ListSwapFiles(a.str());
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 2u);
  for (const SwapFileEntry& e : *list) {
    EXPECT_TRUE(e.live) << e.path;
    EXPECT_GE(e.size, 1u << 20) << e.path;
  }
  ASSERT_TRUE(s1->Close().ok());
  list = ListSwapFiles(a.str());
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].path, f2);
}

// A child process opens a store and is killed with SIGKILL: its swap file
// stays behind, unlocked. The next store on the directory removes it with a
// notice naming the path and size; `ListSwapFiles` saw it as a leftover.
TEST_P(SwapStoreTest, LeftoverOfAKilledProcessIsRemovedAtOpenWithANotice) {
  ScratchDir a("strata-swap-a");
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(fds[0]);
    auto io = IoService::Create(SmallOptions(EngineKind::kPosix));
    if (!io.ok()) _exit(3);
    SwapStoreOptions o;
    o.paths = {a.str()};
    o.capacity_bytes = 2 << 20;
    o.stripe_unit = 16 << 10;
    auto store = SwapStore::Open(o, io->get());
    if (!store.ok()) _exit(4);
    const std::string path = (*store)->swap_files()[0] + "\n";
    if (write(fds[1], path.data(), path.size()) != static_cast<ssize_t>(path.size())) _exit(5);
    pause();  // until killed
    _exit(6);
  }
  close(fds[1]);
  std::string path;
  char c;
  while (read(fds[0], &c, 1) == 1 && c != '\n') path += c;
  close(fds[0]);
  ASSERT_FALSE(path.empty()) << "the child could not open a store";
  // Live while the child runs: a new store leaves it alone.
  {
    auto other = Open({a.str()}, 1 << 20);
    ASSERT_NE(other, nullptr);
    EXPECT_TRUE(std::filesystem::exists(path));
  }
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  ASSERT_TRUE(std::filesystem::exists(path)) << "SIGKILL leaves the file behind";
  auto list = ListSwapFiles(a.str());
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].path, path);
  EXPECT_FALSE((*list)[0].live);
  const uint64_t size = (*list)[0].size;
  EXPECT_GE(size, 2u << 20);
  EXPECT_GE((*list)[0].age_s, 0.0);

  LogCapture log;
  auto store = Open({a.str()}, 1 << 20);
  ASSERT_NE(store, nullptr);
  EXPECT_FALSE(std::filesystem::exists(path));
  const std::string text = log.text();
  EXPECT_NE(
      text.find("removed leftover swap file " + path + " (" + std::to_string(size) + " bytes"),
      std::string::npos)
      << text;
  EXPECT_EQ(LogCapture::Count(text, "removed leftover"), 1u) << text;
}

// Two processes on one directory at once, each with its own store: each
// works in its own file, neither removes nor disturbs the other's.
TEST_P(SwapStoreTest, TwoProcessesOnOneDirectoryEachWorkInTheirOwnFile) {
  ScratchDir a("strata-swap-a");
  auto store = Open({a.str()}, 4 << 20);
  ASSERT_NE(store, nullptr);
  const uint64_t n = 3 << 20;
  ASSERT_TRUE(store->Allocate("x", n).ok());
  auto mine = RandomBuffer(rng_, n);
  ASSERT_TRUE(store->Write("x", 0, mine.data(), n).Wait().ok());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child's own store on the same directory, other bytes in the same
    // shard name and range.
    auto io = IoService::Create(SmallOptions(EngineKind::kPosix));
    if (!io.ok()) _exit(3);
    SwapStoreOptions o;
    o.paths = {a.str()};
    o.capacity_bytes = 4 << 20;
    o.stripe_unit = 16 << 10;
    auto s = SwapStore::Open(o, io->get());
    if (!s.ok()) _exit(4);
    std::mt19937_64 rng(7);
    auto theirs = RandomBuffer(rng, n);
    auto back = PoisonBuffer(n);
    if (!(*s)->Allocate("x", n).ok()) _exit(5);
    if (!(*s)->Write("x", 0, theirs.data(), n).Wait().ok()) _exit(6);
    if (!(*s)->Read("x", 0, back.data(), n).Wait().ok()) _exit(7);
    const bool same = SameBytes(theirs.data(), back.data(), n);
    if (!(*s)->Close().ok()) _exit(9);  // _exit runs no destructor
    _exit(same ? 0 : 8);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(std::filesystem::exists(store->swap_files()[0]));
  auto back = PoisonBuffer(n);
  ASSERT_TRUE(store->Read("x", 0, back.data(), n).Wait().ok());
  EXPECT_TRUE(SameBytes(mine.data(), back.data(), n));
  auto list = ListSwapFiles(a.str());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), 1u) << "the child removed its own file at close";
}

// A file of the older scheme (strata-swap-<pid>-<n>.bin, never locked) is a
// leftover; other files in the directory are not touched.
TEST_P(SwapStoreTest, OlderSchemeFileIsALeftoverOtherFilesAreKept) {
  ScratchDir a("strata-swap-a");
  const std::string old_file = a.str() + "/strata-swap-1-0.bin";
  const std::string other = a.str() + "/strata-swap-notes.txt";
  { std::ofstream(old_file) << std::string(5000, 'x'); }
  { std::ofstream(other) << "keep"; }
  auto removed = RemoveLeftoverSwapFiles(a.str());
  ASSERT_TRUE(removed.ok()) << removed.status();
  ASSERT_EQ(removed->size(), 1u);
  EXPECT_EQ((*removed)[0].path, old_file);
  EXPECT_FALSE(std::filesystem::exists(old_file));
  EXPECT_TRUE(std::filesystem::exists(other));
  EXPECT_FALSE(ListSwapFiles(a.str() + "/missing").ok());
}

// A swap file removed underneath the store: Close reports it (Status and a
// warning naming the path and errno) instead of ignoring it.
TEST_P(SwapStoreTest, FailedDeleteAtCloseIsReported) {
  ScratchDir a("strata-swap-a");
  auto store = Open({a.str()}, 1 << 20);
  ASSERT_NE(store, nullptr);
  const std::string f = store->swap_files()[0];
  ASSERT_EQ(unlink(f.c_str()), 0);
  LogCapture log;
  Status s = store->Close();
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find(f), std::string::npos) << s;
  const std::string text = log.text();
  EXPECT_NE(text.find("cannot remove swap file " + f), std::string::npos) << text;
  EXPECT_NE(text.find("errno 2"), std::string::npos) << text;
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapStoreTest,
                         ::testing::Values(EngineKind::kUring, EngineKind::kPosix),
                         EngineParamName);

}  // namespace
}  // namespace strata::nvme
