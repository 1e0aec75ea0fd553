// Data-parallel ZeRO on the host device: 2 and 4 ranks as processes (Gloo
// over loopback) training the toy model, against one rank accumulating the
// same micro-batches. Rank r of W trains batch s*W + r at step s; the
// reference trains batches s*W .. s*W + W-1 as W micro-batches of step s,
// each gradient scaled by 1/W (a framework's loss / gradient_accumulation_steps),
// so both apply the mean gradient of the same global batch.
#include "src/scheduler/data_parallel.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "src/gpu/device.h"
#include "src/nvme/nvme.h"
#include "src/scheduler/checkpoint.h"
#include "src/scheduler/host_array.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/scheduler.h"
#include "tests/multi_rank.h"
#include "tests/scheduler/toy_engine_model.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using testing::RankEnv;
using testing::RunRanks;
using testing::ToyConfig;

constexpr int kModules = 6;
constexpr int kSteps = 3;

// torchrun's variables for rank e.rank of e.world (or none: one rank).
void SetRankEnv(const RankEnv& e, bool data_parallel) {
  if (!data_parallel) {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"})
      unsetenv(v);
    return;
  }
  setenv("RANK", std::to_string(e.rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(e.world).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(e.rank).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29500", 1);
  setenv("STRATA_GLOO_DIR", (e.dir + "/gloo").c_str(), 1);
  setenv("STRATA_COMM_TIMEOUT_S", fmt::format("{}", e.timeout_s).c_str(), 1);
  // Start-up may take longer than a short collective timeout on a loaded machine.
  setenv("STRATA_COMM_CONNECT_TIMEOUT_S", "30", 1);  // below RunRanks' 60 s limit
}

// The toy's numel, module 3's weight `extra` elements longer.
int64_t Numel(int m, int i, int64_t extra) {
  return testing::ToyNumel(m, i) + (m == 3 && i == 0 ? extra : 0);
}

// A data-parallel rank's environment and its NVMe directory (made).
std::string DataParallelRank(const RankEnv& e) {
  SetRankEnv(e, true);
  const std::string nvme = e.dir + "/nvme";
  std::filesystem::create_directories(nvme);
  return nvme;
}

// One micro-batch of the toy model: g = scale (0.5 p + 0.1 sin(batch + 0.37 j + m)).
// Module `skip` (if any) takes no part.
void MicroBatch(Engine& e, int batch, float scale, int64_t extra = 0, int skip = -1) {
  for (int m = 0; m < kModules; ++m) {
    if (m == skip) continue;
    auto v = e.BeforeForward(m);
    RANK_OK(v.status());
    RANK_OK(e.AfterForward(m));
  }
  for (int m = kModules - 1; m >= 0; --m) {
    if (m == skip) continue;
    auto v = e.BeforeBackward(m);
    RANK_OK(v.status());
    for (int i = 0; i < 2; ++i) {
      const DType t = testing::ToyDType(m, i);
      for (int64_t j = 0; j < Numel(m, i, extra); ++j) {
        const float p = testing::Load(v->params[static_cast<size_t>(i)], t, j);
        float g = scale * (0.5f * p + 0.1f * std::sin(static_cast<float>(batch) + 0.37f * j + m));
        // Module 3's extra elements: magnitudes over 2^±20, so that the sum
        // of squares rounds and its grouping shows.
        if (extra > 0 && m == 3 && i == 0 && j >= testing::ToyNumel(3, 0))
          g = std::ldexp(g, static_cast<int>(j % 41) - 20);
        testing::Store(v->grads[static_cast<size_t>(i)], t, j, g);
      }
    }
    RANK_OK(e.AfterBackward(m));
  }
}

struct Shape {
  OffloadDevice opt = OffloadDevice::kCpu;
  OffloadDevice par = OffloadDevice::kNone;
  int stage = 2;
  double clipping = 0;
  int64_t extra = 0;           // more elements in module 3's weight
  int64_t sub_group_size = 0;  // 0: the toy's (1000)
  // offload_optimizer none through the device optimizer (as on a GPU).
  bool device_optimizer = false;
  bool overlap_comm = false;          // zero_optimization.overlap_comm
  bool delayed = false;               // strata.delayed_param_update
  bool grads_on_nvme = false;         // strata.grad_tier nvme
  bool refetch = false;               // stage3_max_reuse_distance 0: backward fetches again
  int64_t allgather_bucket_size = 0;  // 0: DeepSpeed's default
  int skip_step = -1;                 // the step whose micro-batches leave module 2 out
  int steps = kSteps;
  int gas = 1;               // micro-batches per rank a step (the reference: W x gas)
  bool device_sums = false;  // strata.grad_accumulator device (copied into a pinned accumulator)
  // stage3_param_persistence_threshold (0: the toy's, 100): modules below it
  // stay on the device once fetched (partitioned: gathered once a step).
  int64_t persistence_threshold = 0;
  OptimizerStates states = OptimizerStates::kFp32;  // strata.optimizer_states
};

// Stage 3 with offload_param `par`: the parameters partitioned too.
Shape Partitioned(OffloadDevice par) {
  Shape s;
  s.par = par;
  s.stage = 3;
  return s;
}

// Each offload_param device at stage 3: the parameters partitioned in host
// memory (cpu), device memory (none) and on NVMe (nvme).
void ForEachPartitionedPlace(const std::function<void(const Shape&)>& run) {
  for (const OffloadDevice par :
       {OffloadDevice::kCpu, OffloadDevice::kNone, OffloadDevice::kNvme}) {
    SCOPED_TRACE(OffloadDeviceName(par));
    run(Partitioned(par));
  }
}

StatusOr<std::unique_ptr<Engine>> CreateFor(const Shape& s, const Config& c) {
  EngineTestHooks hooks;
  hooks.device_optimizer = s.device_optimizer;
  return CreateEngine(c, hooks);
}

Config ShapeConfig(const Shape& s, const std::string& dir, int gas) {
  Config c = ToyConfig(s.opt, s.par, dir);
  if (s.sub_group_size > 0) c.zero_optimization.sub_group_size = s.sub_group_size;
  if (s.extra > 0) c.strata.hbm_budget_bytes = 64 << 20;
  c.zero_optimization.stage = s.stage;
  c.zero_optimization.overlap_comm = s.overlap_comm;
  c.strata.delayed_param_update = s.delayed;
  c.strata.optimizer_states = s.states;
  if (s.grads_on_nvme) c.strata.grad_tier = GradTier::kNvme;
  if (s.device_sums) c.strata.grad_accumulator = GradAccumulatorPlace::kDevice;
  if (s.refetch) c.zero_optimization.stage3_max_reuse_distance = 0;
  if (s.persistence_threshold > 0)
    c.zero_optimization.stage3_param_persistence_threshold = s.persistence_threshold;
  // (Gathers of at most 2000 bytes per rank, within the staging chunk of
  // the toy's reduce_bucket_size, 500 fp32.)
  c.zero_optimization.allgather_bucket_size =
      s.allgather_bucket_size > 0 ? s.allgather_bucket_size : 1000;
  c.gradient_accumulation_steps = gas;
  c.train_batch_size = gas * DataParallelRanks();  // the global batch
  c.gradient_clipping = s.clipping;
  return c;
}

// What a run leaves for the parent: every parameter (rank order of
// registration), the last step's gradient norm, and the needed bytes per tier.
void WriteResult(const std::string& path, Engine& e, double grad_norm, int64_t extra) {
  std::ofstream f(path, std::ios::binary);
  for (int id = 0; id < e.num_parameters(); ++id) {
    std::vector<float> v(static_cast<size_t>(Numel(id / 2, id % 2, extra)));
    RANK_OK(e.ReadParameter(id, v));  // a collective with several ranks
    f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  }
  f.write(reinterpret_cast<const char*>(&grad_norm), sizeof grad_norm);
  for (const TierBudget& b : e.Budgets()) f << b.tier << ' ' << b.needed_bytes << '\n';
  for (const TierBudget& b : e.Budgets()) f << "detail " << b.tier << ' ' << b.detail << '\n';
  RANK_CHECK(f.good(), "writing {}", path);
}

struct Result {
  std::vector<float> params;
  double grad_norm = 0;
  std::map<std::string, int64_t> needed;
  std::map<std::string, std::string> detail;  // what each tier's row is made of
};

Result ReadResult(const std::string& path, int64_t extra) {
  Result r;
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  int64_t n = 0;
  for (int m = 0; m < kModules; ++m)
    for (int i = 0; i < 2; ++i) n += Numel(m, i, extra);
  r.params.resize(static_cast<size_t>(n));
  f.read(reinterpret_cast<char*>(r.params.data()), n * 4);
  f.read(reinterpret_cast<char*>(&r.grad_norm), sizeof r.grad_norm);
  std::string tier;
  int64_t bytes = 0;
  while (f >> tier) {
    if (tier == "detail") {
      f >> tier;
      std::getline(f, r.detail[tier]);
      continue;
    }
    f >> bytes;
    r.needed[tier] = bytes;
  }
  return r;
}

// Trains kSteps steps as rank e.rank of e.world (data_parallel) or as one rank
// with e.world micro-batches a step; writes the result to `out`.
void Train(const RankEnv& e, const Shape& s, bool data_parallel, const std::string& out) {
  SetRankEnv(e, data_parallel);
  const int W = e.world;
  const std::string nvme = e.dir + "/nvme-" + (data_parallel ? "dp" : "ref");
  std::filesystem::create_directories(nvme);
  const int G = s.gas;
  const scheduler::HostArray::Live before = scheduler::HostArray::LiveBytes();
  auto engine = CreateFor(s, ShapeConfig(s, nvme, data_parallel ? G : W * G));
  RANK_OK(engine.status());
  Engine& eng = **engine;
  testing::RegisterToy(eng, 17, kModules, s.extra);
  double norm = 0;
  for (int step = 0; step < s.steps; ++step) {
    const int skip = step == s.skip_step ? 2 : -1;
    // Rank r's micro-batch k of the step is batch (step W + r) G + k.
    const int r0 = data_parallel ? e.rank : 0, r1 = data_parallel ? e.rank + 1 : W;
    const float scale = 1.0f / static_cast<float>((data_parallel ? 1 : W) * G);
    for (int r = r0; r < r1; ++r)
      for (int k = 0; k < G; ++k) {
        MicroBatch(eng, (step * W + r) * G + k, scale, s.extra, skip);
        if (r + 1 < r1 || k + 1 < G) RANK_OK(eng.Step().status());
      }
    auto st = eng.Step();
    RANK_OK(st.status());
    RANK_CHECK(st->applied, "step {} not applied", step);
    RANK_CHECK(st->world_size == (data_parallel ? W : 1), "world_size {}", st->world_size);
    // The plan's pinned and DRAM rows are what this rank allocated
    // (PlanBytesTest for one rank's placements).
    const scheduler::HostArray::Live live = scheduler::HostArray::LiveBytes();
    for (const TierBudget& b : eng.Budgets()) {
      if (b.tier == "dram")
        RANK_CHECK(b.needed_bytes == live.pageable - before.pageable,
                   "the plan's dram row {} bytes ({}), allocated {}", b.needed_bytes, b.detail,
                   live.pageable - before.pageable);
      if (b.tier == "pinned")
        RANK_CHECK(b.needed_bytes == st->pinned_high_water_bytes,
                   "the plan's pinned row {} bytes ({}), allocated {}", b.needed_bytes, b.detail,
                   st->pinned_high_water_bytes);
    }
    // (delayed_param_update: the first Step() has no step to join, so
    // nothing to gather.)
    // The collectives' busy time from device events: positive whenever
    // something was reduced (the host device times Gloo's calls).
    // The bound's network term: the ring's bytes at the bus bandwidth
    // measured at Plan.
    if (data_parallel)
      RANK_CHECK(
          st->comm_reduced_bytes > 0 && (st->comm_gathered_bytes > 0 || (s.delayed && step == 0)) &&
              st->comm_busy_s > 0 && st->comm_gbytes_per_s > 0 &&
              st->comm_ring_bytes >= static_cast<double>(st->comm_gathered_bytes) &&
              st->bound_s >= st->comm_ring_bytes / (st->comm_gbytes_per_s * 1e9),
          "collectives moved {} / {} bytes (ring {}), busy {} s, bus bandwidth {} GB/s, bound {} s",
          st->comm_reduced_bytes, st->comm_gathered_bytes, st->comm_ring_bytes, st->comm_busy_s,
          st->comm_gbytes_per_s, st->bound_s);
    // Partitioned parameters (stage 3): once the fetch order is recorded,
    // modules are gathered ahead of their fetch.
    if (data_parallel && s.stage == 3 && step > 0 && step != s.skip_step)
      RANK_CHECK(st->prefetched_modules > 0 && st->comm_gathered_bytes > 0,
                 "step {}: {} modules gathered ahead, {} bytes gathered", step,
                 st->prefetched_modules, st->comm_gathered_bytes);
    norm = st->grad_norm;
  }
  if (s.device_sums) {  // the window's sums copied into a pinned accumulator
    bool copied_in = false;
    for (const TierBudget& b : eng.Budgets())
      copied_in |= b.detail.find("the window's sums copied in") != std::string::npos;
    RANK_CHECK(copied_in, "the plan does not copy the window's sums into the accumulator");
  }
  WriteResult(out, eng, norm, s.extra);
}

struct Runs {
  Result ref;
  std::vector<Result> ranks;
};

// One rank with W micro-batches a step, then W ranks; every rank's
// parameters must equal rank 0's bit for bit.
Runs TrainBoth(const Shape& s, int world) {
  Runs out;
  std::string dir_ref, dir_dp;
  {
    testing::ScratchDir keep("strata-dp-results");
    const std::string results = keep.str();
    testing::ExpectAllExitedZero(RunRanks(1, [&](const RankEnv& e) {
      RankEnv one = e;
      one.world = world;
      Train(one, s, false, results + "/ref");
    }));
    testing::ExpectAllExitedZero(RunRanks(world, [&](const RankEnv& e) {
      Train(e, s, true, fmt::format("{}/rank-{}", results, e.rank));
    }));
    out.ref = ReadResult(results + "/ref", s.extra);
    for (int r = 0; r < world; ++r)
      out.ranks.push_back(ReadResult(fmt::format("{}/rank-{}", results, r), s.extra));
  }
  for (int r = 1; r < world; ++r)
    EXPECT_EQ(0, std::memcmp(out.ranks[static_cast<size_t>(r)].params.data(),
                             out.ranks[0].params.data(), out.ranks[0].params.size() * 4))
        << "rank " << r << "'s parameters differ from rank 0's";
  return out;
}

int64_t ToyElements() {
  int64_t n = 0;
  for (int m = 0; m < kModules; ++m)
    for (int i = 0; i < 2; ++i) n += testing::ToyNumel(m, i);
  return n;
}

size_t Mismatches(const std::vector<float>& a, const std::vector<float>& b, double rel) {
  size_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::fabs(a[i] - b[i]) > rel * std::max(1.0f, std::fabs(b[i]))) ++bad;
  return bad;
}

// Rank 0's parameters are one rank's bit for bit.
void ExpectBitsOfOneRank(const Runs& runs) {
  EXPECT_EQ(0, std::memcmp(runs.ranks[0].params.data(), runs.ref.params.data(),
                           runs.ref.params.size() * 4))
      << Mismatches(runs.ranks[0].params, runs.ref.params, 0) << " elements differ";
}

// ---- Placements × stages, two ranks: the same bits -----------------------------
// (offload_param needs stage 3, as in DeepSpeed.)

using Case = std::tuple<OffloadDevice, OffloadDevice, int>;

class DataParallelPlacementTest : public ::testing::TestWithParam<Case> {};

TEST_P(DataParallelPlacementTest, TwoRanksGiveTheBitsOfOneRankAccumulatingBoth) {
  Shape s;
  std::tie(s.opt, s.par, s.stage) = GetParam();
  const Runs runs = TrainBoth(s, 2);
  // With two ranks the reduction is a + b, the one-rank sum 0 + a/2 + b/2
  // scaled by the same power of two: no clipping, so the same bits.
  EXPECT_EQ(0, std::memcmp(runs.ranks[0].params.data(), runs.ref.params.data(),
                           runs.ref.params.size() * 4))
      << Mismatches(runs.ranks[0].params, runs.ref.params, 0) << " of " << runs.ref.params.size()
      << " elements differ";
  // Each rank keeps half of the optimizer states (two versions on NVMe).
  const char* tier = s.opt == OffloadDevice::kNvme  ? "nvme"
                     : s.opt == OffloadDevice::kCpu ? "dram"
                                                    : "hbm";
  const int64_t halves = s.opt == OffloadDevice::kNvme ? 2 : 1;
  // In HBM a rank also holds the collectives' staging: 3 chunks of
  // reduce_bucket_size (500) fp32.
  const int64_t staging = s.opt == OffloadDevice::kNone ? 3 * 500 * 4 : 0;
  // Stage 3 partitions the parameters in HBM (offload_param none) too: each
  // rank holds its part, the toy's modules are then fetched into slots and
  // gathered ahead into buffers, which outweigh the halved states of so
  // small a model (plan_test checks the rows).
  // With offload_param nvme each rank's NVMe holds its part of them.
  if (s.stage == 3 && s.par == OffloadDevice::kNvme) {
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(runs.ranks[r].detail.at("nvme").find("(this rank's part of 2)"), std::string::npos)
          << runs.ranks[r].detail.at("nvme");
    }
  }
  if (s.stage == 3 && s.par == OffloadDevice::kNone) {
    for (int r = 0; r < 2; ++r)
      EXPECT_NE(runs.ranks[r].detail.at("hbm").find("parameters (this rank's part of 2)"),
                std::string::npos)
          << runs.ranks[r].detail.at("hbm");
    if (s.opt == OffloadDevice::kNone) return;
  }
  // With offload_param nvme at stage 3 each rank's part of every module is
  // page-rounded on NVMe: more than the halved states of so small a model;
  // the states' own part of the row is halved.
  if (s.stage == 3 && s.par == OffloadDevice::kNvme) {
    auto states_of = [](const std::string& detail) {
      const std::string key = "optimizer states 2 x ";
      const size_t at = detail.find(key);
      EXPECT_NE(at, std::string::npos) << detail;
      return at == std::string::npos ? 0.0 : std::stod(detail.substr(at + key.size()));
    };
    // (Both in KiB for the toy: 12 bytes x 3.4 K elements, halved.)
    const double one_rank = states_of(runs.ref.detail.at(tier));
    EXPECT_GT(one_rank, 0);
    for (int r = 0; r < 2; ++r)
      EXPECT_LE(states_of(runs.ranks[r].detail.at(tier)), 0.55 * one_rank)
          << runs.ranks[r].detail.at(tier);
    return;
  }
  for (int r = 0; r < 2; ++r) {
    const int64_t saved = runs.ref.needed.at(tier) - runs.ranks[r].needed.at(tier) + staging;
    EXPECT_GE(saved, halves * 12 * ToyElements() * 45 / 100)
        << tier << ": one rank needs " << runs.ref.needed.at(tier) << " bytes, rank " << r
        << " of two " << runs.ranks[r].needed.at(tier);
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, DataParallelPlacementTest,
                         ::testing::Values(Case{OffloadDevice::kNone, OffloadDevice::kNone, 1},
                                           Case{OffloadDevice::kNone, OffloadDevice::kNone, 2},
                                           Case{OffloadDevice::kNone, OffloadDevice::kNone, 3},
                                           Case{OffloadDevice::kCpu, OffloadDevice::kNone, 1},
                                           Case{OffloadDevice::kCpu, OffloadDevice::kNone, 2},
                                           Case{OffloadDevice::kCpu, OffloadDevice::kNone, 3},
                                           Case{OffloadDevice::kNvme, OffloadDevice::kNone, 1},
                                           Case{OffloadDevice::kNvme, OffloadDevice::kNone, 2},
                                           Case{OffloadDevice::kCpu, OffloadDevice::kCpu, 3},
                                           Case{OffloadDevice::kNvme, OffloadDevice::kCpu, 3},
                                           Case{OffloadDevice::kNvme, OffloadDevice::kNvme, 3}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return testing::PlacementName(std::get<0>(info.param),
                                                         std::get<1>(info.param)) +
                                  "_stage" + std::to_string(std::get<2>(info.param));
                         });

// ---- Checkpoints across world sizes -------------------------------------------

// A run with a global batch of `global` micro-batches a step: rank r of W
// trains micro-batches step * global + r * (global / W) + k, k < global / W,
// each gradient scaled by W / global, so that every world size applies the
// mean gradient of the same global batch.
struct GlobalRun {
  Shape shape;
  int global = 2;
  int from = 0, to = 3;  // steps
  std::string load;      // a checkpoint to load first
  std::string save;      // where to save after step save_after
  int save_after = -1;
};

// Trains `run` as rank e.rank of e.world; writes the parameters after the
// load (<out>.loaded), at the save (<out>.saved) and at the end (<out>).
void TrainGlobal(const RankEnv& e, const GlobalRun& run, const std::string& out) {
  SetRankEnv(e, e.world > 1);
  const int W = e.world, gas = run.global / W;
  const std::string nvme = fmt::format("{}/nvme-{}", e.dir, W);
  std::filesystem::create_directories(nvme);
  auto engine = CreateFor(run.shape, ShapeConfig(run.shape, nvme, gas));
  RANK_OK(engine.status());
  Engine& eng = **engine;
  testing::RegisterToy(eng, 17, kModules);
  if (!run.load.empty()) {
    CheckpointInfo info;
    RANK_OK(eng.LoadCheckpoint(run.load, &info));
    RANK_CHECK(info.optimizer_step == run.from && info.data_position == run.from,
               "loaded step {}, data position {}", info.optimizer_step, info.data_position);
    WriteResult(out + ".loaded", eng, 0, 0);
  }
  for (int step = run.from; step < run.to; ++step) {
    for (int k = 0; k < gas; ++k) {
      MicroBatch(eng, step * run.global + e.rank * gas + k,
                 static_cast<float>(W) / static_cast<float>(run.global));
      if (k + 1 < gas) RANK_OK(eng.Step().status());
    }
    auto st = eng.Step();
    RANK_OK(st.status());
    RANK_CHECK(st->applied, "step {} not applied", step);
    if (step + 1 == run.save_after) {
      CheckpointInfo info;
      info.data_position = step + 1;
      RANK_OK(eng.SaveCheckpoint(run.save, info));
      WriteResult(out + ".saved", eng, 0, 0);
    }
  }
  WriteResult(out, eng, 0, 0);
}

// Saves at `before` ranks after step 2 of 3, loads at `after` ranks and
// trains step 3: the loaded parameters are the saved ones bit for bit, and
// the last step's are the uninterrupted run's within `rel` (0: bitwise).
void ExpectResumedAtAnotherWorldSize(const Shape& s, int global, int before, int after,
                                     double rel) {
  testing::ScratchDir keep("strata-dp-reshard");
  const std::string results = keep.str(), ckpt = results + "/ckpt";
  GlobalRun first;
  first.shape = s;
  first.global = global;
  first.save = ckpt;
  first.save_after = 2;
  testing::ExpectAllExitedZero(RunRanks(before, [&](const RankEnv& e) {
    TrainGlobal(e, first, fmt::format("{}/first-{}", results, e.rank));
  }));
  GlobalRun second = first;
  second.save.clear();
  second.load = ckpt;
  second.from = 2;
  testing::ExpectAllExitedZero(RunRanks(after, [&](const RankEnv& e) {
    TrainGlobal(e, second, fmt::format("{}/second-{}", results, e.rank));
  }));
  // One states file per rank that saved, named in the manifest.
  const std::string dir = scheduler::LatestCheckpoint(ckpt);
  for (int r = 0; r < before; ++r)
    EXPECT_TRUE(std::filesystem::exists(
        before == 1 ? dir + "/states.bin" : fmt::format("{}/states-rank-{:05d}.bin", dir, r)))
        << dir << ": rank " << r << "'s states";
  const Result saved = ReadResult(results + "/first-0.saved", 0);
  const Result uninterrupted = ReadResult(results + "/first-0", 0);
  for (int r = 0; r < after; ++r) {
    const Result loaded = ReadResult(fmt::format("{}/second-{}.loaded", results, r), 0);
    EXPECT_EQ(0, std::memcmp(loaded.params.data(), saved.params.data(), saved.params.size() * 4))
        << "rank " << r << " of " << after << ": " << Mismatches(loaded.params, saved.params, 0)
        << " parameters differ from those saved by " << before << " rank(s)";
    const Result resumed = ReadResult(fmt::format("{}/second-{}", results, r), 0);
    EXPECT_EQ(0u, Mismatches(resumed.params, uninterrupted.params, rel))
        << "rank " << r << " of " << after << " resumed from " << before << " rank(s)";
  }
  // The consolidated export (strata checkpoint export) holds the saved
  // masters, in element order after its header.
  const std::string out = results + "/export.safetensors";
  auto exported = scheduler::ExportCheckpoint(ckpt, out, scheduler::ExportPrecision::kFp32);
  ASSERT_TRUE(exported.ok()) << exported.status();
  std::ifstream f(out, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t n = saved.params.size() * 4;
  ASSERT_GE(bytes.size(), n);
  EXPECT_EQ(0, std::memcmp(bytes.data() + bytes.size() - n, saved.params.data(), n))
      << "the export of a checkpoint saved by " << before << " rank(s)";
}

// Two ranks × one micro-batch and one rank × two micro-batches apply the
// same bits (see TwoRanksGiveTheBitsOfOneRankAccumulatingBoth).
TEST(DataParallelCheckpointTest, SavedByTwoRanksResumesOnOneBitwise) {
  Shape s;  // cpu/none, stage 2
  ExpectResumedAtAnotherWorldSize(s, 2, 2, 1, 0);
}

// The compact state formats: an element's bits depend on its index and the
// step only (int8's blocks and the bf16 master's stochastic rounding are
// keyed on the element index), so two ranks give one rank's bits, and a
// checkpoint saved by two resumes on one.
TEST(DataParallelCheckpointTest, CompactStatesGiveTheBitsOfOneRankAndResumeOnOne) {
  for (OptimizerStates f :
       {OptimizerStates::kBf16, OptimizerStates::kBf16Master, OptimizerStates::kInt8}) {
    SCOPED_TRACE(std::string(OptimizerStatesName(f)));
    Shape s;
    s.states = f;
    ExpectBitsOfOneRank(TrainBoth(s, 2));
    if (f == OptimizerStates::kInt8) ExpectResumedAtAnotherWorldSize(s, 2, 2, 1, 0);
  }
}

TEST(DataParallelCheckpointTest, SavedByOneRankResumesOnTwoBitwise) {
  Shape s;
  s.par = OffloadDevice::kCpu;
  s.stage = 3;
  ExpectResumedAtAnotherWorldSize(s, 2, 1, 2, 0);
}

// Stage 3 partitions the parameters: every rank gathers each module into the
// save (none: from its part in device memory; nvme: its piece read from
// NVMe), rank 0 writes them; loading at 2 ranks writes each rank's part.
TEST(DataParallelCheckpointTest, PartitionedParametersSavedByTwoRanksResumeOnOneBitwise) {
  ForEachPartitionedPlace([](const Shape& s) { ExpectResumedAtAnotherWorldSize(s, 2, 2, 1, 0); });
  for (const OffloadDevice par : {OffloadDevice::kNone, OffloadDevice::kNvme}) {
    SCOPED_TRACE(OffloadDeviceName(par));
    Shape s;
    s.par = par;
    s.opt = par;
    s.stage = 3;
    ExpectResumedAtAnotherWorldSize(s, 2, 1, 2, 0);
  }
}

// Four ranks add four gradients in the collective's order, two ranks two
// sums of two: the last step agrees within rounding.
TEST(DataParallelCheckpointTest, SavedByTwoRanksResumesOnFourWithStatesOnNvme) {
  Shape s;
  s.opt = OffloadDevice::kNvme;
  s.stage = 1;
  ExpectResumedAtAnotherWorldSize(s, 4, 2, 4, 1e-6);
}

// Rank 0 dies in the second save after every rank's states file is durable
// and before the manifest is in place: rank 1's save fails within the
// timeout, and the first checkpoint stays the newest: it loads on one rank
// (the interrupted directory is skipped; the next save removes it). Then a corrupt states file of
// rank 1 is refused by both ranks of a two-rank load, naming it, and leaves
// their parameters as they were.
TEST(DataParallelCheckpointTest, ARankDyingMidSaveLeavesThePreviousCheckpoint) {
  testing::ScratchDir keep("strata-dp-crash");
  const std::string results = keep.str(), ckpt = results + "/ckpt";
  const std::vector<int> status = RunRanks(
      2,
      [&](const RankEnv& e) {
        SetRankEnv(e, true);
        const std::string nvme = e.dir + "/nvme";
        std::filesystem::create_directories(nvme);
        int saves = 0;
        EngineTestHooks hooks;
        if (e.rank == 0)
          hooks.checkpoint_point = [&saves](std::string_view point) {
            if (saves == 2 && point == "manifest_tmp") raise(SIGKILL);
          };
        auto engine = CreateEngine(ShapeConfig(Shape{}, nvme, 1), hooks);
        RANK_OK(engine.status());
        Engine& eng = **engine;
        testing::RegisterToy(eng, 17, kModules);
        for (int step = 0; step < 2; ++step) {
          MicroBatch(eng, step * 2 + e.rank, 1.0f);
          RANK_OK(eng.Step().status());
          ++saves;
          CheckpointInfo info;
          info.data_position = step + 1;
          const Status s = eng.SaveCheckpoint(ckpt, info);
          if (step == 0) {
            RANK_OK(s);
            WriteResult(fmt::format("{}/saved-{}", results, e.rank), eng, 0, 0);
          } else {
            RANK_CHECK(e.rank == 1 && !s.ok(), "the second save: {}", s.ToString());
            std::fprintf(stderr, "rank 1's save failed as expected: %s\n", s.ToString().c_str());
          }
        }
      },
      /*timeout_s=*/5, /*limit_s=*/60);
  ASSERT_EQ(status.size(), 2u);
  EXPECT_TRUE(WIFSIGNALED(status[0]) && WTERMSIG(status[0]) == SIGKILL) << status[0];
  EXPECT_TRUE(WIFEXITED(status[1]) && WEXITSTATUS(status[1]) == 0) << status[1];
  ASSERT_TRUE(std::filesystem::exists(ckpt + "/ckpt-00000002/states-rank-00001.bin"));
  ASSERT_FALSE(std::filesystem::exists(ckpt + "/ckpt-00000002/MANIFEST.json"));
  const Result saved = ReadResult(results + "/saved-0", 0);

  testing::ExpectAllExitedZero(RunRanks(1, [&](const RankEnv& e) {
    SetRankEnv(e, false);
    auto engine = Engine::Create(ShapeConfig(Shape{}, e.dir, 2));
    RANK_OK(engine.status());
    testing::RegisterToy(**engine, 18, kModules);
    CheckpointInfo info;
    RANK_OK((*engine)->LoadCheckpoint(ckpt, &info));
    RANK_CHECK(info.optimizer_step == 1, "loaded step {}", info.optimizer_step);
    WriteResult(results + "/loaded", **engine, 0, 0);
  }));
  const Result loaded = ReadResult(results + "/loaded", 0);
  EXPECT_EQ(0, std::memcmp(loaded.params.data(), saved.params.data(), saved.params.size() * 4));

  const std::string bad = ckpt + "/ckpt-00000001/states-rank-00001.bin";
  {
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(100);
    f.write(&c, 1);
  }
  testing::ExpectAllExitedZero(RunRanks(2, [&](const RankEnv& e) {
    SetRankEnv(e, true);
    auto engine = Engine::Create(ShapeConfig(Shape{}, e.dir + "/nvme", 1));
    RANK_OK(engine.status());
    testing::RegisterToy(**engine, 18, kModules);
    const std::string before = fmt::format("{}/fresh-{}", results, e.rank);
    WriteResult(before, **engine, 0, 0);
    const Status s = (*engine)->LoadCheckpoint(ckpt, nullptr);
    RANK_CHECK(s.code() == StatusCode::kDataLoss, "{}", s.ToString());
    RANK_CHECK(s.ToString().find(bad) != std::string::npos, "{}", s.ToString());
    RANK_CHECK(e.rank == 1 || s.ToString().find("rank 1: ") != std::string::npos, "{}",
               s.ToString());
    WriteResult(before + ".after", **engine, 0, 0);
  }));
  for (int r = 0; r < 2; ++r) {
    const Result a = ReadResult(fmt::format("{}/fresh-{}", results, r), 0);
    const Result b = ReadResult(fmt::format("{}/fresh-{}.after", results, r), 0);
    EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), a.params.size() * 4))
        << "rank " << r << ": a refused load changed the parameters";
  }
}

// ---- The device optimizer (offload_optimizer none on a GPU) ----------------------

// Its accumulator, states and parameters are in device memory: the ranks
// reduce and gather there. Two ranks give one rank's bits (the same
// arithmetic as above; no clipping), at stages 1, 2 and 3 (the parameters
// partitioned in device memory: each module gathered within it).
TEST(DataParallelDeviceOptimizerTest, TwoRanksGiveTheBitsOfOneRank) {
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE(stage);
    Shape s;
    s.opt = OffloadDevice::kNone;
    s.device_optimizer = true;
    s.stage = stage;
    s.persistence_threshold = 400;  // module 0 (320 elements) persistent
    const Runs runs = TrainBoth(s, 2);
    ExpectBitsOfOneRank(runs);
    if (stage == 3) {  // (the toy's slots outweigh the halved states: see above)
      EXPECT_NE(runs.ranks[1].detail.at("hbm").find("parameters (this rank's part of 2)"),
                std::string::npos)
          << runs.ranks[1].detail.at("hbm");
      continue;
    }
    // Each rank keeps half of the states in HBM.
    EXPECT_GE(runs.ref.needed.at("hbm") - runs.ranks[1].needed.at("hbm") + 3 * 500 * 4,
              12 * ToyElements() * 45 / 100);
  }
}

// Four ranks with clipping: the global norm is the partitions' sums of
// squares added over the ranks (the device's order within each), so within
// rounding of one rank; a checkpoint they save resumes on two. Stage 3: the
// parameters partitioned in device memory.
TEST(DataParallelDeviceOptimizerTest, FourRanksClipAndResumeOnTwo) {
  Shape s;
  s.opt = OffloadDevice::kNone;
  s.device_optimizer = true;
  s.stage = 3;
  s.clipping = 0.5;
  const Runs runs = TrainBoth(s, 4);
  EXPECT_EQ(0u, Mismatches(runs.ranks[0].params, runs.ref.params, 1e-6));
  EXPECT_NEAR(runs.ranks[0].grad_norm, runs.ref.grad_norm, 1e-9 * runs.ref.grad_norm);
  s.clipping = 0;
  ExpectResumedAtAnotherWorldSize(s, 4, 4, 2, 1e-6);
}

// ---- Gradients on NVMe (strata.grad_tier nvme) ----------------------------------

// Every rank keeps its window's sums on its NVMe; at the window's end each
// sub-group goes through the cache and is reduced to its owner. Two ranks
// give one rank's bits (one rank with its sums on NVMe too), at stage 1 and
// 2, with two micro-batches a window in the 4-rank check below.
TEST(DataParallelTest, GradientsOnNvmeGiveTheBitsOfOneRank) {
  for (int stage : {1, 2}) {
    SCOPED_TRACE(stage);
    Shape s;
    s.opt = OffloadDevice::kNvme;
    s.grads_on_nvme = true;
    s.stage = stage;
    ExpectBitsOfOneRank(TrainBoth(s, 2));
  }
  Shape s;
  s.opt = OffloadDevice::kNvme;
  s.grads_on_nvme = true;
  s.clipping = 0.5;
  const Runs runs = TrainBoth(s, 4);
  EXPECT_EQ(0u, Mismatches(runs.ranks[0].params, runs.ref.params, 1e-6));
}

// ---- delayed_param_update: the step overlaps the next window -------------------

// The step of window w runs in the background during window w + 1 (whose
// forward uses the parameters before it) and the next Step() joins it: the
// ranks gather there. Two ranks give one rank's bits, with overlap_comm too.
TEST(DataParallelTest, DelayedParamUpdateGivesTheBitsOfOneRank) {
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap);
    Shape s;
    s.delayed = true;
    s.overlap_comm = overlap;
    ExpectBitsOfOneRank(TrainBoth(s, 2));
  }
}

// ---- The reduction overlapped with backward (overlap_comm) -----------------------

// One micro-batch of the toy with the backward pass in `order` (module ids),
// calling `after(m)` after each module's AfterBackward.
void MicroBatchInOrder(Engine& e, int batch, float scale, const std::vector<int>& order,
                       const std::function<void(int)>& after = {}) {
  for (int m = 0; m < kModules; ++m) {
    RANK_OK(e.BeforeForward(m).status());
    RANK_OK(e.AfterForward(m));
  }
  for (int m : order) {
    auto v = e.BeforeBackward(m);
    RANK_OK(v.status());
    for (int i = 0; i < 2; ++i) {
      const DType t = testing::ToyDType(m, i);
      for (int64_t j = 0; j < testing::ToyNumel(m, i); ++j) {
        const float p = testing::Load(v->params[static_cast<size_t>(i)], t, j);
        const float g =
            scale * (0.5f * p + 0.1f * std::sin(static_cast<float>(batch) + 0.37f * j + m));
        testing::Store(v->grads[static_cast<size_t>(i)], t, j, g);
      }
    }
    RANK_OK(e.AfterBackward(m));
    if (after) after(m);
  }
}

// Rank e's engine (stage 2, cpu/none; `gas` micro-batches a window) with the
// toy registered.
std::unique_ptr<Engine> OverlapRank(const RankEnv& e, bool overlap_comm, int gas) {
  SetRankEnv(e, true);
  Shape s;
  s.overlap_comm = overlap_comm;
  auto engine = CreateFor(s, ShapeConfig(s, e.dir, gas));
  RANK_OK(engine.status());
  testing::RegisterToy(**engine, 17, kModules);
  return std::move(*engine);
}

// Two ranks with overlap_comm give the bits of one rank (2 ranks: a + b in
// any order), at every stage and with two micro-batches a window; from the
// second window on, the gradients are reduced while backward goes on.
TEST(DataParallelOverlapTest, TwoRanksGiveTheBitsOfOneRankWhileBackwardGoesOn) {
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE(stage);
    Shape s;
    s.stage = stage;
    s.overlap_comm = true;
    ExpectBitsOfOneRank(TrainBoth(s, 2));
  }
  testing::ScratchDir keep("strata-dp-overlap");
  const std::string out = keep.str();
  for (const bool overlap : {true, false})
    testing::ExpectAllExitedZero(RunRanks(2, [&](const RankEnv& e) {
      std::unique_ptr<Engine> engine = OverlapRank(e, overlap, 2);
      Engine& eng = *engine;
      for (int step = 0; step < 3; ++step) {
        for (int k = 0; k < 2; ++k) {
          MicroBatchInOrder(eng, (step * 2 + k) * 2 + e.rank, 0.5f, {5, 4, 3, 2, 1, 0});
          auto st = eng.Step();
          RANK_OK(st.status());
          if (k == 0) continue;
          RANK_CHECK(st->comm_reduced_bytes > 0, "step {}: nothing reduced", step);
          // The first window has no previous order: reduced at its end.
          RANK_CHECK((overlap && step > 0) == (st->comm_overlapped_bytes > 0),
                     "step {}: {} of {} bytes reduced while backward went on", step,
                     st->comm_overlapped_bytes, st->comm_reduced_bytes);
        }
      }
      WriteResult(fmt::format("{}/{}-{}", out, overlap ? "overlap" : "plain", e.rank), eng, 0, 0);
    }));
  const Result a = ReadResult(out + "/overlap-0", 0), b = ReadResult(out + "/plain-0", 0);
  EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), a.params.size() * 4))
      << "overlap_comm changed the result with two micro-batches a window";
}

// A collective of the framework's in the middle of backward (the engine's
// ReduceOverRanks) comes after the same pieces on every rank: no hang, and
// the same bits. A backward order that is not descending never overlaps; one
// that runs a reduced module again fails the step, naming overlap_comm.
TEST(DataParallelOverlapTest, MidBackwardCollectivesAndOrderChanges) {
  testing::ExpectAllExitedZero(RunRanks(2, [&](const RankEnv& e) {
    std::unique_ptr<Engine> engine = OverlapRank(e, true, 1);
    Engine& eng = *engine;
    const std::vector<int> down = {5, 4, 3, 2, 1, 0};
    for (int step = 0; step < 3; ++step) {
      MicroBatchInOrder(eng, step * 2 + e.rank, 1.0f, down, [&](int m) {
        if (m != 3) return;
        double x = e.rank + 1;
        RANK_OK(eng.ReduceOverRanks(std::span<double>(&x, 1), Engine::OverRanks::kSum));
        RANK_CHECK(x == 3, "the sum over the ranks is {}", x);
      });
      RANK_OK(eng.Step().status());
    }
    // Not descending (module 5 last): the next window reduces at its end.
    const std::vector<int> other = {4, 3, 2, 1, 0, 5};
    for (int step = 0; step < 2; ++step) {
      MicroBatchInOrder(eng, 100 + step * 2 + e.rank, 1.0f, other);
      auto st = eng.Step();
      RANK_OK(st.status());
      if (step == 1)
        RANK_CHECK(st->comm_overlapped_bytes == 0, "{} bytes overlapped",
                   st->comm_overlapped_bytes);
    }
    // Descending again, twice: the second window overlaps; then module 5's
    // backward again after module 4's, whose sums were final.
    for (int step = 0; step < 2; ++step) {
      MicroBatchInOrder(eng, 200 + step * 2 + e.rank, 1.0f, down);
      RANK_OK(eng.Step().status());
    }
    Status failed;
    for (int m = 0; m < kModules; ++m) {
      RANK_OK(eng.BeforeForward(m).status());
      RANK_OK(eng.AfterForward(m));
    }
    for (int m : {5, 4, 5}) {
      auto v = eng.BeforeBackward(m);
      if (!v.ok()) {
        failed = v.status();
        break;
      }
      failed = eng.AfterBackward(m);
      if (!failed.ok()) break;
    }
    RANK_CHECK(failed.code() == StatusCode::kFailedPrecondition &&
                   failed.ToString().find("overlap_comm") != std::string::npos,
               "{}", failed.ToString());
  }));
}

// ---- Stage 3's partitioned parameters gathered ahead ---------------------------

// The gathers ahead follow the recorded order on every rank, whatever the
// program does: backward fetching each module again (gathers between the
// overlapped reductions), a step that leaves a module out (the order
// differs: what was gathered for it is dropped on every rank), and the
// recorded order again afterwards. The same bits as one rank, no hang.
TEST(DataParallelTest, PartitionedModulesGatheredAheadWhateverTheOrder) {
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap);
    Shape s;
    // (offload_param none: gathered within device memory)
    s.par = overlap ? OffloadDevice::kNone : OffloadDevice::kCpu;
    s.stage = 3;
    s.refetch = true;
    s.overlap_comm = overlap;
    s.skip_step = 2;
    s.steps = 5;
    s.clipping = 1.0;
    ExpectBitsOfOneRank(TrainBoth(s, 2));
  }
}

// allgather_bucket_size: the parameters gathered a few elements at a time
// (every all-gather's tail shorter on some ranks), at stage 2 after the step
// and at stage 3 per module: the same bits.
// WriteParameter with partitioned parameters: each rank patches its part
// (the host copy, the device block, or its piece on NVMe) and the next
// fetch gathers the new values on every rank; ReadParameter gives them back.
TEST(DataParallelTest, WrittenPartitionedParametersReachTheNextFetch) {
  ForEachPartitionedPlace([](const Shape& s) {
    testing::ExpectAllExitedZero(RunRanks(2, [&](const RankEnv& e) {
      const std::string nvme = DataParallelRank(e);
      auto engine = Engine::Create(ShapeConfig(s, nvme, 1));
      RANK_OK(engine.status());
      Engine& eng = **engine;
      testing::RegisterToy(eng, 17, kModules);
      MicroBatch(eng, e.rank, 1.0f);
      RANK_OK(eng.Step().status());
      // Module 2's weight (id 4, fp16): values no step produced, the same on
      // both ranks.
      constexpr int kId = 4;
      const int64_t n = testing::ToyNumel(2, 0);
      std::vector<float> values(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) values[static_cast<size_t>(j)] = 0.25f + 0.001f * j;
      RANK_OK(eng.WriteParameter(kId, values));
      std::vector<float> back(values.size());
      RANK_OK(eng.ReadParameter(kId, back));
      RANK_CHECK(back == values, "ReadParameter after WriteParameter differs");
      const DType t = testing::ToyDType(2, 0);
      auto rounded = [t](float x) {
        uint8_t b[4];
        testing::Store(b, t, 0, x);
        return testing::Load(b, t, 0);
      };
      for (int m = 0; m < kModules; ++m) {
        auto v = eng.BeforeForward(m);
        RANK_OK(v.status());
        if (m == 2)
          for (int64_t j = 0; j < n; ++j) {
            const float got = testing::Load(v->params[0], t, j);
            RANK_CHECK(got == rounded(values[static_cast<size_t>(j)]),
                       "element {} of the fetched module: {} for {}", j, got,
                       values[static_cast<size_t>(j)]);
          }
        RANK_OK(eng.AfterForward(m));
      }
      for (int m = kModules - 1; m >= 0; --m) {
        RANK_OK(eng.BeforeBackward(m).status());
        RANK_OK(eng.AfterBackward(m));
      }
      RANK_OK(eng.Step().status());
    }));
  });
}

// strata.overlap_optimizer at stage 3 with offload_param cpu: the step runs
// beside the next forward pass on every rank. Each rank's step is held before
// its last sub-group (the toy's partitions have two of 1000 elements); modules
// 0 and 1 lie in rank 0's first sub-group, so module 0 is gathered (and
// module 1 ahead, within a prefetch bucket of 500 elements) while both steps
// are held. A step run inline would hold Step() itself: the hold times out
// and the check fails. (The bits against one rank: the placement tests.)
TEST(DataParallelTest, OverlappedStepLetsTheNextForwardGatherFinishedModules) {
  testing::ExpectAllExitedZero(RunRanks(2, [&](const RankEnv& e) {
    const std::string nvme = DataParallelRank(e);
    Config c = ShapeConfig(Partitioned(OffloadDevice::kCpu), nvme, 1);
    c.strata.overlap_optimizer = true;
    c.zero_optimization.stage3_prefetch_bucket_size = 500;
    std::mutex mu;
    std::condition_variable cv;
    bool armed = false, held = false, release = false, timed_out = false;
    EngineTestHooks hooks;
    hooks.before_sub_group = [&](size_t g) {
      std::unique_lock<std::mutex> lock(mu);
      if (!armed || g % 2 != 1) return;
      held = true;
      cv.notify_all();
      if (!cv.wait_for(lock, std::chrono::seconds(20), [&] { return release; })) timed_out = true;
    };
    auto engine = CreateEngine(c, hooks);
    RANK_OK(engine.status());
    Engine& eng = **engine;
    testing::RegisterToy(eng, 17, kModules);
    MicroBatch(eng, e.rank, 1.0f);
    RANK_OK(eng.Step().status());
    MicroBatch(eng, 2 + e.rank, 1.0f);
    {
      std::lock_guard<std::mutex> lock(mu);
      armed = true;
    }
    RANK_OK(eng.Step().status());  // returns with the step running
    {
      std::unique_lock<std::mutex> lock(mu);
      RANK_CHECK(cv.wait_for(lock, std::chrono::seconds(20), [&] { return held; }),
                 "the step never reached its last sub-group");
    }
    auto v = eng.BeforeForward(0);  // gathered from both ranks' finished pieces
    RANK_OK(v.status());
    {
      std::lock_guard<std::mutex> lock(mu);
      RANK_CHECK(!release && !timed_out, "module 0 was not fetched while the step was held");
      release = true;
      armed = false;
    }
    cv.notify_all();
    RANK_OK(eng.AfterForward(0));
    for (int m = 1; m < kModules; ++m) {
      RANK_OK(eng.BeforeForward(m).status());
      RANK_OK(eng.AfterForward(m));
    }
    for (int m = kModules - 1; m >= 0; --m) {
      RANK_OK(eng.BeforeBackward(m).status());
      RANK_OK(eng.AfterBackward(m));
    }
    RANK_OK(eng.Step().status());
    std::lock_guard<std::mutex> lock(mu);
    RANK_CHECK(!timed_out, "a held step timed out");
  }));
}

// offload_param nvme: a rank whose write of its piece fails during the step
// says that the ranks now disagree (its states moved, that piece did not);
// its peer's step completes.
TEST(DataParallelTest, FailedPieceWriteSaysTheRanksDisagree) {
  testing::ExpectAllExitedZero(RunRanks(2, [&](const RankEnv& e) {
    const std::string nvme = DataParallelRank(e);
    nvme::FaultInjectionEngine* faults = nullptr;
    EngineTestHooks hooks;
    hooks.wrap_io_engine =
        [&faults](std::unique_ptr<nvme::IoEngine> inner) -> std::unique_ptr<nvme::IoEngine> {
      auto f = std::make_unique<nvme::FaultInjectionEngine>(std::move(inner));
      faults = f.get();
      return f;
    };
    auto engine = CreateEngine(ShapeConfig(Partitioned(OffloadDevice::kNvme), nvme, 1), hooks);
    RANK_OK(engine.status());
    Engine& eng = **engine;
    testing::RegisterToy(eng, 17, kModules);
    MicroBatch(eng, e.rank, 1.0f);
    RANK_OK(eng.Step().status());
    MicroBatch(eng, 2 + e.rank, 1.0f);
    if (e.rank == 1) {
      RANK_CHECK(faults != nullptr, "no NVMe tier");
      nvme::FaultInjectionEngine::Rule rule;
      rule.kind = nvme::IoOpKind::kWrite;  // the step's first piece written
      faults->AddRule(rule);
    }
    auto st = eng.Step();
    if (e.rank == 0) {
      RANK_OK(st.status());
      return;
    }
    RANK_CHECK(!st.ok(), "rank 1's step succeeded with a failed write");
    RANK_CHECK(st.status().ToString().find("the ranks disagree and the run cannot continue") !=
                       std::string::npos &&
                   st.status().ToString().find("NVMe") != std::string::npos,
               "{}", st.status().ToString());
    std::fprintf(stderr, "rank 1 failed as expected: %s\n", st.status().ToString().c_str());
  }));
}

TEST(DataParallelTest, SmallAllgatherBucketsGiveTheSameBits) {
  for (const int stage : {2, 3}) {
    SCOPED_TRACE(stage);
    Shape s;
    s.stage = stage;
    s.par = stage == 3 ? OffloadDevice::kCpu : OffloadDevice::kNone;
    s.allgather_bucket_size = 7;
    ExpectBitsOfOneRank(TrainBoth(s, 2));
  }
}

// The window's sums in HBM copied into a pinned accumulator on every rank
// (two micro-batches a rank, the step leaving the sums in place, a window
// without module 2, clipping): one rank accumulating all four micro-batches
// within rounding (the ranks add two by two, one rank four in a row).
TEST(DataParallelTest, SumsCopiedIntoPinnedAccumulatorsMatchOneRank) {
  Shape s;
  s.gas = 2;
  s.device_sums = true;
  s.skip_step = 1;
  s.clipping = 0.5;
  const Runs runs = TrainBoth(s, 2);
  EXPECT_EQ(0u, Mismatches(runs.ranks[0].params, runs.ref.params, 1e-6));
}

// ---- Four ranks, global clipping: within rounding, and repeatable ------------

TEST(DataParallelTest, FourRanksWithClippingMatchOneRankWithinRounding) {
  Shape s;
  s.clipping = 0.5;  // below the toy's gradient norm: every step clips
  const Runs a = TrainBoth(s, 4);
  // The clip coefficient comes from the global norm: each rank's partial sum
  // of squares over its partition, added in rank order; the sub-groups (and
  // so the partial sums' grouping) differ from one rank's, and Gloo pairs
  // the four gradients otherwise than 0 + a + b + c + d.
  EXPECT_NEAR(a.ranks[0].grad_norm, a.ref.grad_norm, 1e-6 * a.ref.grad_norm);
  EXPECT_EQ(Mismatches(a.ranks[0].params, a.ref.params, 1e-5), 0u);
  // Run to run, the same bits.
  const Runs b = TrainBoth(s, 4);
  EXPECT_EQ(0, std::memcmp(a.ranks[0].params.data(), b.ranks[0].params.data(),
                           a.ranks[0].params.size() * 4));
  EXPECT_EQ(a.ranks[0].grad_norm, b.ranks[0].grad_norm);
}

// Partitions of at least kBlockAlignedPartition elements lie on the global
// checks' block grid: with clipping too, the one-rank bits (the sub-groups,
// 1e9 elements, start on that grid as well).
TEST(DataParallelTest, LargePartitionsClipWithTheBitsOfOneRank) {
  Shape s;
  s.clipping = 0.5;
  s.extra = 2'200'000;  // two partitions of over 16 x 64K elements
  s.par = OffloadDevice::kNone;
  const Runs runs = [&] {
    Shape big = s;
    big.sub_group_size = 1'000'000'000;
    return TrainBoth(big, 2);
  }();
  EXPECT_EQ(runs.ranks[0].grad_norm, runs.ref.grad_norm);
  EXPECT_EQ(0, std::memcmp(runs.ranks[0].params.data(), runs.ref.params.data(),
                           runs.ref.params.size() * 4))
      << Mismatches(runs.ranks[0].params, runs.ref.params, 0) << " elements differ";
}

// ---- Failures ------------------------------------------------------------------

// Rank 1 killed after `steps` steps and `modules` forwards of the next
// (with partitioned parameters, while gathers ahead are in flight).
void KilledRankScenario(const Shape& shape, int steps, int modules) {
  constexpr double kTimeout = 5;
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int> status = RunRanks(
      2,
      [&](const RankEnv& e) {
        SetRankEnv(e, true);
        const std::string nvme = e.dir + "/nvme";
        std::filesystem::create_directories(nvme);
        auto engine = Engine::Create(ShapeConfig(shape, nvme, 1));
        RANK_OK(engine.status());
        testing::RegisterToy(**engine, 17, kModules);
        for (int step = 0; step < steps; ++step) {
          MicroBatch(**engine, step * 2 + e.rank, 1.0f);
          RANK_OK((*engine)->Step().status());
        }
        Status s;
        for (int step = steps; step < 50 && s.ok(); ++step) {
          for (int m = 0; m < kModules && s.ok(); ++m) {
            if (e.rank == 1 && m == modules) raise(SIGKILL);
            s = (*engine)->BeforeForward(m).status();
            if (s.ok()) s = (*engine)->AfterForward(m);
          }
          for (int m = kModules - 1; m >= 0 && s.ok(); --m) {
            s = (*engine)->BeforeBackward(m).status();
            if (s.ok()) s = (*engine)->AfterBackward(m);
          }
          if (s.ok()) s = (*engine)->Step().status();
        }
        RANK_CHECK(!s.ok(), "rank 0 trained 50 steps without its peer");
        RANK_CHECK(s.ToString().find("data parallelism (rank 0 of 2)") != std::string::npos,
                   "the error does not say which collective failed: {}", s.ToString());
        std::fprintf(stderr, "rank 0 failed as expected: %s\n", s.ToString().c_str());
      },
      kTimeout, /*limit_s=*/60);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(status.size(), 2u);
  EXPECT_TRUE(WIFEXITED(status[0]) && WEXITSTATUS(status[0]) == 0) << status[0];
  EXPECT_TRUE(WIFSIGNALED(status[1]) && WTERMSIG(status[1]) == SIGKILL) << status[1];
  EXPECT_LT(took, 30 + kTimeout);  // start-up and the timeout, never a hang
}

// Each path by which a failed collective leaves DataParallel, taken on
// purpose (no timing decides which): the wait on a gather ahead whose peer
// died, then, with the communicator's error sticky, a gather ahead refused at
// its enqueue, a blocking gather, a reduction and a byte exchange. Each error
// names this rank and what it was doing.
void DeadPeerScenario(const RankEnv& e) {
  gpu::DeviceOptions d;
  d.kind = DeviceKind::kHost;
  d.hbm_budget_bytes = 64 << 20;
  auto dev = gpu::CreateDevice(d);
  RANK_OK(dev.status());
  gpu::CommOptions o;
  o.rank = e.rank;
  o.world_size = e.world;
  o.rendezvous_dir = e.dir + "/gloo";
  o.timeout_s = e.timeout_s;
  o.connect_timeout_s = 30;
  auto dp = scheduler::DataParallel::Create(dev->get(), o, 3);
  RANK_OK(dp.status());
  std::vector<scheduler::ParamRec> params;
  for (int m = 0; m < 3; ++m)
    params.push_back(scheduler::ParamRec{fmt::format("m{}.w", m), 3001 + 17 * m, DType::kBf16, m});
  scheduler::LayoutOptions lo;
  lo.world_size = e.world;
  lo.params_offloaded = true;
  const scheduler::Layout layout = scheduler::Layout::Build(params, lo);
  // One chunk a gather (a module at most 6 KiB): issuing one is one enqueue.
  RANK_OK((*dp)->Bind(&layout, 1024, 1 << 16));
  std::vector<uint8_t> all(static_cast<size_t>(layout.total_param_bytes()));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint8_t>(i * 7 + e.rank);
  const scheduler::ModuleExtent& m0 = layout.module(0);
  std::vector<uint8_t> dst(static_cast<size_t>(m0.bytes()));
  using scheduler::Memory;
  const scheduler::PartBytes mine{all.data(), 0};
  // Both ranks connected and gathered once; then rank 1 dies.
  RANK_OK((*dp)->GatherModule(0, mine, dst.data(), Memory::kHost));
  if (e.rank == 1) raise(SIGKILL);
  auto event = (*dev)->CreateEvent();
  RANK_OK(event.status());
  const std::string who = "data parallelism (rank 0 of 2)";
  auto expect_named = [&](const Status& s, const char* path, const char* what) {
    RANK_CHECK(!s.ok(), "{} succeeded without its peer", path);
    RANK_CHECK(
        s.ToString().find(who) != std::string::npos && s.ToString().find(what) != std::string::npos,
        "{}: the error does not name the rank and '{}': {}", path, what, s.ToString());
  };
  // The gather ahead is enqueued (no collective has failed yet), then fails.
  RANK_OK((*dp)->IssueGatherModule(0, mine, dst.data(), Memory::kHost, event->get()));
  expect_named((*dp)->WaitGathered(**event), "the wait on a gather ahead", "(prefetched)");
  expect_named((*dp)->IssueGatherModule(0, mine, dst.data(), Memory::kHost, event->get()),
               "a gather ahead's enqueue", "(prefetched)");
  expect_named((*dp)->GatherModule(0, mine, dst.data(), Memory::kHost), "a gather",
               "gathering a module's parameters");
  std::vector<float> acc(static_cast<size_t>(layout.total_elems()), 1.0f);
  expect_named((*dp)->ReduceGradients(acc.data()), "a reduction", "gradients");
  expect_named((*dp)->AllGatherBytes("x").status(), "a byte exchange", "exchanging");
}

TEST(DataParallelTest, EveryFailedCollectiveNamesTheRankWhicheverPathItTakes) {
  const std::vector<int> status = RunRanks(2, DeadPeerScenario, /*timeout_s=*/5, /*limit_s=*/60);
  ASSERT_EQ(status.size(), 2u);
  EXPECT_TRUE(WIFEXITED(status[0]) && WEXITSTATUS(status[0]) == 0) << status[0];
  EXPECT_TRUE(WIFSIGNALED(status[1]) && WTERMSIG(status[1]) == SIGKILL) << status[1];
}

TEST(DataParallelTest, KilledRankMakesTheOthersFailWithinTheTimeout) {
  KilledRankScenario(Shape{}, 1, 0);
  // Partitioned parameters, gathers ahead in flight.
  ForEachPartitionedPlace([](const Shape& s) { KilledRankScenario(s, 2, 2); });
}

// Ranks whose config or model differ are refused at Plan, naming the first
// difference, on every rank.
void MismatchScenario(const RankEnv& e, bool model) {
  SetRankEnv(e, true);
  const std::string nvme = e.dir + "/nvme";
  std::filesystem::create_directories(nvme);
  Config c = ShapeConfig(Shape{}, nvme, 1);
  if (!model && e.rank == 1) c.optimizer.lr = 2e-2;
  auto engine = Engine::Create(c);
  RANK_OK(engine.status());
  testing::RegisterToy(**engine, 17, kModules, model && e.rank == 1 ? 8 : 0);
  const Status s = (*engine)->Plan();
  RANK_CHECK(s.code() == StatusCode::kFailedPrecondition, "Plan: {}", s.ToString());
  const std::string want =
      model ? "rank 1's model (its registered parameters) differs" : "rank 1's config differs";
  RANK_CHECK(s.ToString().find(want) != std::string::npos, "Plan: {}", s.ToString());
  const std::string detail = model ? "m3.weight: numel 599" : "\"lr\"";
  RANK_CHECK(s.ToString().find(detail) != std::string::npos, "no {} in: {}", detail, s.ToString());
}

// strata.grad_tier hbm is for one rank (the ranks reduce host sums): refused
// at Plan on every rank, naming the key and what is allowed.
void SumsInHbmScenario(const RankEnv& e) {
  SetRankEnv(e, true);
  const std::string nvme = e.dir + "/nvme";
  std::filesystem::create_directories(nvme);
  Config c = ShapeConfig(Shape{}, nvme, 1);
  c.strata.grad_tier = GradTier::kHbm;
  auto engine = Engine::Create(c);
  RANK_OK(engine.status());
  testing::RegisterToy(**engine, 17, kModules);
  const Status s = (*engine)->Plan();
  RANK_CHECK(s.code() == StatusCode::kInvalidArgument, "Plan: {}", s.ToString());
  for (const char* want : {"strata.grad_tier", "one rank", "\"dram\""})
    RANK_CHECK(s.ToString().find(want) != std::string::npos, "no {} in: {}", want, s.ToString());
}

TEST(DataParallelTest, RanksWithDifferentConfigsOrModelsAreRefused) {
  testing::ExpectAllExitedZero(RunRanks(2, [](const RankEnv& e) { MismatchScenario(e, false); }));
  testing::ExpectAllExitedZero(RunRanks(2, [](const RankEnv& e) { MismatchScenario(e, true); }));
  testing::ExpectAllExitedZero(RunRanks(2, SumsInHbmScenario));
}

// Stage 0 with several ranks (DeepSpeed's plain data parallelism) trains as
// stage 1: two ranks give one rank's bits, as stage 1 does.
TEST(DataParallelTest, StageZeroRunsAsStageOneWithOneRanksBits) {
  Shape s;
  s.opt = OffloadDevice::kNone;  // (stage 0 takes no offload, as in DeepSpeed)
  s.stage = 0;
  ExpectBitsOfOneRank(TrainBoth(s, 2));
}

}  // namespace
}  // namespace strata
