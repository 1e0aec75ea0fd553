// Communicator: torchrun environment parsing, the unique-id exchange, the
// one-rank local communicator on the host device, and (with a GPU and NCCL)
// one-rank NCCL collectives. Several ranks on the host device (Gloo):
// gloo_comm_test.cc.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "src/gpu/comm_internal.h"
#include "src/gpu/device.h"
#include "tests/gpu/device_test_util.h"
#include "tests/test_util.h"

namespace strata::gpu::testing {
namespace {

// Sets environment variables for one scope, restoring the old values.
class ScopedEnv {
 public:
  void Set(const char* name, const char* value) {
    const char* old = std::getenv(name);
    saved_.push_back({name, old ? std::optional<std::string>(old) : std::nullopt});
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second)
        setenv(it->first.c_str(), it->second->c_str(), 1);
      else
        unsetenv(it->first.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(CommOptionsTest, FromTorchrunEnvironment) {
  ScopedEnv env;
  env.Set("RANK", "3");
  env.Set("WORLD_SIZE", "8");
  env.Set("LOCAL_RANK", "1");
  env.Set("MASTER_ADDR", "node7");
  env.Set("MASTER_PORT", "29500");
  auto o = CommOptionsFromEnv();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rank, 3);
  EXPECT_EQ(o->world_size, 8);
  EXPECT_EQ(o->local_rank, 1);
  EXPECT_EQ(o->unique_id_file, "/tmp/strata-nccl-node7-29500.id");
  env.Set("RANK", "8");
  auto bad = CommOptionsFromEnv();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("RANK=8"), std::string::npos);
  env.Set("RANK", "x1");
  bad = CommOptionsFromEnv();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("RANK"), std::string::npos);
}

TEST(CommOptionsTest, UnsetMeansOneRank) {
  ScopedEnv env;
  env.Set("RANK", nullptr);
  env.Set("WORLD_SIZE", nullptr);
  env.Set("LOCAL_RANK", nullptr);
  auto o = CommOptionsFromEnv();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rank, 0);
  EXPECT_EQ(o->world_size, 1);
}

TEST(UniqueIdTest, FileRoundTripTimeoutAndHexEnv) {
  strata::testing::ScratchDir dir;
  const std::string path = dir.str() + "/id";
  internal::UniqueId id{};
  auto rng = strata::testing::MakeRng();
  for (auto& c : id) c = static_cast<char>(rng());
  // A reader that starts before the writer waits for it.
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_OK(internal::WriteUniqueId(path, id));
  });
  auto got = internal::ReadUniqueId(path, 30);
  writer.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, id);
  auto missing = internal::ReadUniqueId(dir.str() + "/nope", 0.05);
  EXPECT_EQ(missing.status().code(), StatusCode::kUnavailable);

  ScopedEnv env;
  env.Set("STRATA_NCCL_UNIQUE_ID", internal::UniqueIdToHex(id).c_str());
  auto from_env = internal::UniqueIdFromEnv();
  ASSERT_TRUE(from_env.ok()) << from_env.status();
  ASSERT_TRUE(from_env->has_value());
  EXPECT_EQ(**from_env, id);
  env.Set("STRATA_NCCL_UNIQUE_ID", "abc");
  EXPECT_EQ(internal::UniqueIdFromEnv().status().code(), StatusCode::kInvalidArgument);
  std::string junk(256, 'z');
  env.Set("STRATA_NCCL_UNIQUE_ID", junk.c_str());
  EXPECT_EQ(internal::UniqueIdFromEnv().status().code(), StatusCode::kInvalidArgument);
}

// libnccl is opened at the first NCCL communicator, not linked: a library
// that is not there is a Status naming it and dlerror(), no exit 127 from
// the loader before main.
TEST(NcclLibraryTest, MissingLibraryIsUnavailableNamingIt) {
  const Status s = internal::ProbeNcclLibrary("libnccl-strata-no-such.so.2");
  if (!internal::HaveNccl()) {
    EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s;
    return;
  }
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  const std::string msg(s.message());
  EXPECT_NE(msg.find("NCCL could not be loaded"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dlopen(\"libnccl-strata-no-such.so.2\")"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cannot open shared object file"), std::string::npos) << msg;
}

// Where this build has NCCL, the library it was built against loads and has
// every function the backend binds (a GPU is not needed for that).
TEST(NcclLibraryTest, InstalledLibraryLoadsAndBinds) {
  if (!internal::HaveNccl()) GTEST_SKIP() << "this build has no NCCL";
  EXPECT_OK(internal::LoadNcclLibrary());
  EXPECT_OK(internal::ProbeNcclLibrary("libnccl.so.2"));
}

template <typename B>
using CommTest = DeviceTest<B>;
TYPED_TEST_SUITE(CommTest, Backends);

// One rank: every collective leaves recv equal to send (on CUDA this runs
// NCCL when the build has it).
TYPED_TEST(CommTest, OneRankCollectivesOnAStream) {
  Device& d = this->dev();
  CommOptions o;
  o.unique_id_file = "/tmp/strata-comm-test-unused.id";
  auto comm = CreateCommunicator(d, o);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->world_size(), 1);
  auto rng = strata::testing::MakeRng();
  const auto f = strata::testing::RandomFloats(rng, 1001);
  auto send = d.Allocate(f.size() * 4).value();
  auto recv = d.Allocate(f.size() * 4).value();
  ASSERT_OK(d.CopyH2D(send.data(), f.data(), f.size() * 4, d.compute()));
  std::vector<float> out(f.size());
  auto check = [&](const char* what) {
    ASSERT_OK(d.CopyD2H(out.data(), recv.data(), out.size() * 4, d.compute()));
    ASSERT_OK(d.compute().Synchronize());
    EXPECT_EQ(out, f) << what;
    ASSERT_OK(d.FillInt32(recv.as<int32_t>(), f.size(), 0, d.compute()));
  };
  Communicator& c = **comm;
  ASSERT_OK(
      c.AllReduce(send.data(), recv.data(), f.size(), DType::kFp32, ReduceOp::kSum, d.compute()));
  check("AllReduce");
  ASSERT_OK(c.AllGather(send.data(), recv.data(), f.size(), DType::kFp32, d.compute()));
  check("AllGather");
  ASSERT_OK(c.ReduceScatter(send.data(), recv.data(), f.size(), DType::kFp32, ReduceOp::kAvg,
                            d.compute()));
  check("ReduceScatter");
  ASSERT_OK(
      c.Reduce(send.data(), recv.data(), f.size(), DType::kFp32, ReduceOp::kSum, 0, d.compute()));
  check("Reduce");
  EXPECT_EQ(
      c.Reduce(send.data(), recv.data(), f.size(), DType::kFp32, ReduceOp::kSum, 1, d.compute())
          .code(),
      StatusCode::kInvalidArgument);
  ASSERT_OK(c.Broadcast(send.data(), recv.data(), f.size(), DType::kFp32, 0, d.compute()));
  check("Broadcast");
  EXPECT_EQ(c.Broadcast(send.data(), recv.data(), f.size(), DType::kFp32, 1, d.compute()).code(),
            StatusCode::kInvalidArgument);
  std::vector<float> host(10);
  EXPECT_EQ(
      c.AllReduce(host.data(), recv.data(), 10, DType::kFp32, ReduceOp::kSum, d.compute()).code(),
      StatusCode::kInvalidArgument);
}

// Several ranks on the host device use Gloo: tests/gpu/gloo_comm_test.cc.
TEST(CommHostTest, RankOutsideTheWorldIsRefused) {
  DeviceOptions opt;
  opt.kind = DeviceKind::kHost;
  opt.hbm_budget_bytes = 1 << 20;
  auto d = CreateDevice(opt).value();
  CommOptions o;
  o.world_size = 2;
  o.rank = 2;
  EXPECT_EQ(CreateCommunicator(*d, o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::gpu::testing
