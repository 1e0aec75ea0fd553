// The learning rate in the Engine: the config's schedule advances once per
// applied optimizer step (not on a step skipped for overflow), shows in
// StepStats::lr, continues bitwise after a checkpoint; SetLearningRate drives
// it from outside (and is refused beside a schedule); a Step() that would
// apply no gradients is refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "src/scheduler/scheduler.h"
#include "strata/engine.h"
#include "strata/strata_c.h"
#include "tests/scheduler/toy_engine_model.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using testing::BitwiseEqual;
using ::testing::HasSubstr;
using testing::Load;
using testing::ReadAll;
using testing::Store;

constexpr int kModules = 3;

// Gradients from the parameters and the batch index; `poison` puts an inf
// into module 1's gradient (an fp16 overflow).
void MicroBatch(Engine& e, int batch, bool poison = false) {
  for (int m = 0; m < kModules; ++m) {
    ASSERT_TRUE(e.BeforeForward(m).ok());
    ASSERT_TRUE(e.AfterForward(m).ok());
  }
  const float scale = static_cast<float>(e.loss_scale());
  for (int m = kModules - 1; m >= 0; --m) {
    auto v = e.BeforeBackward(m);
    ASSERT_TRUE(v.ok()) << v.status();
    for (int i = 0; i < 2; ++i) {
      const DType t = testing::ToyDType(m, i);
      for (int64_t j = 0; j < testing::ToyNumel(m, i); ++j) {
        const float p = Load(v->params[i], t, j);
        const float g = 0.5f * p + 0.1f * std::sin(static_cast<float>(batch) + 0.37f * j + m);
        Store(v->grads[i], t, j, scale * g);
      }
    }
    if (poison && m == 1)
      Store(v->grads[0], testing::ToyDType(1, 0), 0, std::numeric_limits<float>::infinity());
    ASSERT_TRUE(e.AfterBackward(m).ok());
  }
}

std::unique_ptr<Engine> NewEngine(const Config& c) {
  auto e = CreateEngine(c);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return nullptr;
  testing::RegisterToy(**e, 7, kModules);
  return std::move(*e);
}

Config Scheduled(const std::string& dir) {
  Config c = testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir);
  c.scheduler.type = LrScheduleType::kWarmupDecayLR;
  c.scheduler.warmup_min_lr = 1e-3;
  c.scheduler.warmup_max_lr = 2e-2;
  c.scheduler.warmup_num_steps = 3;
  c.scheduler.warmup_type = WarmupType::kLinear;
  c.scheduler.total_num_steps = 6;
  return c;
}

TEST(EngineLr, ScheduleSetsEachStepsLrAndEqualsSettingItFromOutside) {
  testing::ScratchDir dir;
  const Config sched = Scheduled(dir.str());
  Config plain = sched;
  plain.scheduler = SchedulerConfig{};
  auto a = NewEngine(sched);
  auto b = NewEngine(plain);
  auto constant = NewEngine(plain);
  ASSERT_TRUE(a && b && constant);
  std::vector<double> lrs;
  for (int k = 0; k < 8; ++k) {
    const double want = ScheduleAt(sched, k).lr;
    EXPECT_EQ(a->learning_rate(), want);
    ASSERT_TRUE(b->SetLearningRate(want).ok());
    EXPECT_EQ(b->learning_rate(), want);
    for (Engine* e : {a.get(), b.get(), constant.get()}) {
      MicroBatch(*e, k);
      auto st = e->Step();
      ASSERT_TRUE(st.ok()) << st.status();
      EXPECT_TRUE(st->applied);
      if (e != constant.get()) {
        EXPECT_EQ(st->lr, want) << k;
      }
    }
    lrs.push_back(want);
  }
  // The schedule moved (warmup, then decay back to warmup_min_lr at
  // total_num_steps) ...
  EXPECT_EQ(lrs[0], 1e-3);
  EXPECT_NEAR(lrs[4], 2e-2, 1e-15);
  EXPECT_LT(lrs[5], lrs[4]);
  EXPECT_EQ(lrs[7], 1e-3);
  // ... the schedule and the same lrs set from outside train bitwise alike,
  // and differently from the constant optimizer.params.lr.
  const auto pa = ReadAll(*a);
  EXPECT_TRUE(BitwiseEqual(pa, ReadAll(*b)));
  EXPECT_FALSE(BitwiseEqual(pa, ReadAll(*constant)));
  EXPECT_EQ(constant->learning_rate(), plain.optimizer.lr);
}

TEST(EngineLr, OverflowSkippedStepDoesNotAdvanceTheSchedule) {
  testing::ScratchDir dir;
  Config c = Scheduled(dir.str());
  c.fp16.enabled = true;
  c.fp16.initial_scale_power = 8;
  auto e = NewEngine(c);
  ASSERT_TRUE(e);
  for (int k = 0; k < 2; ++k) {
    MicroBatch(*e, k);
    ASSERT_TRUE(e->Step().ok());
  }
  const double lr2 = ScheduleAt(c, 2).lr;
  EXPECT_EQ(e->learning_rate(), lr2);
  MicroBatch(*e, 2, /*poison=*/true);
  auto st = e->Step();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->overflow);
  EXPECT_EQ(st->lr, lr2);
  EXPECT_EQ(e->learning_rate(), lr2);  // not advanced
  MicroBatch(*e, 3);
  st = e->Step();
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->applied);
  EXPECT_EQ(st->lr, lr2);
  EXPECT_EQ(e->learning_rate(), ScheduleAt(c, 3).lr);
}

TEST(EngineLr, ResumedRunContinuesTheScheduleBitwise) {
  testing::ScratchDir dir;
  const Config c = Scheduled(dir.str());
  auto whole = NewEngine(c);
  ASSERT_TRUE(whole);
  std::vector<double> whole_lrs, resumed_lrs;
  for (int k = 0; k < 6; ++k) {
    MicroBatch(*whole, k);
    auto st = whole->Step();
    ASSERT_TRUE(st.ok());
    whole_lrs.push_back(st->lr);
  }
  const std::string ckpt = dir.str() + "/ckpt";
  {
    auto first = NewEngine(c);
    ASSERT_TRUE(first);
    for (int k = 0; k < 3; ++k) {
      MicroBatch(*first, k);
      auto st = first->Step();
      ASSERT_TRUE(st.ok());
      resumed_lrs.push_back(st->lr);
    }
    ASSERT_TRUE(first->SaveCheckpoint(ckpt, {}).ok());
  }
  auto second = NewEngine(c);
  ASSERT_TRUE(second);
  ASSERT_TRUE(second->LoadCheckpoint(ckpt, nullptr).ok());
  EXPECT_EQ(second->learning_rate(), ScheduleAt(c, 3).lr);
  for (int k = 3; k < 6; ++k) {
    MicroBatch(*second, k);
    auto st = second->Step();
    ASSERT_TRUE(st.ok());
    resumed_lrs.push_back(st->lr);
  }
  EXPECT_TRUE(BitwiseEqual(whole_lrs, resumed_lrs));
  EXPECT_TRUE(BitwiseEqual(ReadAll(*whole), ReadAll(*second)));
}

TEST(EngineLr, SetLearningRateRefusals) {
  testing::ScratchDir dir;
  auto sched = NewEngine(Scheduled(dir.str()));
  ASSERT_TRUE(sched);
  Status s = sched->SetLearningRate(0.1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("scheduler section (WarmupDecayLR)"));
  auto plain = NewEngine(testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str()));
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->SetLearningRate(-1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plain->SetLearningRate(std::nan("")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plain->learning_rate(), 1e-2);
}

TEST(EngineLr, CApi) {
  strata_engine* e = nullptr;
  ASSERT_EQ(strata_engine_create_from_json(
                R"({"optimizer": {"params": {"lr": 0.004}}, "strata": {"device": "host"}})", &e),
            STRATA_OK)
      << strata_last_error();
  EXPECT_EQ(strata_learning_rate(e), 0.004);
  EXPECT_EQ(strata_set_learning_rate(e, 0.5), STRATA_OK);
  EXPECT_EQ(strata_learning_rate(e), 0.5);
  EXPECT_EQ(strata_set_learning_rate(e, -1), STRATA_INVALID_ARGUMENT);
  strata_engine_destroy(e);
  ASSERT_EQ(strata_engine_create_from_json(
                R"({"scheduler": {"type": "LRRangeTest"}, "strata": {"device": "host"}})", &e),
            STRATA_OK)
      << strata_last_error();
  EXPECT_EQ(strata_learning_rate(e), 1e-3);  // lr_range_test_min_lr
  EXPECT_EQ(strata_set_learning_rate(e, 0.5), STRATA_FAILED_PRECONDITION);
  EXPECT_THAT(strata_last_error(), HasSubstr("scheduler section (LRRangeTest)"));
  strata_engine_destroy(e);
}

TEST(EngineStep, StepWithoutGradientsIsRefused) {
  testing::ScratchDir dir;
  Config c = testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  c.gradient_accumulation_steps = c.train_batch_size = 2;
  auto e = NewEngine(c);
  ASSERT_TRUE(e);
  const auto before = ReadAll(*e);
  // A whole window without backward: the second Step() would apply zeros.
  ASSERT_TRUE(e->Step().ok());
  auto st = e->Step();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.status().message(), HasSubstr("no gradients were handed over"));
  EXPECT_TRUE(BitwiseEqual(before, ReadAll(*e)));  // weight decay did not move them
  // A window with gradients steps; the one after it needs its own.
  MicroBatch(*e, 0);
  st = e->Step();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->applied);
  ASSERT_TRUE(e->Step().ok());
  EXPECT_FALSE(e->Step().ok());
  ASSERT_TRUE(e->ZeroGrad().ok());
}

}  // namespace
}  // namespace strata
