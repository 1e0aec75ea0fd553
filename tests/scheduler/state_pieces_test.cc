// The optimizer pipeline in pieces (offload_optimizer nvme): a pinned budget
// that does not hold buffer_count buffers of a whole sub-group streams each
// sub-group through buffers that it does hold, a piece at a time
// (TierPlan::state_piece_elems, Layout::StatePieces). The pieces change no
// bit: every state format, the gradient sums in DRAM or on NVMe, the
// parameters on NVMe, the speculative step, and checkpoints written with
// pieces and loaded without (and back) give the bits of whole sub-groups.
// The plan's arithmetic: plan_test.cc; the ring's faults:
// optimizer_step_test.cc.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "src/scheduler/scheduler.h"
#include "strata/config.h"
#include "strata/engine.h"
#include "tests/scheduler/toy_engine_model.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Three modules: a weight of 100000 + 12345 m elements (bf16, fp32, bf16)
// and a bias of 77 + m (fp32): one sub-group of about 340K elements, many
// quantization blocks, tails that end nowhere near a piece.
constexpr int kModules = 3;
int64_t Numel(int m, int i) { return i == 0 ? 100000 + 12345 * m : 77 + m; }
DType Dtype(int m, int i) { return i == 1 || m == 1 ? DType::kFp32 : DType::kBf16; }

Config PiecesConfig(OptimizerStates f, const std::string& dir, int64_t pinned) {
  Config c = testing::ToyConfig(OffloadDevice::kNvme, OffloadDevice::kNone, dir);
  c.gradient_accumulation_steps = c.train_batch_size = 2;
  c.gradient_clipping = 1.0;  // clips: the step depends on the global norm's bits
  c.zero_optimization.sub_group_size = 1'000'000'000;
  c.zero_optimization.reduce_bucket_size = 5000;
  c.strata.optimizer_states = f;
  c.strata.pinned_budget_bytes = pinned;
  return c;
}

void Register(Engine& e, uint64_t seed) {
  auto rng = testing::SeededRng(seed);
  for (int m = 0; m < kModules; ++m)
    for (int i = 0; i < 2; ++i) {
      ParamSpec s;
      s.name = fmt::format("m{}.{}", m, i == 0 ? "weight" : "bias");
      s.numel = Numel(m, i);
      s.dtype = Dtype(m, i);
      s.module = m;
      const std::vector<float> init =
          testing::RandomFloats(rng, static_cast<size_t>(s.numel), -0.5f, 0.5f);
      s.init = init;
      ASSERT_TRUE(e.RegisterParameter(s).ok());
    }
}

// One micro-batch: the loss is the sum of the parameters; the gradient of
// each element 0.5 p + 0.1 sin(batch + 0.37 j + m), scaled.
double MicroBatch(Engine& e, int batch) {
  double loss = 0;
  for (int m = 0; m < kModules; ++m) {
    auto v = e.BeforeForward(m);
    EXPECT_TRUE(v.ok()) << v.status();
    if (!v.ok()) return NAN;
    for (int i = 0; i < 2; ++i)
      for (int64_t j = 0; j < Numel(m, i); ++j) loss += testing::Load(v->params[i], Dtype(m, i), j);
    EXPECT_TRUE(e.AfterForward(m).ok());
  }
  const float scale = static_cast<float>(e.loss_scale());
  for (int m = kModules - 1; m >= 0; --m) {
    auto v = e.BeforeBackward(m);
    EXPECT_TRUE(v.ok()) << v.status();
    if (!v.ok()) return NAN;
    for (int i = 0; i < 2; ++i)
      for (int64_t j = 0; j < Numel(m, i); ++j) {
        const float p = testing::Load(v->params[i], Dtype(m, i), j);
        const float g = 0.5f * p + 0.1f * std::sin(static_cast<float>(batch) + 0.37f * j + m);
        testing::Store(v->grads[i], Dtype(m, i), j, scale * g);
      }
    EXPECT_TRUE(e.AfterBackward(m).ok());
  }
  return loss;
}

struct Result {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  std::string pinned_row;
  int64_t speculated = 0;
};

void Steps(Engine& e, const Config& c, int from, int to, Result* r) {
  for (int s = from; s < to; ++s) {
    double loss = 0;
    for (int64_t k = 0; k < c.gradient_accumulation_steps; ++k) {
      loss += MicroBatch(e, static_cast<int>(s * c.gradient_accumulation_steps + k));
      auto st = e.Step();
      ASSERT_TRUE(st.ok()) << st.status();
      r->speculated += st->sub_groups_speculated;
    }
    r->losses.push_back(loss);
  }
}

void ReadBack(Engine& e, Result* r) {
  for (int id = 0; id < e.num_parameters(); ++id) {
    std::vector<float> v(static_cast<size_t>(Numel(id / 2, id % 2)));
    ASSERT_TRUE(e.ReadParameter(id, v).ok());
    r->params.push_back(std::move(v));
  }
  for (const TierBudget& b : e.Budgets())
    if (b.tier == "pinned") r->pinned_row = b.detail;
}

constexpr int kSteps = 4;
// Pinned budgets: every buffer of a whole sub-group, or the fixed pools
// and buffer_count buffers of a piece (PiecesGiveTheBitsOfWholeSubGroups).
constexpr int64_t kWhole = int64_t{1} << 30;
constexpr int64_t kCut = int64_t{4608} << 10;

Result Train(const Config& c, uint64_t seed, const EngineTestHooks& hooks = {}) {
  Result r;
  auto e = CreateEngine(c, hooks);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return r;
  Register(**e, seed);
  Steps(**e, c, 0, kSteps, &r);
  ReadBack(**e, &r);
  return r;
}

std::string FormatName(const ::testing::TestParamInfo<OptimizerStates>& info) {
  std::string n(OptimizerStatesName(info.param));
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

class StatePiecesTest : public ::testing::TestWithParam<OptimizerStates> {};

// Each cut budget holds the fixed pools (gradient staging 39 KiB, with the
// parameters on NVMe 9 buffers of the largest module, 440 KiB) and
// buffer_count buffers of a piece (at least 64K elements: 1 MiB with fp32
// states and gradients), not of the whole sub-group (4 MiB with fp32).
TEST_P(StatePiecesTest, PiecesGiveTheBitsOfWholeSubGroups) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Variant {
    const char* what;
    int64_t cut_kib;
    void (*apply)(Config*);
  };
  const Variant variants[] = {
      {"gradient sums in DRAM", 4608, [](Config*) {}},
      {"gradient sums on NVMe", 4608, [](Config* c) { c->strata.grad_tier = GradTier::kNvme; }},
      {"one pipeline buffer", 1536,
       [](Config* c) { c->zero_optimization.offload_optimizer.buffer_count = 1; }},
      {"parameters on NVMe", 8704,
       [](Config* c) { c->zero_optimization.offload_param.device = OffloadDevice::kNvme; }},
      {"blocking step", 4608, [](Config* c) { c->strata.overlap_optimizer = false; }},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.what);
    Config whole = PiecesConfig(GetParam(), dir.str(), kWhole);
    v.apply(&whole);
    if (whole.zero_optimization.offload_param.device == OffloadDevice::kNvme)
      whole.zero_optimization.offload_param.nvme_path = {dir.str()};
    Config cut = whole;
    cut.strata.pinned_budget_bytes = v.cut_kib << 10;
    const Result want = Train(whole, seed);
    const Result got = Train(cut, seed);
    ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
    EXPECT_THAT(want.pinned_row, Not(HasSubstr("in pieces of")));
    EXPECT_THAT(got.pinned_row, HasSubstr("in pieces of"));
    EXPECT_THAT(got.pinned_row, Not(HasSubstr("smallest")));
    EXPECT_TRUE(testing::BitwiseEqual(want.params, got.params));
    EXPECT_TRUE(testing::BitwiseEqual(want.losses, got.losses));
  }
}

// The speculative step reads, steps and writes a handed-over sub-group
// piece by piece; kept (no clipping) or redone (clipping), the bits are
// those of the step after backward.
TEST_P(StatePiecesTest, SpeculativeStepInPieces) {
  testing::ScratchDir dir;
  EngineTestHooks hooks;
  hooks.speculation_steps_all_handed_over = true;  // what is speculated does not depend on timing
  for (double clip : {1e6, 1e-3}) {
    SCOPED_TRACE(fmt::format("clipping {}", clip));
    // (Four buffers of a compact format's sub-group fit the fp32 budget.)
    Config c = PiecesConfig(GetParam(), dir.str(),
                            GetParam() == OptimizerStates::kFp32 ? kCut : int64_t{2560} << 10);
    c.gradient_clipping = clip;
    c.zero_optimization.sub_group_size = 150'000;  // speculation takes whole sub-groups
    c.strata.speculative_step = false;
    const Result after = Train(c, 5, hooks);
    c.strata.speculative_step = true;
    const Result spec = Train(c, 5, hooks);
    EXPECT_THAT(spec.pinned_row, HasSubstr("in pieces of"));
    EXPECT_GT(spec.speculated, 0);
    EXPECT_TRUE(testing::BitwiseEqual(after.params, spec.params));
    EXPECT_TRUE(testing::BitwiseEqual(after.losses, spec.losses));
  }
}

// A checkpoint saved with pieces resumes without them and the other way
// round (the states file holds every sub-group decoded), and
// ReadParameter/WriteParameter reach the masters inside the pieces.
TEST_P(StatePiecesTest, CheckpointsAndParameterAccessAcrossPieces) {
  testing::ScratchDir dir;
  const Config whole = PiecesConfig(GetParam(), dir.str(), kWhole);
  const Config cut = PiecesConfig(GetParam(), dir.str(), kCut);
  const Result straight = Train(whole, 11);
  for (bool save_cut : {true, false}) {
    SCOPED_TRACE(save_cut ? "saved in pieces, resumed whole" : "saved whole, resumed in pieces");
    const std::string ckpt = dir.str() + (save_cut ? "/ckpt-cut" : "/ckpt-whole");
    Result r;
    {
      const Config& c = save_cut ? cut : whole;
      auto e = CreateEngine(c);
      ASSERT_TRUE(e.ok()) << e.status();
      Register(**e, 11);
      Steps(**e, c, 0, 2, &r);
      CheckpointInfo info;
      ASSERT_TRUE((*e)->SaveCheckpoint(ckpt, info).ok());
    }
    {
      const Config& c = save_cut ? whole : cut;
      auto e = CreateEngine(c);
      ASSERT_TRUE(e.ok()) << e.status();
      Register(**e, 99);  // other initial values: the checkpoint replaces them
      CheckpointInfo info;
      ASSERT_TRUE((*e)->LoadCheckpoint(ckpt, &info).ok());
      Steps(**e, c, 2, kSteps, &r);
      ReadBack(**e, &r);
    }
    EXPECT_TRUE(testing::BitwiseEqual(straight.params, r.params));
    EXPECT_TRUE(testing::BitwiseEqual(straight.losses, r.losses));
  }
  // WriteParameter into a piece boundary's neighbourhood, read back.
  auto e = CreateEngine(cut);
  ASSERT_TRUE(e.ok()) << e.status();
  Register(**e, 3);
  Result r;
  Steps(**e, cut, 0, 1, &r);
  std::vector<float> w(static_cast<size_t>(Numel(1, 0)));
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.001f * static_cast<float>(i % 977) - 0.3f;
  ASSERT_TRUE((*e)->WriteParameter(2, w).ok());
  std::vector<float> back(w.size());
  ASSERT_TRUE((*e)->ReadParameter(2, back).ok());
  // (A bf16 master rounds what it is given.)
  for (size_t i = 0; i < w.size(); ++i)
    ASSERT_NEAR(back[i], w[i], GetParam() == OptimizerStates::kBf16Master ? 2e-3 : 0.0) << i;
}

INSTANTIATE_TEST_SUITE_P(Formats, StatePiecesTest,
                         ::testing::Values(OptimizerStates::kFp32, OptimizerStates::kBf16,
                                           OptimizerStates::kBf16Master, OptimizerStates::kInt8),
                         FormatName);

}  // namespace
}  // namespace strata
