// Optimizer parameter groups (Engine::AddParamGroup): each group's lr,
// weight_decay and betas reach the optimizer in every placement (checked
// against AdamW's first step in closed form), SetLearningRate(group, ...)
// moves one group only, the schedule scales a group's own lr where DeepSpeed
// does (WarmupCosineLR) and refuses it where it sets every group's, bad
// groups are refused, and the groups are part of a checkpoint's identity.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "src/scheduler/scheduler.h"
#include "strata/engine.h"
#include "tests/scheduler/toy_engine_model.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using testing::Load;
using testing::ReadAll;
using testing::Store;
using testing::ToyDType;
using testing::ToyNumel;

constexpr int kModules = 4;

// Registers the toy model with every bias in `bias_group` (weights in group 0).
void RegisterGrouped(Engine& e, uint64_t seed, int bias_group) {
  auto rng = testing::SeededRng(seed);
  for (int m = 0; m < kModules; ++m)
    for (int i = 0; i < 2; ++i) {
      const int64_t n = ToyNumel(m, i);
      std::vector<float> init = testing::RandomFloats(rng, static_cast<size_t>(n), -0.5f, 0.5f);
      ParamSpec s;
      s.name = fmt::format("m{}.{}", m, i == 0 ? "weight" : "bias");
      s.numel = n;
      s.dtype = ToyDType(m, i);
      s.module = m;
      s.init = init;
      s.group = i == 1 ? bias_group : 0;
      ASSERT_TRUE(e.RegisterParameter(s).ok()) << s.name;
    }
}

// One micro-batch over every module; returns the gradients as the engine
// received them (rounded to each parameter's dtype), per parameter id.
std::vector<std::vector<float>> MicroBatch(Engine& e, int batch) {
  std::vector<std::vector<float>> grads(2 * kModules);
  for (int m = 0; m < kModules; ++m) {
    EXPECT_TRUE(e.BeforeForward(m).ok());
    EXPECT_TRUE(e.AfterForward(m).ok());
  }
  for (int m = kModules - 1; m >= 0; --m) {
    auto v = e.BeforeBackward(m);
    EXPECT_TRUE(v.ok()) << v.status();
    if (!v.ok()) return {};
    for (int i = 0; i < 2; ++i) {
      const DType t = ToyDType(m, i);
      std::vector<float>& g = grads[static_cast<size_t>(2 * m + i)];
      for (int64_t j = 0; j < ToyNumel(m, i); ++j) {
        Store(v->grads[i], t, j, std::sin(0.3f * static_cast<float>(j) + 1.7f * m + batch));
        g.push_back(Load(v->grads[i], t, j));
      }
    }
    EXPECT_TRUE(e.AfterBackward(m).ok());
  }
  return grads;
}

Config GroupConfig(OffloadDevice opt, OffloadDevice par, const std::string& dir) {
  Config c = testing::ToyConfig(opt, par, dir);
  c.optimizer.lr = 1e-2;
  c.optimizer.weight_decay = 0.1;
  c.strata.overlap_optimizer = false;
  return c;
}

// AdamW's first step: m̂ = g, v̂ = g², so p ← p (1 - lr wd) - lr g / (|g| + eps).
float FirstAdamWStep(float p, float g, double lr, double wd, double eps) {
  return static_cast<float>(p * (1.0 - lr * wd) - lr * g / (std::fabs(g) + eps));
}

struct Placement {
  OffloadDevice opt, par;
  bool device_optimizer;
};

TEST(ParamGroupsTest, EachGroupsHyperparametersReachTheOptimizerInEveryPlacement) {
  testing::ScratchDir dir;
  for (const Placement& pl : {Placement{OffloadDevice::kCpu, OffloadDevice::kNone, false},
                              Placement{OffloadDevice::kCpu, OffloadDevice::kCpu, false},
                              Placement{OffloadDevice::kNvme, OffloadDevice::kNvme, false},
                              Placement{OffloadDevice::kNone, OffloadDevice::kNone, true}}) {
    SCOPED_TRACE(std::string(OffloadDeviceName(pl.opt)) + "/" +
                 std::string(OffloadDeviceName(pl.par)) +
                 (pl.device_optimizer ? " (device optimizer)" : ""));
    const Config c = GroupConfig(pl.opt, pl.par, dir.str());
    EngineTestHooks hooks;
    hooks.device_optimizer = pl.device_optimizer;
    auto e = CreateEngine(c, hooks);
    ASSERT_TRUE(e.ok()) << e.status();
    ParamGroupSpec no_decay;
    no_decay.name = "no_decay";
    no_decay.weight_decay = 0.0;
    no_decay.lr = 4e-3;
    auto gid = (*e)->AddParamGroup(no_decay);
    ASSERT_TRUE(gid.ok()) << gid.status();
    EXPECT_EQ(*gid, 1);
    EXPECT_EQ((*e)->num_param_groups(), 2);
    RegisterGrouped(**e, 5, *gid);
    const auto before = ReadAll(**e);
    const auto grads = MicroBatch(**e, 0);
    auto st = (*e)->Step();
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_TRUE(st->applied);
    EXPECT_EQ(st->lr, 1e-2);
    EXPECT_THAT(st->group_lrs, ::testing::ElementsAre(1e-2, 4e-3));
    const auto after = ReadAll(**e);
    for (size_t id = 0; id < after.size(); ++id) {
      const bool bias = id % 2 == 1;
      const double lr = bias ? 4e-3 : 1e-2, wd = bias ? 0.0 : 0.1;
      for (size_t j = 0; j < after[id].size(); ++j)
        ASSERT_NEAR(after[id][j],
                    FirstAdamWStep(before[id][j], grads[id][j], lr, wd, c.optimizer.eps), 2e-6)
            << "parameter " << id << " element " << j;
    }
    // SetLearningRate of one group: lr 0 leaves that group exactly where it
    // is (AdamW's decay is lr × wd too); the other group moves.
    ASSERT_TRUE((*e)->SetLearningRate(1, 0.0).ok());
    EXPECT_EQ((*e)->learning_rate(1), 0.0);
    EXPECT_EQ((*e)->learning_rate(0), 1e-2);
    MicroBatch(**e, 1);
    st = (*e)->Step();
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_TRUE((*e)->Synchronize().ok());
    const auto second = ReadAll(**e);
    for (size_t id = 0; id < second.size(); ++id) {
      if (id % 2 == 1)
        EXPECT_EQ(second[id], after[id]) << "parameter " << id << " (lr 0) moved";
      else
        EXPECT_NE(second[id], after[id]) << "parameter " << id << " did not move";
    }
  }
}

TEST(ParamGroupsTest, GroupBetasAndEpsReachTheOptimizer) {
  testing::ScratchDir dir;
  // With eps as large as the gradients, the first step is lr g / (|g| + eps):
  // a group's eps shows in every element.
  const Config c = GroupConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok()) << e.status();
  ParamGroupSpec g;
  g.eps = 0.5;
  g.beta1 = 0.5;
  g.beta2 = 0.75;
  ASSERT_TRUE((*e)->AddParamGroup(g).ok());
  EXPECT_EQ((*e)->param_group(1).name, "group 1");
  RegisterGrouped(**e, 6, 1);
  const auto before = ReadAll(**e);
  const auto grads = MicroBatch(**e, 0);
  ASSERT_TRUE((*e)->Step().ok());
  const auto after = ReadAll(**e);
  for (size_t id = 1; id < after.size(); id += 2)
    for (size_t j = 0; j < after[id].size(); ++j)
      ASSERT_NEAR(after[id][j], FirstAdamWStep(before[id][j], grads[id][j], 1e-2, 0.1, 0.5), 2e-6)
          << "parameter " << id << " element " << j;
  // Second step with the group's betas: m = b1 m + (1-b1) g etc., checked on
  // one element against the formula in double.
  const auto grads2 = MicroBatch(**e, 1);
  ASSERT_TRUE((*e)->Step().ok());
  const auto after2 = ReadAll(**e);
  const size_t id = 1, j = 7;
  const double g1 = grads[id][j], g2 = grads2[id][j];
  const double m = 0.5 * (0.5 * g1) + 0.5 * g2, v = 0.75 * (0.25 * g1 * g1) + 0.25 * g2 * g2;
  const double mhat = m / (1 - 0.25), vhat = v / (1 - 0.5625);
  const double expect = after[id][j] * (1 - 1e-2 * 0.1) - 1e-2 * mhat / (std::sqrt(vhat) + 0.5);
  EXPECT_NEAR(after2[id][j], expect, 2e-6);
}

TEST(ParamGroupsTest, SchedulesAndGroupLearningRates) {
  testing::ScratchDir dir;
  // WarmupCosineLR scales each group's own lr (as DeepSpeed's does).
  Config c = GroupConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  c.scheduler.type = LrScheduleType::kWarmupCosineLR;
  c.scheduler.total_num_steps = 10;
  c.scheduler.warmup_num_steps = 3;
  c.scheduler.warmup_type = WarmupType::kLinear;
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok()) << e.status();
  ParamGroupSpec g;
  g.lr = 4e-3;
  ASSERT_TRUE((*e)->AddParamGroup(g).ok());
  RegisterGrouped(**e, 7, 1);
  for (int s = 0; s < 4; ++s) {
    MicroBatch(**e, s);
    auto st = (*e)->Step();
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_EQ(st->group_lrs.size(), 2u);
    const double ratio = st->group_lrs[0] / 1e-2;
    EXPECT_NEAR(st->group_lrs[1], 4e-3 * ratio, 1e-15) << "step " << s;
  }
  EXPECT_GT((*e)->learning_rate(1), 0.0);
  // A schedule that sets every group's lr refuses a group lr; one that
  // cycles momentum refuses group betas.
  c.scheduler.type = LrScheduleType::kWarmupLR;
  auto w = CreateEngine(c);
  ASSERT_TRUE(w.ok());
  auto refused = (*w)->AddParamGroup(g);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("WarmupLR"));
  ParamGroupSpec wd_only;
  wd_only.weight_decay = 0.0;
  EXPECT_TRUE((*w)->AddParamGroup(wd_only).ok());
  c.scheduler.type = LrScheduleType::kOneCycle;
  c.scheduler.cycle_min_lr = 1e-4;
  c.scheduler.cycle_max_lr = 1e-3;
  auto o = CreateEngine(c);
  ASSERT_TRUE(o.ok());
  ParamGroupSpec betas;
  betas.beta1 = 0.8;
  auto r = (*o)->AddParamGroup(betas);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("cycle_momentum"));
}

TEST(ParamGroupsTest, BadGroupsAreRefused) {
  testing::ScratchDir dir;
  const Config c = GroupConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok());
  ParamGroupSpec bad;
  bad.weight_decay = -1;
  auto r = (*e)->AddParamGroup(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("weight_decay -1"));
  bad = ParamGroupSpec();
  bad.beta2 = 1.0;
  EXPECT_THAT((*e)->AddParamGroup(bad).status().message(), HasSubstr("beta2 1 is not allowed"));
  ParamGroupSpec named;
  named.name = "default";
  EXPECT_THAT((*e)->AddParamGroup(named).status().message(), HasSubstr("duplicate group name"));
  // A parameter in a group that does not exist.
  ParamSpec s;
  s.name = "w";
  s.numel = 10;
  s.initializer = [](std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); };
  s.group = 3;
  auto reg = (*e)->RegisterParameter(s);
  ASSERT_FALSE(reg.ok());
  EXPECT_THAT(reg.status().message(), HasSubstr("parameter group 3 does not exist"));
  s.group = 0;
  ASSERT_TRUE((*e)->RegisterParameter(s).ok());
  EXPECT_EQ((*e)->SetLearningRate(2, 1e-3).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*e)->Plan().ok());
  EXPECT_EQ((*e)->AddParamGroup(ParamGroupSpec()).status().code(), StatusCode::kFailedPrecondition);
}

TEST(ParamGroupsTest, GroupsArePartOfTheCheckpointsIdentity) {
  testing::ScratchDir dir, ckpt;
  const Config c = GroupConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  auto make = [&](int bias_group, std::optional<double> wd) {
    auto e = CreateEngine(c);
    EXPECT_TRUE(e.ok());
    ParamGroupSpec g;
    g.weight_decay = wd;
    EXPECT_TRUE((*e)->AddParamGroup(g).ok());
    RegisterGrouped(**e, 8, bias_group);
    return std::move(*e);
  };
  {
    auto e = make(1, 0.0);
    MicroBatch(*e, 0);
    ASSERT_TRUE(e->Step().ok());
    ASSERT_TRUE(e->SaveCheckpoint(ckpt.str(), {}).ok());
  }
  // The same groups: restored, bitwise.
  {
    auto e = make(1, 0.0);
    Status s = e->LoadCheckpoint(ckpt.str(), nullptr);
    ASSERT_TRUE(s.ok()) << s;
  }
  // A group's weight_decay differs.
  {
    auto e = make(1, 0.05);
    Status s = e->LoadCheckpoint(ckpt.str(), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(s.message(), HasSubstr("weight_decay 0.0 in the checkpoint, 0.05 now"));
  }
  // The biases in group 0 now.
  {
    auto e = make(0, 0.0);
    Status s = e->LoadCheckpoint(ckpt.str(), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(s.message(),
                HasSubstr("m0.bias: optimizer parameter group 1 in the checkpoint, 0"));
  }
  // No groups at all.
  {
    auto e = CreateEngine(c);
    ASSERT_TRUE(e.ok());
    RegisterGrouped(**e, 8, 0);
    Status s = (*e)->LoadCheckpoint(ckpt.str(), nullptr);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(s.message(), HasSubstr("optimizer parameter group 1 in the checkpoint, 0 now"));
  }
}

}  // namespace
}  // namespace strata
