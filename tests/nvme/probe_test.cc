// Probes, engine selection (io_uring refused → POSIX, warned once), O_DIRECT
// refusal (tmpfs → buffered, warned once), options from the config.
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <filesystem>
#include <sstream>

#include "src/common/log.h"
#include "src/nvme/internal.h"
#include "src/nvme/nvme.h"
#include "tests/nvme/nvme_test_util.h"

namespace strata::nvme {
namespace {

using strata::testing::MakeRng;
using strata::testing::ScratchDir;
using namespace strata::nvme::testing;

TEST(ProbeTest, UringProbeReportsAvailabilityOrTheReason) {
  UringProbe p = ProbeUring();
  if (p.available) {
    EXPECT_TRUE(p.error.ok());
    EXPECT_NE(p.features, 0u);
  } else {
    EXPECT_FALSE(p.error.ok());
    EXPECT_NE(p.error.message().find("io_uring"), std::string::npos) << p.error;
  }
}

TEST(ProbeTest, SelectEngineFallsBackToPosixWhenUringIsRefused) {
  UringProbe refused;
  refused.available = false;
  refused.error = ErrnoError("io_uring_queue_init", EPERM);
  LogCapture log;
  auto sel = SelectEngine(EngineKind::kAuto, refused);
  ASSERT_TRUE(sel.ok()) << sel.status();
  EXPECT_EQ(sel->kind, EngineKind::kPosix);
  EXPECT_TRUE(sel->fell_back);
  EXPECT_NE(sel->reason.find("io_uring_queue_init"), std::string::npos);
  auto again = SelectEngine(EngineKind::kAuto, refused);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->kind, EngineKind::kPosix);
  // Warned at most once in the process, and the key is spent.
  EXPECT_LE(LogCapture::Count(log.text(), "using the POSIX pread/pwrite engine"), 1u) << log.text();
  EXPECT_FALSE(FirstTimeFor(kWarnUringFallback));

  // Forced uring on a refusing kernel is an error naming the reason.
  auto forced = SelectEngine(EngineKind::kUring, refused);
  EXPECT_EQ(forced.status().code(), StatusCode::kNotSupported);
  EXPECT_NE(forced.status().message().find("io_uring_queue_init"), std::string::npos);
  // Forced posix and available uring.
  EXPECT_EQ(SelectEngine(EngineKind::kPosix, refused)->kind, EngineKind::kPosix);
  UringProbe ok;
  ok.available = true;
  EXPECT_EQ(SelectEngine(EngineKind::kAuto, ok)->kind, EngineKind::kUring);
  EXPECT_FALSE(SelectEngine(EngineKind::kAuto, ok)->fell_back);
}

TEST(ProbeTest, DirectIoProbeOnDiskDirectory) {
  ScratchDir d("strata-dio");
  auto p = ProbeDirectIo(d.str());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GE(p->logical_block_size, 512u);
  EXPECT_EQ(p->logical_block_size & (p->logical_block_size - 1), 0u);
  EXPECT_FALSE(p->block_size_source.empty());
  if (!p->direct_supported)
    GTEST_SKIP() << "scratch filesystem refuses O_DIRECT: " << p->direct_error;
  EXPECT_TRUE(std::filesystem::is_empty(d.path())) << "probe file left behind";
}

TEST(ProbeTest, DirectIoProbeRejectsBadDirectories) {
  ScratchDir d("strata-dio");
  EXPECT_EQ(ProbeDirectIo(d.str() + "/missing").status().code(), StatusCode::kNotFound);
}

// Round trip through a swap store in `dir` with every engine; every piece
// must go through the buffered descriptor and one warning be printed.
void ExpectBufferedFallback(const std::string& dir) {
  uint64_t seed;
  auto rng = MakeRng(&seed);
  SCOPED_TRACE(seed);
  LogCapture log;
  for (EngineKind kind : {EngineKind::kPosix, EngineKind::kUring}) {
    if (kind == EngineKind::kUring && !UringAvailable()) continue;
    auto io = IoService::Create(SmallOptions(kind));
    ASSERT_TRUE(io.ok());
    SwapStoreOptions o;
    o.paths = {dir};
    o.capacity_bytes = 1 << 20;
    o.stripe_unit = 16 << 10;
    auto store = SwapStore::Open(o, io->get());
    ASSERT_TRUE(store.ok()) << store.status();
    const size_t n = (300 << 10) + 77;
    ASSERT_TRUE((*store)->Allocate("t", n).ok());
    auto src = RandomBuffer(rng, n);
    auto dst = PoisonBuffer(n);
    ASSERT_TRUE((*store)->Write("t", 0, src.data(), n).Wait().ok());
    ASSERT_TRUE((*store)->Read("t", 0, dst.data(), n).Wait().ok());
    EXPECT_TRUE(SameBytes(src.data(), dst.data(), n));
    auto st = (*io)->stats();
    EXPECT_EQ(st.direct_pieces, 0u);
    EXPECT_GT(st.buffered_pieces, 0u);
  }
  EXPECT_LE(LogCapture::Count(log.text(), "refuses O_DIRECT"), 1u) << log.text();
  EXPECT_FALSE(FirstTimeFor(std::string(kWarnBufferedFallbackPrefix) + dir))
      << "the fallback warning was never issued";
}

TEST(ProbeTest, TmpfsRefusesODirectAndFallsBackToBuffered) {
  if (!std::filesystem::is_directory("/dev/shm")) GTEST_SKIP() << "/dev/shm is absent";
  auto p = ProbeDirectIo("/dev/shm");
  ASSERT_TRUE(p.ok()) << p.status();
  if (p->direct_supported)
    GTEST_SKIP() << "/dev/shm accepts O_DIRECT (tmpfs does since Linux 6.6); "
                    "RefusedODirectFallsBackToBuffered covers the path";
  EXPECT_EQ(p->direct_error.code(), StatusCode::kInvalidArgument) << p->direct_error;
  std::string dir = "/dev/shm/strata-nvme-test-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  ExpectBufferedFallback(dir);
  std::filesystem::remove_all(dir);
}

int RefuseDirect(const char*, int) {
  errno = EINVAL;  // what tmpfs before 6.6, and some FUSE/NFS setups, answer
  return -1;
}

TEST(ProbeTest, RefusedODirectFallsBackToBuffered) {
  ScratchDir d("strata-nodirect");
  internal::SetDirectOpenForTest(&RefuseDirect);
  ExpectBufferedFallback(d.str());
  internal::SetDirectOpenForTest(nullptr);
}

TEST(OptionsTest, FromConfigAndValidation) {
  Config c;
  c.aio.block_size = 262144;
  c.aio.queue_depth = 32;
  c.aio.intra_op_parallelism = 2;
  c.aio.single_submit = true;
  c.strata.io_engine = IoEngineKind::kPosix;
  c.strata.io_sqpoll = true;
  IoOptions o = IoOptionsFromConfig(c);
  EXPECT_EQ(o.block_size, 262144u);
  EXPECT_EQ(o.queue_depth, 32);
  EXPECT_EQ(o.threads, 2);
  EXPECT_TRUE(o.single_submit);
  EXPECT_TRUE(o.sqpoll);
  EXPECT_EQ(o.engine, EngineKind::kPosix);
  EXPECT_TRUE(ValidateIoOptions(o).ok());
  o.block_size = 1000;
  Status s = ValidateIoOptions(o);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("aio.block_size"), std::string::npos);
  o.block_size = 4096;
  o.queue_depth = 0;
  EXPECT_NE(ValidateIoOptions(o).message().find("aio.queue_depth"), std::string::npos);
  EXPECT_EQ(IoService::Create(o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseEngineKind("io_uring"), EngineKind::kUring);
  EXPECT_EQ(ParseEngineKind("spdk").status().code(), StatusCode::kInvalidArgument);
}

TEST(OptionsTest, SqpollAndSingleSubmitRoundTrip) {
  if (!UringAvailable()) GTEST_SKIP() << "io_uring refused: " << ProbeUring().error;
  uint64_t seed;
  auto rng = MakeRng(&seed);
  SCOPED_TRACE(seed);
  ScratchDir d("strata-sq");
  for (bool sqpoll : {false, true}) {
    IoOptions o = SmallOptions(EngineKind::kUring, 8 << 10, 4, 2);
    o.sqpoll = sqpoll;
    o.single_submit = !sqpoll;
    auto io = IoService::Create(o);
    ASSERT_TRUE(io.ok()) << io.status();
    OpenOptions oo;
    oo.create = true;
    auto f = (*io)->Open(d.str() + "/f.bin", oo);
    ASSERT_TRUE(f.ok());
    const size_t n = (100 << 10) + 5;
    auto src = RandomBuffer(rng, n);
    auto dst = PoisonBuffer(n);
    ASSERT_TRUE((*io)->Write(f->get(), src.data(), n, 4096).Wait().ok());
    ASSERT_TRUE((*io)->Read(f->get(), dst.data(), n, 4096).Wait().ok());
    EXPECT_TRUE(SameBytes(src.data(), dst.data(), n));
  }
}

}  // namespace
}  // namespace strata::nvme
