// The compact optimizer-state formats (strata.optimizer_states: bf16 moments,
// a bf16 master, int8 moments) through the Engine: how the elements are cut
// (sub-groups, threads, the parameters' placement, the overlapped step)
// changes no bit; the parameters stay near the fp32 run's; and the plan's
// rows hold the format's bytes, which are the bytes allocated. Checkpoints
// of each format: checkpoint_test.cc.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "src/scheduler/host_array.h"
#include "src/scheduler/scheduler.h"
#include "strata/config.h"
#include "strata/engine.h"
#include "tests/scheduler/toy_engine_model.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using testing::BitwiseEqual;
using ::testing::HasSubstr;
using testing::ReadAll;

constexpr int kModules = 5;
constexpr int kSteps = 6;

// The toy model with accumulation and clipping, the optimizer on the CPU.
Config FormatConfig(OptimizerStates f, const std::string& nvme_dir) {
  Config c = testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kNone, nvme_dir);
  c.gradient_accumulation_steps = c.train_batch_size = 2;
  c.gradient_clipping = 2.0;
  c.strata.optimizer_states = f;
  return c;
}

struct TrainResult {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
};

TrainResult Train(const Config& c, uint64_t seed) {
  TrainResult r;
  auto e = CreateEngine(c);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return r;
  testing::RegisterToy(**e, seed, kModules);
  testing::TrainToySteps(**e, c, 0, kSteps, kModules, &r.losses);
  r.params = ReadAll(**e);
  return r;
}

std::string FormatName(const ::testing::TestParamInfo<OptimizerStates>& info) {
  std::string n(OptimizerStatesName(info.param));
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

class OptimizerStatesTest : public ::testing::TestWithParam<OptimizerStates> {};

// A format's bits depend on the elements and the step only: not on the
// sub-groups (int8's blocks are aligned to the element index, and every
// tensor starts a block), the optimizer's threads, where the parameters
// live, whether the step overlaps the next forward pass, or whether the
// states live in DRAM or on NVMe (read, stepped and written a sub-group at
// a time through the pipeline's buffers).
TEST_P(OptimizerStatesTest, BitsDoNotDependOnHowTheElementsAreCut) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Config base = FormatConfig(GetParam(), dir.str());
  const TrainResult want = Train(base, seed);
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
  struct Variant {
    const char* what;
    void (*apply)(Config*);
  };
  const Variant variants[] = {
      {"one sub-group", [](Config* c) { c->zero_optimization.sub_group_size = 1'000'000'000; }},
      {"sub-groups of 300", [](Config* c) { c->zero_optimization.sub_group_size = 300; }},
      {"one thread", [](Config* c) { c->strata.threads = 1; }},
      {"offload_param cpu",
       [](Config* c) { c->zero_optimization.offload_param.device = OffloadDevice::kCpu; }},
      {"offload_param nvme",
       [](Config* c) { c->zero_optimization.offload_param.device = OffloadDevice::kNvme; }},
      {"blocking step", [](Config* c) { c->strata.overlap_optimizer = false; }},
      // The NVMe pipeline steps the same shards from its buffers.
      {"offload_optimizer nvme",
       [](Config* c) { c->zero_optimization.offload_optimizer.device = OffloadDevice::kNvme; }},
      {"nvme/nvme, two pipeline buffers",
       [](Config* c) {
         c->zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
         c->zero_optimization.offload_optimizer.buffer_count = 2;
         c->zero_optimization.offload_param.device = OffloadDevice::kNvme;
       }},
      // The sums copied over from HBM a chunk at a time.
      {"gradient sums in HBM", [](Config* c) { c->strata.grad_tier = GradTier::kHbm; }},
      {"gradient sums on NVMe",
       [](Config* c) {
         c->zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
         c->strata.grad_tier = GradTier::kNvme;
       }},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.what);
    Config c = base;
    v.apply(&c);
    if (c.zero_optimization.offload_param.device == OffloadDevice::kNvme)
      c.zero_optimization.offload_param.nvme_path = {dir.str()};
    if (c.zero_optimization.offload_optimizer.device == OffloadDevice::kNvme)
      c.zero_optimization.offload_optimizer.nvme_path = {dir.str()};
    const TrainResult got = Train(c, seed);
    EXPECT_TRUE(BitwiseEqual(want.params, got.params));
    EXPECT_TRUE(BitwiseEqual(want.losses, got.losses));
  }
}

// The parameters stay near the fp32 run's (the formats round the moments,
// or the master, at each step), and differ from them: the format is used.
TEST_P(OptimizerStatesTest, StaysNearTheFp32Run) {
  testing::ScratchDir dir;
  const TrainResult fp32 = Train(FormatConfig(OptimizerStates::kFp32, dir.str()), 17);
  const TrainResult got = Train(FormatConfig(GetParam(), dir.str()), 17);
  ASSERT_EQ(fp32.params.size(), got.params.size());
  double worst = 0, moved = 0;
  const TrainResult init = [&] {
    TrainResult r;
    auto e = CreateEngine(FormatConfig(OptimizerStates::kFp32, dir.str()));
    EXPECT_TRUE(e.ok());
    if (e.ok()) {
      testing::RegisterToy(**e, 17, kModules);
      r.params = ReadAll(**e);
    }
    return r;
  }();
  ASSERT_EQ(init.params.size(), fp32.params.size());
  for (size_t p = 0; p < fp32.params.size(); ++p)
    for (size_t i = 0; i < fp32.params[p].size(); ++i) {
      worst = std::max(worst, std::fabs(double{got.params[p][i]} - fp32.params[p][i]));
      moved = std::max(moved, std::fabs(double{fp32.params[p][i]} - init.params[p][i]));
    }
  // Six steps of lr 1e-2 move a parameter by up to ~0.06. The moments'
  // formats stay within a tenth of that; a bf16 master within 4 of its
  // units in the last place at |p| < 1 (2^-8 each: stochastic rounding
  // at every step).
  const double tolerance = GetParam() == OptimizerStates::kBf16Master ? 4.0 / 256 : 0.006;
  EXPECT_GT(moved, 0.03);
  EXPECT_LT(worst, tolerance) << "moved " << moved;
  EXPECT_GT(worst, 0.0);
  std::printf("%s: largest difference from the fp32 run %.6f (largest move %.4f)\n",
              std::string(OptimizerStatesName(GetParam())).c_str(), worst, moved);
}

// The speculative step with compact states: the spare holds the states in
// their format (int8's from a block), so a redone window gets its bytes
// back; kept or redone, the parameters are the step after backward's bits.
// States in DRAM (the spare) and on NVMe (the inactive versions).
TEST_P(OptimizerStatesTest, SpeculativeStepKeepsTheBits) {
  testing::ScratchDir dir;
  EngineTestHooks hooks;
  hooks.speculation_steps_all_handed_over = true;  // what is speculated does not depend on timing
  for (OffloadDevice od : {OffloadDevice::kCpu, OffloadDevice::kNvme})
    for (double clip : {1e6, 1e-3}) {  // never clips (kept), always clips (redone)
      SCOPED_TRACE(fmt::format("{} states, clipping {}", OffloadDeviceName(od), clip));
      Config c = FormatConfig(GetParam(), dir.str());
      c.zero_optimization.offload_optimizer.device = od;
      if (od == OffloadDevice::kNvme) c.zero_optimization.offload_optimizer.nvme_path = {dir.str()};
      c.gradient_clipping = clip;
      auto run = [&](bool speculate, int64_t* speculated, int64_t* redone) {
        c.strata.speculative_step = speculate;
        auto e = CreateEngine(c, hooks);
        EXPECT_TRUE(e.ok()) << e.status();
        if (!e.ok()) return std::vector<std::vector<float>>();
        testing::RegisterToy(**e, 9, kModules);
        for (int s = 0; s < 3; ++s)
          for (int64_t k = 0; k < c.gradient_accumulation_steps; ++k) {
            testing::ToyMicroBatch(**e, static_cast<int>(s * c.gradient_accumulation_steps + k),
                                   kModules);
            auto st = (*e)->Step();
            EXPECT_TRUE(st.ok()) << st.status();
            if (!st.ok()) return std::vector<std::vector<float>>();
            *speculated += st->sub_groups_speculated;
            *redone += st->sub_groups_redone;
          }
        return ReadAll(**e);
      };
      int64_t speculated = 0, redone = 0, none = 0;
      const auto after = run(false, &none, &none);
      const auto spec = run(true, &speculated, &redone);
      ASSERT_FALSE(after.empty());
      EXPECT_TRUE(BitwiseEqual(after, spec));
      EXPECT_EQ(none, 0);
      EXPECT_GT(speculated, 0);
      EXPECT_EQ(redone, clip > 1 ? 0 : speculated);
    }
}

INSTANTIATE_TEST_SUITE_P(Formats, OptimizerStatesTest,
                         ::testing::Values(OptimizerStates::kBf16, OptimizerStates::kBf16Master,
                                           OptimizerStates::kInt8),
                         FormatName);

// The plan's DRAM row holds the format's bytes (named with the format), and
// those are the bytes the engine allocates.
TEST(OptimizerStatesPlan, TheRowsHoldTheFormatsBytes) {
  testing::ScratchDir dir;
  int64_t fp32_dram = 0;
  for (OptimizerStates f : {OptimizerStates::kFp32, OptimizerStates::kBf16,
                            OptimizerStates::kBf16Master, OptimizerStates::kInt8}) {
    SCOPED_TRACE(std::string(OptimizerStatesName(f)));
    const scheduler::HostArray::Live before = scheduler::HostArray::LiveBytes();
    auto e = CreateEngine(FormatConfig(f, dir.str()));
    ASSERT_TRUE(e.ok()) << e.status();
    testing::RegisterToy(**e, 3, kModules);
    std::vector<double> losses;
    testing::TrainToySteps(**e, FormatConfig(f, dir.str()), 0, 1, kModules, &losses);
    ASSERT_TRUE((*e)->Synchronize().ok());
    const scheduler::HostArray::Live after = scheduler::HostArray::LiveBytes();
    int64_t dram = 0;
    std::string detail;
    for (const TierBudget& b : (*e)->Budgets())
      if (b.tier == "dram") {
        dram = b.needed_bytes;
        detail = b.detail;
      }
    EXPECT_EQ(dram, after.pageable - before.pageable) << detail;
    if (f == OptimizerStates::kFp32) {
      fp32_dram = dram;
      EXPECT_THAT(detail, ::testing::Not(HasSubstr("(fp32)")));
      continue;
    }
    EXPECT_THAT(detail, HasSubstr(fmt::format("({})", OptimizerStatesName(f))));
    // 4 (bf16, int8: less the scales) or 6 bytes per element fewer.
    EXPECT_LT(dram, fp32_dram) << detail;
  }
}

}  // namespace
}  // namespace strata
