// The Gloo communicator of the host device with several ranks. Each rank is a
// forked child process of the test (forked before any device or Gloo state
// exists, so the child starts single-threaded) that runs one scenario and
// exits with 0 or prints what went wrong and exits with 1. Every rank's input
// comes from (seed, rank, case), so each rank recomputes the reference from
// all ranks' inputs.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "src/common/status_util.h"
#include "src/gpu/comm_internal.h"
#include "src/gpu/device.h"
#include "src/gpu/host_kernels.h"
#include "src/gpu/tcp_store.h"
#include "tests/multi_rank.h"
#include "tests/test_util.h"

namespace strata::gpu::testing {
namespace {

using strata::testing::ExpectAllExitedZero;
using strata::testing::RankEnv;
using strata::testing::RankFailure;
using strata::testing::RunRanks;
using strata::testing::ScopedEnv;

constexpr DType kTypes[] = {DType::kFp32, DType::kFp16, DType::kBf16};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kAvg};

const char* Name(DType t) {
  return t == DType::kFp32 ? "fp32" : t == DType::kFp16 ? "fp16" : "bf16";
}
const char* Name(ReduceOp op) {
  return op == ReduceOp::kSum   ? "sum"
         : op == ReduceOp::kMax ? "max"
         : op == ReduceOp::kMin ? "min"
                                : "avg";
}

// `n` values of `type` (as fp32, exactly representable in `type`) for one
// rank and case: uniform in [-2, 2].
std::vector<float> Values(uint64_t seed, int rank, int which, size_t n, DType type) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(rank) * 7919u + which);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  if (type != DType::kFp32) {  // round to the type and back
    std::vector<uint16_t> h(n);
    host::Cast(v.data(), DType::kFp32, h.data(), type, n);
    host::Cast(h.data(), type, v.data(), DType::kFp32, n);
  }
  return v;
}

// fp32 values → bytes of `type`.
std::vector<uint8_t> Encode(const std::vector<float>& v, DType type) {
  std::vector<uint8_t> b(v.size() * DTypeSize(type));
  host::Cast(v.data(), DType::kFp32, b.data(), type, v.size());
  return b;
}
std::vector<float> Decode(const std::vector<uint8_t>& b, DType type) {
  std::vector<float> v(b.size() / DTypeSize(type));
  host::Cast(b.data(), type, v.data(), DType::kFp32, v.size());
  return v;
}

struct Ctx {
  std::unique_ptr<Device> device;
  std::unique_ptr<Communicator> comm;
  int rank, world;

  DeviceBuffer Upload(const std::vector<uint8_t>& bytes) {
    auto b = device->Allocate(std::max<size_t>(bytes.size(), 1));
    RANK_OK(b.status());
    if (!bytes.empty())
      RANK_OK(device->CopyH2D(b->data(), bytes.data(), bytes.size(), device->compute()));
    return std::move(*b);
  }
  std::vector<uint8_t> Download(const DeviceBuffer& b, size_t bytes) {
    std::vector<uint8_t> out(bytes);
    RANK_OK(device->CopyD2H(out.data(), b.data(), bytes, device->compute()));
    return out;
  }
};

constexpr double kConnectTimeoutS = 30;  // below RunRanks' 60 s limit: its own error first

Ctx Connect(const RankEnv& e, double deadlock_timeout_s = 30,
            std::shared_ptr<RendezvousStore> store = nullptr) {
  Ctx c;
  DeviceOptions d;
  d.kind = DeviceKind::kHost;
  d.hbm_budget_bytes = 64 << 20;
  d.host_deadlock_timeout_s = deadlock_timeout_s;
  auto dev = CreateDevice(d);
  RANK_OK(dev.status());
  c.device = std::move(*dev);
  CommOptions o;
  o.rank = e.rank;
  o.world_size = e.world;
  o.rendezvous_dir = e.dir;
  o.store = std::move(store);
  o.timeout_s = e.timeout_s;
  // Start-up gets its own, longer timeout: a short collective timeout must
  // not fail the rendezvous of ranks forked on a loaded machine.
  o.connect_timeout_s = kConnectTimeoutS;
  auto comm = CreateCommunicator(*c.device, o);
  RANK_OK(comm.status());
  c.comm = std::move(*comm);
  RANK_CHECK(c.comm->rank() == e.rank && c.comm->world_size() == e.world, "rank/world mismatch");
  c.rank = e.rank;
  c.world = e.world;
  return c;
}

// |got - want| within what fp32 reassociation and one rounding to `type` allow.
bool Close(float got, float want, float abs_sum, DType type) {
  const float rel = type == DType::kFp32 ? 1e-6f : type == DType::kFp16 ? 1.0f / 1024 : 1.0f / 128;
  return std::fabs(got - want) <= rel * abs_sum + 1e-6f;
}

// Every collective, every dtype, odd sizes, all issued back to back on the
// compute stream and checked after one Synchronize.
void CollectivesScenario(const RankEnv& e) {
  Ctx c = Connect(e);
  const uint64_t seed = 0x5eed;
  const int W = c.world, R = c.rank;
  const size_t sizes[] = {1, 3, 1001, 12347};
  int which = 0;
  for (size_t n : sizes) {
    for (DType t : kTypes) {
      const size_t es = DTypeSize(t);
      std::vector<std::function<void()>> checks;
      std::deque<DeviceBuffer> keep;  // stable addresses for the checks

      // AllGather (out of place and in place).
      for (int in_place = 0; in_place < 2; ++in_place) {
        const int id = which++;
        std::vector<float> mine = Values(seed, R, id, n, t);
        DeviceBuffer recv = c.Upload(std::vector<uint8_t>(n * es * W, 0xAB));
        const void* send;
        if (in_place) {
          RANK_OK(c.device->CopyH2D(static_cast<char*>(recv.data()) + R * n * es,
                                    Encode(mine, t).data(), n * es, c.device->compute()));
          send = static_cast<char*>(recv.data()) + R * n * es;
        } else {
          keep.push_back(c.Upload(Encode(mine, t)));
          send = keep.back().data();
        }
        RANK_OK(c.comm->AllGather(send, recv.data(), n, t, c.device->compute()));
        keep.push_back(std::move(recv));
        DeviceBuffer* out = &keep.back();
        checks.push_back([&c, out, n, t, es, W, id, seed, in_place] {
          std::vector<uint8_t> want;
          for (int r = 0; r < W; ++r) {
            auto b = Encode(Values(seed, r, id, n, t), t);
            want.insert(want.end(), b.begin(), b.end());
          }
          RANK_CHECK(c.Download(*out, n * es * W) == want, "AllGather n={} {} in_place={}", n,
                     Name(t), in_place);
        });
      }

      // Broadcast from a varying root.
      {
        const int id = which++;
        const int root = id % W;
        DeviceBuffer send = c.Upload(Encode(Values(seed, R, id, n, t), t));
        DeviceBuffer recv = c.Upload(std::vector<uint8_t>(n * es, 0xCD));
        RANK_OK(c.comm->Broadcast(send.data(), recv.data(), n, t, root, c.device->compute()));
        keep.push_back(std::move(send));
        keep.push_back(std::move(recv));
        DeviceBuffer* out = &keep.back();
        checks.push_back([&c, out, n, t, es, id, root, seed] {
          RANK_CHECK(c.Download(*out, n * es) == Encode(Values(seed, root, id, n, t), t),
                     "Broadcast n={} {} root={}", n, Name(t), root);
        });
      }

      // AllReduce (every op; sum also in place), ReduceScatter and Reduce
      // (every op; to a varying root, the others' recv untouched).
      for (ReduceOp op : kOps) {
        for (int kind = 0; kind < 4;
             ++kind) {  // 0 AllReduce, 1 AllReduce in place, 2 ReduceScatter, 3 Reduce
          if (kind == 1 && op != ReduceOp::kSum) continue;
          const int id = which++;
          const size_t in_n = kind == 2 ? n * W : n;
          DeviceBuffer send = c.Upload(Encode(Values(seed, R, id, in_n, t), t));
          DeviceBuffer recv =
              kind == 1 ? DeviceBuffer() : c.Upload(std::vector<uint8_t>(n * es, 0xEF));
          void* out_ptr = kind == 1 ? send.data() : recv.data();
          const int root = id % W;
          if (kind == 3)
            RANK_OK(c.comm->Reduce(send.data(), out_ptr, n, t, op, root, c.device->compute()));
          else if (kind == 2)
            RANK_OK(c.comm->ReduceScatter(send.data(), out_ptr, n, t, op, c.device->compute()));
          else
            RANK_OK(c.comm->AllReduce(send.data(), out_ptr, n, t, op, c.device->compute()));
          keep.push_back(std::move(send));
          DeviceBuffer* out = &keep.back();
          if (kind != 1) {
            keep.push_back(std::move(recv));
            out = &keep.back();
          }
          checks.push_back([&c, out, n, in_n, t, es, W, R, id, seed, op, kind, root] {
            if (kind == 3 && R != root) {
              RANK_CHECK(c.Download(*out, n * es) == std::vector<uint8_t>(n * es, 0xEF),
                         "Reduce {} n={} {}: rank {} (not the root {}) had its recv written",
                         Name(op), n, Name(t), R, root);
              return;
            }
            const size_t off = kind == 2 ? R * n : 0;
            std::vector<std::vector<float>> in(W);
            for (int r = 0; r < W; ++r) in[r] = Values(seed, r, id, in_n, t);
            const std::vector<float> got = Decode(c.Download(*out, n * es), t);
            for (size_t i = 0; i < n; ++i) {
              float acc = in[0][off + i], abs_sum = std::fabs(acc);
              for (int r = 1; r < W; ++r) {
                const float x = in[r][off + i];
                abs_sum += std::fabs(x);
                if (op == ReduceOp::kMax)
                  acc = std::max(acc, x);
                else if (op == ReduceOp::kMin)
                  acc = std::min(acc, x);
                else
                  acc += x;
              }
              if (op == ReduceOp::kAvg) {
                acc /= static_cast<float>(W);
                abs_sum /= static_cast<float>(W);
              }
              const bool exact = op == ReduceOp::kMax || op == ReduceOp::kMin;
              RANK_CHECK(exact ? got[i] == acc : Close(got[i], acc, abs_sum, t),
                         "{} {} n={} {} element {}: got {} want {}",
                         kind == 3   ? "Reduce"
                         : kind == 2 ? "ReduceScatter"
                         : kind == 1 ? "AllReduce(in place)"
                                     : "AllReduce",
                         Name(op), n, Name(t), i, got[i], acc);
            }
          });
        }
      }
      RANK_OK(c.device->compute().Synchronize());
      RANK_OK(c.comm->AsyncError());
      for (auto& check : checks) check();
    }
  }
  RANK_OK(c.comm->Barrier());
  // Every rank removed its rendezvous entry once all were connected.
  for (const auto& f : std::filesystem::recursive_directory_iterator(e.dir))
    RANK_CHECK(!f.is_regular_file(), "rendezvous entry left: {}", f.path().string());
}

TEST(GlooCommTest, EveryCollectiveAndDtypeTwoRanks) {
  ExpectAllExitedZero(RunRanks(2, CollectivesScenario));
}

TEST(GlooCommTest, EveryCollectiveAndDtypeFourRanks) {
  ExpectAllExitedZero(RunRanks(4, CollectivesScenario));
}

// A RendezvousStore the forked ranks share: one file per key in a
// directory (as a caller's store over any medium would be). Get polls.
class FileKeyStore final : public RendezvousStore {
 public:
  explicit FileKeyStore(std::string dir) : dir_(std::move(dir)) {}
  Status Set(const std::string& key, const std::string& value) override {
    const std::string path = Path(key), tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f << value;
    }
    ++sets_;
    return std::rename(tmp.c_str(), path.c_str()) == 0 ? Status::Ok()
                                                       : ErrnoError("rename " + tmp, errno);
  }
  StatusOr<std::string> Get(const std::string& key, double timeout_s) override {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (;;) {
      std::ifstream f(Path(key), std::ios::binary);
      if (f) return std::string(std::istreambuf_iterator<char>(f), {});
      if (std::chrono::steady_clock::now() > end)
        return UnavailableError("test store: no key " + key);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  Status Remove(const std::string& key) override {
    std::filesystem::remove(Path(key));
    ++removes_;
    return Status::Ok();
  }
  int sets_ = 0, removes_ = 0;

 private:
  std::string Path(const std::string& key) const {
    std::string k = key;
    for (char& ch : k)
      if (ch == '/') ch = '+';
    return dir_ + "/" + k;
  }
  const std::string dir_;
};

// Ranks that meet through a caller's store (CommOptions::store) and no
// rendezvous directory: two communicators one after the other (each under
// keys of its own), the collectives right, and every key a rank set
// removed once all had connected.
void StoreScenario(const RankEnv& e) {
  const std::string keys = e.dir + "/keys";
  std::filesystem::create_directories(keys);
  auto store = std::make_shared<FileKeyStore>(keys);
  RankEnv no_dir = e;
  no_dir.dir = e.dir + "/not-used";
  for (int round = 0; round < 2; ++round) {
    Ctx c = Connect(no_dir, 30, store);
    const size_t n = 1001;
    DeviceBuffer buf = c.Upload(Encode(Values(5, e.rank, round, n, DType::kFp32), DType::kFp32));
    RANK_OK(c.comm->AllReduce(buf.data(), buf.data(), n, DType::kFp32, ReduceOp::kMax,
                              c.device->compute()));
    RANK_OK(c.device->compute().Synchronize());
    RANK_OK(c.comm->AsyncError());
    const std::vector<float> got = Decode(c.Download(buf, n * 4), DType::kFp32);
    for (size_t i = 0; i < n; ++i) {
      float want = Values(5, 0, round, n, DType::kFp32)[i];
      for (int r = 1; r < e.world; ++r)
        want = std::max(want, Values(5, r, round, n, DType::kFp32)[i]);
      RANK_CHECK(got[i] == want, "round {} element {}: {} vs {}", round, i, got[i], want);
    }
    RANK_CHECK(store->sets_ > 0 && store->removes_ == store->sets_,
               "round {}: {} keys set, {} removed", round, store->sets_, store->removes_);
    RANK_OK(c.comm->Barrier());
  }
  RANK_CHECK(!std::filesystem::exists(no_dir.dir), "the rendezvous directory was made");
  for (const auto& f : std::filesystem::directory_iterator(keys))
    RANK_CHECK(false, "store key left: {}", f.path().filename().string());
}

TEST(GlooCommTest, RanksMeetThroughACallersStoreWithoutADirectory) {
  ExpectAllExitedZero(RunRanks(3, StoreScenario));
}

// Ranks given only MASTER_ADDR (not a loopback name) and MASTER_PORT meet
// through the TCP store rank 0 serves there (DefaultRendezvousStore), with
// no directory: the collectives are right.
TEST(GlooCommTest, RanksMeetThroughTheTcpStoreAtMasterAddr) {
  const int port = strata::testing::FreeLoopbackPort();
  ExpectAllExitedZero(RunRanks(2, [port](const RankEnv& e) {
    // 127.0.0.1 written as one number: another machine's address by name.
    setenv("MASTER_ADDR", "2130706433", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    unsetenv("STRATA_GLOO_DIR");
    CommOptions o;
    o.rank = e.rank;
    o.world_size = e.world;
    o.connect_timeout_s = kConnectTimeoutS;
    auto store = DefaultRendezvousStore(o);
    RANK_OK(store.status());
    RANK_CHECK(*store != nullptr, "no TCP store for a non-loopback MASTER_ADDR");
    RankEnv no_dir = e;
    no_dir.dir = e.dir + "/not-used";
    Ctx c = Connect(no_dir, 30, *store);
    const size_t n = 777;
    DeviceBuffer buf = c.Upload(Encode(Values(9, e.rank, 0, n, DType::kBf16), DType::kBf16));
    DeviceBuffer sum = c.Upload(std::vector<uint8_t>(n * 2));
    RANK_OK(c.comm->AllReduce(buf.data(), sum.data(), n, DType::kBf16, ReduceOp::kMax,
                              c.device->compute()));
    RANK_OK(c.device->compute().Synchronize());
    RANK_OK(c.comm->AsyncError());
    const std::vector<float> got = Decode(c.Download(sum, n * 2), DType::kBf16);
    for (size_t i = 0; i < n; ++i) {
      const float want =
          std::max(Values(9, 0, 0, n, DType::kBf16)[i], Values(9, 1, 0, n, DType::kBf16)[i]);
      RANK_CHECK(got[i] == want, "element {}: {} vs {}", i, got[i], want);
    }
    RANK_CHECK(!std::filesystem::exists(no_dir.dir), "the rendezvous directory was made");
    RANK_OK(c.comm->Barrier());
  }));
}

// Where a rank listens: the host given, the interface given (one that
// exists), 127.0.0.1 for a loopback MASTER_ADDR, and the address of the
// route to any other MASTER_ADDR; names that cannot work are refused.
TEST(GlooCommTest, ListenAddressFollowsTheRouteToTheMaster) {
  CommOptions o;
  o.listen_host = "192.0.2.7";
  auto at = internal::GlooListenAddress(o);
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_EQ(at->host, "192.0.2.7");
  o.listen_host.clear();
  o.listen_iface = "lo";
  at = internal::GlooListenAddress(o);
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_EQ(at->iface, "lo");
  EXPECT_EQ(at->Describe(), "interface lo");
  o.listen_iface = "no-such-if0";
  at = internal::GlooListenAddress(o);
  ASSERT_FALSE(at.ok());
  EXPECT_NE(std::string(at.status().message()).find("\"no-such-if0\""), std::string::npos)
      << at.status();
  o.listen_iface.clear();
  ScopedEnv master("MASTER_ADDR", "127.0.0.1");
  at = internal::GlooListenAddress(o);
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_EQ(at->host, "127.0.0.1");
  {
    ScopedEnv other("MASTER_ADDR", "localhost.invalid");
    at = internal::GlooListenAddress(o);
    ASSERT_FALSE(at.ok());
    EXPECT_NE(std::string(at.status().message()).find("MASTER_ADDR localhost.invalid"),
              std::string::npos)
        << at.status();
  }
  {
    // 127.0.0.1 written as one number: not loopback by its name, so the
    // route decides, and the route to it leaves from 127.0.0.1.
    ScopedEnv other("MASTER_ADDR", "2130706433");
    at = internal::GlooListenAddress(o);
    ASSERT_TRUE(at.ok()) << at.status();
    EXPECT_EQ(at->host, "127.0.0.1");
  }
  {
    ScopedEnv list("GLOO_SOCKET_IFNAME", "eth0,eth1");
    auto env = CommOptionsFromEnv();
    ASSERT_FALSE(env.ok());
    EXPECT_NE(std::string(env.status().message()).find("GLOO_SOCKET_IFNAME=\"eth0,eth1\""),
              std::string::npos)
        << env.status();
  }
  {
    ScopedEnv prefix("NCCL_SOCKET_IFNAME", "^docker");  // NCCL's syntax: ignored
    auto env = CommOptionsFromEnv();
    ASSERT_TRUE(env.ok()) << env.status();
    EXPECT_EQ(env->listen_iface, "");
  }
  {
    ScopedEnv exact("NCCL_SOCKET_IFNAME", "lo");
    auto env = CommOptionsFromEnv();
    ASSERT_TRUE(env.ok()) << env.status();
    EXPECT_EQ(env->listen_iface, "lo");
  }
}

// Rank world-1 stops taking part after one good collective: it dies by
// SIGKILL (`kill -9`), or it stalls (alive, connections open) past the
// timeout. Every other rank's next collective fails within the timeout with
// an error naming the collective, the rank and the timeout, and later calls
// fail at once with the same error.
// The host device's deadlock check is shorter than the collective timeout
// here (1 s against 3 s): a collective waiting for its peers is not a
// deadlock, so the error is the collective's.
void PeerLostScenario(const RankEnv& e, bool kill_it, double timeout_s) {
  Ctx c = Connect(e, /*deadlock_timeout_s=*/1.0);
  const size_t n = 4097;
  DeviceBuffer buf = c.Upload(Encode(Values(7, e.rank, 0, n, DType::kFp32), DType::kFp32));
  RANK_OK(c.comm->AllReduce(buf.data(), buf.data(), n, DType::kFp32, ReduceOp::kSum,
                            c.device->compute()));
  RANK_OK(c.device->compute().Synchronize());
  RANK_OK(c.comm->Barrier());
  if (e.rank == e.world - 1) {
    if (kill_it) raise(SIGKILL);  // kill -9 of this rank
    std::this_thread::sleep_for(std::chrono::duration<double>(timeout_s + 1.5));
    return;  // exits without taking part
  }
  const auto t0 = std::chrono::steady_clock::now();
  RANK_OK(c.comm->AllReduce(buf.data(), buf.data(), n, DType::kFp32, ReduceOp::kSum,
                            c.device->compute()));
  RANK_OK(c.device->compute().Synchronize());
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const Status s = c.comm->AsyncError();
  RANK_CHECK(!s.ok(), "the collective without its peer succeeded");
  const std::string m(s.message());
  RANK_CHECK(m.find("AllReduce (sum) of 4097 fp32 elements") != std::string::npos, "message: {}",
             m);
  RANK_CHECK(m.find(fmt::format("rank {} of {}", e.rank, e.world)) != std::string::npos,
             "message: {}", m);
  RANK_CHECK(m.find(fmt::format("timeout ({:g} s", timeout_s)) != std::string::npos, "message: {}",
             m);
  // The peers' addresses (all on loopback here) and how long it waited.
  RANK_CHECK(m.find(fmt::format("rank {} at 127.0.0.1", e.world - 1)) != std::string::npos,
             "message: {}", m);
  RANK_CHECK(m.find(fmt::format("rank {} of {} (127.0.0.1)", e.rank, e.world)) != std::string::npos,
             "message: {}", m);
  RANK_CHECK(m.find(" failed after ") != std::string::npos, "message: {}", m);
  // A bound on the failure, not a performance figure: the timeout plus
  // slack for a loaded 2-core machine.
  RANK_CHECK(waited < timeout_s + 5, "failed after {:.1f} s", waited);
  // Sticky: later calls fail at once with the same error.
  const Status again =
      c.comm->AllGather(buf.data(), buf.data(), 1, DType::kFp32, c.device->compute());
  RANK_CHECK(again == s, "later call: {}", again.ToString());
  RANK_CHECK(c.comm->Barrier() == s, "Barrier after the failure");
}

constexpr double kShortTimeoutS = 3;

TEST(GlooCommTest, AFailedCollectiveNamesThePeerGlooNames) {
  const std::vector<std::string> hosts = {"10.0.0.1", "10.0.0.2", "10.0.0.3 (eth1)"};
  EXPECT_EQ(gpu::internal::NamePeer(hosts, 0, "Read timeout [10.0.0.3]:41234"),
            "rank 2 at 10.0.0.3 (eth1)");
  EXPECT_EQ(gpu::internal::NamePeer(hosts, 2, "Connection closed by peer [10.0.0.1]:5"),
            "rank 0 at 10.0.0.1");
  // No address in the message, or one every peer shares: all are listed.
  EXPECT_EQ(gpu::internal::NamePeer(hosts, 1, "Timed out"),
            "a peer rank (rank 0 at 10.0.0.1, rank 2 at 10.0.0.3 (eth1))");
  const std::vector<std::string> local(3, "127.0.0.1");
  EXPECT_EQ(gpu::internal::NamePeer(local, 0, "Read timeout [127.0.0.1]:7"),
            "a peer rank (rank 1 at 127.0.0.1, rank 2 at 127.0.0.1)");
  // Its own address is never the peer's.
  EXPECT_EQ(gpu::internal::NamePeer(hosts, 1, "Read timeout [10.0.0.2]:7"),
            "a peer rank (rank 0 at 10.0.0.1, rank 2 at 10.0.0.3 (eth1))");
  // Two ranks: the other one, whatever Gloo says.
  EXPECT_EQ(gpu::internal::NamePeer({"a", "b"}, 1, "Timed out"), "rank 0 at a");
  const std::vector<std::string> many(12, "h");
  EXPECT_NE(gpu::internal::NamePeer(many, 0, "x").find("rank 8 at h, ...)"), std::string::npos);
}

TEST(GlooCommTest, KilledPeerFailsTheOthersWithinTheTimeout) {
  constexpr int kWorld = 4;
  auto status = RunRanks(
      kWorld, [](const RankEnv& e) { PeerLostScenario(e, /*kill_it=*/true, kShortTimeoutS); },
      kShortTimeoutS, 40);
  for (int r = 0; r < kWorld - 1; ++r)
    EXPECT_TRUE(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0) << "rank " << r;
  EXPECT_TRUE(WIFSIGNALED(status[kWorld - 1]) && WTERMSIG(status[kWorld - 1]) == SIGKILL);
}

TEST(GlooCommTest, StalledPeerFailsTheOthersWithinTheTimeout) {
  ExpectAllExitedZero(RunRanks(
      3, [](const RankEnv& e) { PeerLostScenario(e, /*kill_it=*/false, kShortTimeoutS); },
      kShortTimeoutS, 40));
}

// A rank slower than the host device's deadlock check (0.5 s here), well
// within the collective timeout, ends nothing: the others wait for it and
// every rank gets the sum.
void SlowPeerScenario(const RankEnv& e) {
  Ctx c = Connect(e, /*deadlock_timeout_s=*/0.5);
  const size_t n = 1000;
  std::vector<float> mine = Values(11, e.rank, 0, n, DType::kFp32);
  DeviceBuffer buf = c.Upload(Encode(mine, DType::kFp32));
  if (e.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  RANK_OK(c.comm->AllReduce(buf.data(), buf.data(), n, DType::kFp32, ReduceOp::kSum,
                            c.device->compute()));
  RANK_OK(c.device->compute().Synchronize());
  RANK_OK(c.comm->AsyncError());
  const std::vector<float> got = Decode(c.Download(buf, n * 4), DType::kFp32);
  std::vector<float> sum(n, 0.0f);
  for (int r = 0; r < e.world; ++r) {
    const std::vector<float> v = Values(11, r, 0, n, DType::kFp32);
    for (size_t i = 0; i < n; ++i) sum[i] += v[i];
  }
  for (size_t i = 0; i < n; ++i) {
    const float want = sum[i];
    RANK_CHECK(std::fabs(got[i] - want) <= 1e-5f * (1 + std::fabs(want)), "element {}: {} vs {}", i,
               got[i], want);
  }
  // A reduce-scatter waits as long: its peer is slower than the rendezvous'
  // per-pair timeout (a fifth of a 10 s attempt here), which Gloo's own
  // reduce-scatter algorithm kept for its reads.
  DeviceBuffer half = c.Upload(std::vector<uint8_t>(n / 2 * 4, 0));
  if (e.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  RANK_OK(c.comm->ReduceScatter(buf.data(), half.data(), n / 2, DType::kFp32, ReduceOp::kSum,
                                c.device->compute()));
  RANK_OK(c.device->compute().Synchronize());
  RANK_OK(c.comm->AsyncError());
  const std::vector<float> mine_half = Decode(c.Download(half, n / 2 * 4), DType::kFp32);
  for (size_t i = 0; i < n / 2; ++i) {
    const float want = 2 * got[e.rank * (n / 2) + i];
    RANK_CHECK(mine_half[i] == want, "reduce-scatter element {}: {} vs {}", i, mine_half[i], want);
  }
}

TEST(GlooCommTest, SlowPeerIsWaitedForNotTakenForADeadlock) {
  ExpectAllExitedZero(RunRanks(2, SlowPeerScenario));
}

// A rank whose peers never come fails the rendezvous within its timeout,
// naming the directory.
TEST(GlooCommTest, MissingPeerFailsTheRendezvous) {
  strata::testing::ScratchDir dir("strata-gloo-test");
  DeviceOptions d;
  d.kind = DeviceKind::kHost;
  d.hbm_budget_bytes = 1 << 20;
  auto dev = CreateDevice(d).value();
  CommOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.rendezvous_dir = dir.str();
  o.timeout_s = 0.5;
  auto comm = CreateCommunicator(*dev, o);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(std::string(comm.status().message()).find(dir.str()), std::string::npos)
      << comm.status();
  EXPECT_NE(std::string(comm.status().message()).find("within 0.5 s"), std::string::npos)
      << comm.status();
  // connect_timeout_s, when set, bounds the rendezvous instead (timeout_s
  // is the collectives').
  o.timeout_s = 600;
  o.connect_timeout_s = 0.25;
  const auto t0 = std::chrono::steady_clock::now();
  comm = CreateCommunicator(*dev, o);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(std::string(comm.status().message()).find("within 0.25 s"), std::string::npos)
      << comm.status();
  EXPECT_LT(waited, 300) << "the rendezvous waited for timeout_s, not connect_timeout_s";
}

// The rendezvous directory names the peers every rank connects to: one that
// other users may write (group/other-writable) or a symlink is refused
// before anything is read from it, naming it.
TEST(GlooCommTest, ARendezvousDirectoryOthersControlIsRefused) {
  strata::testing::ScratchDir dir("strata-gloo-test");
  DeviceOptions d;
  d.kind = DeviceKind::kHost;
  d.hbm_budget_bytes = 1 << 20;
  auto dev = CreateDevice(d).value();
  const std::string open_dir = dir.str() + "/open", link = dir.str() + "/link";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(chmod(open_dir.c_str(), 0777), 0);
  ASSERT_EQ(symlink(open_dir.c_str(), link.c_str()), 0);
  for (const std::string& path : {open_dir, link}) {
    CommOptions o;
    o.rank = 0;
    o.world_size = 2;
    o.rendezvous_dir = path;
    o.timeout_s = 0.5;
    auto comm = CreateCommunicator(*dev, o);
    ASSERT_FALSE(comm.ok()) << path;
    EXPECT_EQ(comm.status().code(), StatusCode::kIOError) << comm.status();
    EXPECT_NE(std::string(comm.status().message()).find("STRATA_GLOO_DIR " + path),
              std::string::npos)
        << comm.status();
  }
  // Nothing was written into it.
  EXPECT_TRUE(std::filesystem::is_empty(open_dir));
  // A missing one is created for this user alone.
  CommOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.rendezvous_dir = dir.str() + "/new";
  o.timeout_s = 0.2;
  EXPECT_FALSE(CreateCommunicator(*dev, o).ok());  // (no peer comes)
  struct stat st {};
  ASSERT_EQ(stat(o.rendezvous_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

// Loopback TCP ports in LISTEN state whose socket is one of `inodes`, from
// /proc/net/tcp.
std::set<int> ListeningLoopbackPorts(const std::set<std::string>& inodes) {
  std::set<int> ports;
  std::ifstream f("/proc/net/tcp");
  std::string line;
  std::getline(f, line);  // header
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
    in >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >>
        inode;
    const size_t colon = local.find(':');
    if (state != "0A" || colon == std::string::npos) continue;  // 0A: LISTEN
    if (local.substr(0, colon) != "0100007F") continue;         // 127.0.0.1
    if (!inodes.count(inode)) continue;
    ports.insert(std::stoi(local.substr(colon + 1), nullptr, 16));
  }
  return ports;
}

// The other processes this process's parent forked (RunRanks' ranks).
std::vector<pid_t> SiblingPids() {
  std::vector<pid_t> pids;
  const pid_t parent = getppid(), self = getpid();
  for (const auto& d : std::filesystem::directory_iterator("/proc")) {
    const std::string name = d.path().filename();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    if (pid == self) continue;
    std::ifstream f(d.path() / "stat");
    std::string stat;
    if (!std::getline(f, stat)) continue;
    const size_t close = stat.rfind(')');  // after "pid (comm)": state, then ppid
    if (close == std::string::npos) continue;
    std::istringstream in(stat.substr(close + 1));
    std::string state;
    long ppid = 0;
    if (in >> state >> ppid && ppid == parent) pids.push_back(pid);
  }
  return pids;
}

// The inodes of the sockets `pids` hold ("socket:[N]" file descriptors).
std::set<std::string> SocketInodes(const std::vector<pid_t>& pids) {
  std::set<std::string> inodes;
  for (pid_t pid : pids) {
    std::error_code ec;
    for (const auto& fd :
         std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid), ec)) {
      const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
      if (!ec && target.rfind("socket:[", 0) == 0)
        inodes.insert(target.substr(8, target.size() - 9));
    }
  }
  return inodes;
}

// A hostile client on loopback: every loopback port the other ranks of this
// test start listening on (never another process's: tests run side by side)
// gets connections that send junk and close, and one that stays open and
// silent, for `seconds`.
void JunkClient(double seconds) {
  const std::vector<pid_t> ranks = SiblingPids();
  std::set<int> hit;
  std::vector<int> silent;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    for (int port : ListeningLoopbackPorts(SocketInodes(ranks))) {
      if (hit.count(port)) continue;
      hit.insert(port);
      for (int k = 0; k < 3; ++k) {
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(static_cast<uint16_t>(port));
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
          close(fd);
          continue;
        }
        if (k == 2) {  // connected and silent
          silent.push_back(fd);
          continue;
        }
        const std::string junk(k == 0 ? 8 : 4096, k == 0 ? '\x7f' : 'z');
        [[maybe_unused]] ssize_t w = send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
        close(fd);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int fd : silent) close(fd);
  std::fprintf(stderr, "junk client: %zu ports of %zu ranks hit\n", hit.size(), ranks.size());
  RANK_CHECK(ranks.size() == 2 && !hit.empty(), "the junk client found {} ranks and hit {} ports",
             ranks.size(), hit.size());
}

// Junk on the rendezvous ports during start-up is not fatal: two ranks (a
// third process is the junk client, started with them) still connect, prove
// to each other that they read the rendezvous directory, and reduce.
// Rank 1 comes late, so rank 0's listening sockets wait for it in the open.
TEST(GlooCommTest, JunkOnTheRendezvousPortsIsDroppedNotFatal) {
  ExpectAllExitedZero(RunRanks(
      3,
      [](const RankEnv& e) {
        if (e.rank == 2) {
          JunkClient(5);
          return;
        }
        RankEnv two = e;
        two.world = 2;
        if (e.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
        Ctx c = Connect(two);
        const size_t n = 1000;
        DeviceBuffer buf = c.Upload(Encode(Values(3, e.rank, 0, n, DType::kFp32), DType::kFp32));
        RANK_OK(c.comm->AllReduce(buf.data(), buf.data(), n, DType::kFp32, ReduceOp::kSum,
                                  c.device->compute()));
        RANK_OK(c.device->compute().Synchronize());
        const std::vector<float> got = Decode(c.Download(buf, n * 4), DType::kFp32);
        for (size_t i = 0; i < n; ++i) {
          const float want =
              Values(3, 0, 0, n, DType::kFp32)[i] + Values(3, 1, 0, n, DType::kFp32)[i];
          RANK_CHECK(std::fabs(got[i] - want) <= 1e-5f * (std::fabs(want) + 1),
                     "element {}: {} vs {}", i, got[i], want);
        }
      },
      20, 60));
}

TEST(GlooCommTest, BadOptionsAreRefusedNamingTheVariable) {
  DeviceOptions d;
  d.kind = DeviceKind::kHost;
  d.hbm_budget_bytes = 1 << 20;
  auto dev = CreateDevice(d).value();
  CommOptions o;
  o.world_size = 4;
  o.rank = 4;
  auto comm = CreateCommunicator(*dev, o);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(comm.status().message()).find("CommOptions.rank (RANK) is 4"),
            std::string::npos)
      << comm.status();
  o.rank = 0;
  o.timeout_s = 0;
  comm = CreateCommunicator(*dev, o);
  ASSERT_FALSE(comm.ok());
  EXPECT_NE(std::string(comm.status().message()).find("timeout_s"), std::string::npos)
      << comm.status();
  o.timeout_s = 10;
  o.connect_timeout_s = -1;
  comm = CreateCommunicator(*dev, o);
  ASSERT_FALSE(comm.ok());
  EXPECT_NE(std::string(comm.status().message()).find("connect_timeout_s -1"), std::string::npos)
      << comm.status();

  setenv("STRATA_COMM_CONNECT_TIMEOUT_S", "-3", 1);
  auto bad_connect = CommOptionsFromEnv();
  unsetenv("STRATA_COMM_CONNECT_TIMEOUT_S");
  ASSERT_FALSE(bad_connect.ok());
  EXPECT_NE(
      std::string(bad_connect.status().message()).find("STRATA_COMM_CONNECT_TIMEOUT_S=\"-3\""),
      std::string::npos)
      << bad_connect.status();
  setenv("STRATA_COMM_TIMEOUT_S", "soon", 1);
  auto env = CommOptionsFromEnv();
  unsetenv("STRATA_COMM_TIMEOUT_S");
  ASSERT_FALSE(env.ok());
  EXPECT_NE(std::string(env.status().message()).find("STRATA_COMM_TIMEOUT_S"), std::string::npos)
      << env.status();
  setenv("STRATA_GLOO_DIR", "/some/dir", 1);
  setenv("STRATA_COMM_TIMEOUT_S", "2.5", 1);
  env = CommOptionsFromEnv();
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->connect_timeout_s, 0);  // unset: the rendezvous takes timeout_s
  setenv("STRATA_COMM_CONNECT_TIMEOUT_S", "120", 1);
  env = CommOptionsFromEnv();
  unsetenv("STRATA_GLOO_DIR");
  unsetenv("STRATA_COMM_TIMEOUT_S");
  unsetenv("STRATA_COMM_CONNECT_TIMEOUT_S");
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rendezvous_dir, "/some/dir");
  EXPECT_EQ(env->timeout_s, 2.5);
  EXPECT_EQ(env->connect_timeout_s, 120);
}

// `strata bench comm --nproc 2` starts two ranks itself and rank 0 prints
// JSON with every field, positive figures, and nccl-tests' bus bandwidth
// factors (the test checks the fields and formulas, not the speeds).
TEST(GlooCommBenchTest, StrataBenchCommTwoRanksJson) {
  const std::string cmd = std::string(STRATA_CLI_PATH) +
                          " bench comm --nproc 2 --device host --sizes 4K,12345 --reps 1 "
                          "--min-bytes 0 --timeout 20 --json";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t got;
  while ((got = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, got);
  const int st = pclose(p);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << cmd << "\n" << out;
  const auto j = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j.at("world_size"), 2);
  EXPECT_EQ(j.at("backend"), "gloo");
  EXPECT_EQ(j.at("dtype"), "fp32");
  ASSERT_EQ(j.at("sizes").size(), 2u) << out;
  // 12345 rounds down to a multiple of 2 ranks x 4 bytes.
  EXPECT_EQ(j["sizes"][0].at("bytes"), 4096);
  EXPECT_EQ(j["sizes"][1].at("bytes"), 12344);
  for (const auto& pt : j["sizes"]) {
    EXPECT_GT(pt.at("copy").at("gbytes_per_s").get<double>(), 0) << "the baseline copy";
    for (const char* c : {"all_gather", "reduce_scatter", "all_reduce"}) {
      const auto& r = pt.at(c);
      const double t = r.at("time_us"), alg = r.at("algbw_gbytes_per_s"),
                   bus = r.at("busbw_gbytes_per_s");
      EXPECT_GT(t, 0) << c;
      EXPECT_GT(alg, 0) << c;
      EXPECT_NEAR(alg, pt.at("bytes").get<double>() / (t * 1e-6) / 1e9, 1e-9 * alg + 1e-12) << c;
      // n = 2: (n-1)/n = 0.5, 2(n-1)/n = 1.
      EXPECT_NEAR(bus, alg * (std::string(c) == "all_reduce" ? 1.0 : 0.5), 1e-12 * alg) << c;
    }
  }
}

}  // namespace
}  // namespace strata::gpu::testing
