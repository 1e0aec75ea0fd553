// The scheduler section: reading (DeepSpeed's keys, defaults, required keys,
// "auto") and ScheduleAt against reference formulas written out per step
// (step n = the n-th applied optimizer step, n >= 1, i.e. ScheduleAt(c, n - 1)),
// plus hand-computed values at the warmup boundary and past the end.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <string>

#include "strata/config.h"

namespace strata {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

Config Parse(const std::string& text, const AutoValues& autos = {}) {
  StatusOr<Config> c = ParseConfig(text, "<string>", autos);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : Config{};
}

std::string Error(const std::string& text) {
  StatusOr<Config> c = ParseConfig(text);
  EXPECT_FALSE(c.ok()) << text;
  return c.ok() ? "" : std::string(c.status().message());
}

// The lr of the n-th optimizer step (n >= 1).
double LrOfStep(const Config& c, int n) { return ScheduleAt(c, n - 1).lr; }

TEST(LrSchedule, NoSectionKeepsTheOptimizerLr) {
  Config c = Parse(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.003}}})");
  EXPECT_EQ(c.scheduler.type, LrScheduleType::kNone);
  for (int n : {1, 2, 100, 100000}) EXPECT_EQ(LrOfStep(c, n), 0.003);
  EXPECT_EQ(ScheduleAt(c, 7).beta1, 0.9);
  EXPECT_EQ(ScheduleAt(c, 7).beta2, 0.999);
}

TEST(LrSchedule, WarmupLRLinearByHand) {
  // min 0.1, max 1.1 over 4 steps: DeepSpeed's iteration i = n - 2 gives
  // steps 1..7 = 0.1, 0.1, 0.35, 0.6, 0.85, 1.1, 1.1.
  Config c = Parse(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.1,
      "warmup_max_lr": 1.1, "warmup_num_steps": 4, "warmup_type": "linear"}}})");
  const double want[] = {0.1, 0.1, 0.35, 0.6, 0.85, 1.1, 1.1};
  for (int n = 1; n <= 7; ++n) EXPECT_NEAR(LrOfStep(c, n), want[n - 1], 1e-15) << n;
  EXPECT_NEAR(LrOfStep(c, 1000), 1.1, 1e-15);
}

TEST(LrSchedule, WarmupLRLogAgainstTheFormula) {
  Config c = Parse(R"({"optimizer": {"params": {"lr": 0.02}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})");
  // Defaults: min 0, max = optimizer.params.lr, log warmup.
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 0.02);
  EXPECT_EQ(c.scheduler.warmup_type, WarmupType::kLog);
  auto ref = [](int n) {
    if (n == 1) return 0.0;
    const int i = n - 2;
    return i < 10 ? 0.02 * std::log(i + 1.0) / std::log(10.0) : 0.02;
  };
  for (int n : {1, 2, 3, 5, 10, 11, 12, 13, 50}) EXPECT_NEAR(LrOfStep(c, n), ref(n), 1e-15) << n;
  EXPECT_EQ(LrOfStep(c, 12), 0.02);  // warmup over: exactly max
  EXPECT_LT(LrOfStep(c, 11), 0.02);
}

TEST(LrSchedule, WarmupNumStepsBelowTwoCountsAsTwo) {
  Config c = Parse(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1.0,
      "warmup_num_steps": 1, "warmup_type": "linear"}}})");
  // N = 2: steps 1..4 = 0, 0, 0.5, 1.
  EXPECT_EQ(LrOfStep(c, 1), 0.0);
  EXPECT_EQ(LrOfStep(c, 2), 0.0);
  EXPECT_EQ(LrOfStep(c, 3), 0.5);
  EXPECT_EQ(LrOfStep(c, 4), 1.0);
}

TEST(LrSchedule, WarmupDecayLRAgainstTheFormula) {
  Config c = Parse(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 20,
      "warmup_min_lr": 0.001, "warmup_num_steps": 5, "warmup_type": "linear"}}})");
  EXPECT_EQ(c.scheduler.warmup_max_lr, 1e-3);  // WarmupDecayLR's default
  auto ref = [](int n) {
    const double lo = 0.001, hi = 0.001;
    if (n == 1) return lo;
    const int i = n - 2;
    const double gamma = i < 5 ? i / 5.0 : std::max(0.0, (20.0 - i) / 15.0);
    return lo + (hi - lo) * gamma;
  };
  for (int n : {1, 2, 6, 7, 8, 15, 21, 22, 23, 40}) EXPECT_NEAR(LrOfStep(c, n), ref(n), 1e-15);
  // With a range that moves: max 1, min 0.
  Config d = Parse(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 20,
      "warmup_max_lr": 1.0, "warmup_num_steps": 5, "warmup_type": "linear"}}})");
  const double by_hand[][2] = {{1, 0.0},       {2, 0.0},       {3, 0.2},  {6, 0.8}, {7, 1.0},
                               {8, 14.0 / 15}, {17, 5.0 / 15}, {22, 0.0}, {30, 0.0}};
  for (const auto& [n, want] : by_hand)
    EXPECT_NEAR(LrOfStep(d, static_cast<int>(n)), want, 1e-15) << n;
}

TEST(LrSchedule, WarmupCosineLRAgainstTheFormula) {
  Config c = Parse(R"({"optimizer": {"params": {"lr": 0.5}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 30,
      "warmup_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}}})");
  auto ref = [](int n) {
    if (n == 1) return 0.0;  // DeepSpeed's lr before the schedule starts
    const int i = n - 2;
    double ratio;
    if (i < 10) {
      ratio = 0.1 + std::log(i + 1.0) / std::log(10.0) * 0.9;
    } else {
      const double progress = std::min(1.0, (i - 10 + 1) / 20.0);
      ratio = 0.01 + 0.99 * (1 + std::cos(std::numbers::pi * progress)) / 2;
    }
    return 0.5 * ratio;
  };
  for (int n : {1, 2, 3, 11, 12, 13, 20, 31, 32, 33, 100})
    EXPECT_NEAR(LrOfStep(c, n), ref(n), 1e-15) << n;
  EXPECT_NEAR(LrOfStep(c, 32), 0.5 * 0.01, 1e-15);  // the end: cos_min_ratio
  EXPECT_NEAR(LrOfStep(c, 500), 0.5 * 0.01, 1e-15);
  EXPECT_NEAR(LrOfStep(c, 2), 0.05, 1e-15);  // warmup_min_ratio × lr
}

TEST(LrSchedule, OneCycleAgainstTheFormula) {
  Config c = Parse(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1,
      "cycle_max_lr": 1.0, "cycle_first_step_size": 4, "cycle_second_step_size": 6,
      "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.1}}})");
  // Batch b = n - 1 after step n - 1; up over 4, down over 6, then decay.
  auto ref = [](int n, double* mom) {
    const int b = n - 1;
    if (b == 0) {
      *mom = 0.8;  // DeepSpeed's initial betas: cycle_min_mom
      return 0.1;
    }
    if (b - 1 < 10) {
      const double scale = b <= 4 ? b / 4.0 : (10.0 - b) / 6.0;
      *mom = 0.9 - 0.1 * scale;
      return 0.1 + 0.9 * scale;
    }
    const double interval = (b - 10) / 2.0;
    *mom = 0.9 * (1 + 0.1 * interval);
    return 0.1 / (1 + 0.5 * interval);
  };
  for (int n : {1, 2, 3, 5, 6, 8, 10, 11, 12, 13, 20}) {
    double mom = 0;
    const double lr = ref(n, &mom);
    const ScheduledValues v = ScheduleAt(c, n - 1);
    EXPECT_NEAR(v.lr, lr, 1e-14) << n;
    EXPECT_NEAR(v.beta1, mom, 1e-14) << n;
    EXPECT_EQ(v.beta2, 0.99) << n;
  }
  EXPECT_NEAR(LrOfStep(c, 5), 1.0, 1e-15);  // the peak
}

TEST(LrSchedule, OneCycleStairsAndDefaults) {
  Config c = Parse(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.0,
      "cycle_max_lr": 1.0, "cycle_first_step_size": 4, "cycle_first_stair_count": 2}}})");
  EXPECT_EQ(c.scheduler.cycle_second_step_size, 4);    // = first
  EXPECT_EQ(c.scheduler.cycle_second_stair_count, 2);  // = first
  // Batches 1..8: stairs of 2 → 0, .5, .5, 1, .5, .5, 0, 0 (floor(position)/2).
  const double want[] = {0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0};
  for (int b = 1; b <= 8; ++b) EXPECT_NEAR(LrOfStep(c, b + 1), want[b - 1], 1e-15) << b;
  // No decay configured: cycle_min_lr after the cycle.
  EXPECT_EQ(LrOfStep(c, 50), 0.0);
}

TEST(LrSchedule, OneCycleMomentumOffForAdagrad) {
  Config c = Parse(R"({"optimizer": {"type": "Adagrad"}, "scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}})");
  EXPECT_FALSE(c.scheduler.cycle_momentum);
  EXPECT_THAT(c.warnings, Contains(HasSubstr("scheduler.params.cycle_momentum: true ignored")));
}

TEST(LrSchedule, LRRangeTestAgainstTheFormula) {
  Config c = Parse(R"({"scheduler": {"type": "LRRangeTest", "params": {
      "lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2}}})");
  for (int n : {1, 2, 3, 4, 10}) EXPECT_NEAR(LrOfStep(c, n), 0.01 * (1 + 2.0 * (n - 1) / 3), 1e-15);
  Config s = Parse(R"({"scheduler": {"type": "LRRangeTest", "params": {
      "lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3, "lr_range_test_staircase": true}}})");
  const double want[] = {0.01, 0.01, 0.01, 0.02, 0.02, 0.02, 0.03};
  for (int n = 1; n <= 7; ++n) EXPECT_NEAR(LrOfStep(s, n), want[n - 1], 1e-15) << n;
}

TEST(LrSchedule, ReadingErrorsNameTheKey) {
  EXPECT_THAT(
      Error(R"({"scheduler": {"type": "WarmupDecayLR"}})"),
      HasSubstr("scheduler.params.total_num_steps: required by scheduler.type WarmupDecayLR"));
  EXPECT_THAT(Error(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1}}})"),
              HasSubstr("scheduler.params.cycle_min_lr: required"));
  EXPECT_THAT(Error(R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 5}}})"),
              HasSubstr("scheduler.params.total_num_steps: 5 is not a parameter of WarmupLR"));
  EXPECT_THAT(Error(R"({"scheduler": {"type": "StepLR", "params": {}}})"),
              HasSubstr("scheduler.type: \"StepLR\" is not one of WarmupLR"));
  EXPECT_THAT(Error(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})"),
              HasSubstr("scheduler.params.warmup_num_steps: 0 is not allowed; must be > 0"));
  EXPECT_THAT(Error(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}})"),
              HasSubstr("scheduler.params.warmup_type: \"exp\" is not one of log, linear"));
  EXPECT_THAT(Error(R"({"scheduler": {"type": "WarmupCosineLR", "params": {
                  "total_num_steps": "auto"}}})"),
              HasSubstr("\"auto\" needs a value from the frontend"));
  EXPECT_THAT(
      Error(R"({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}})"),
      HasSubstr("scheduler.params.last_batch_iteration: 5 is not supported"));
}

TEST(LrSchedule, NoTypeIsNoScheduleWithAWarning) {
  Config c = Parse(R"({"scheduler": {"params": {"warmup_num_steps": 5}}})");
  EXPECT_EQ(c.scheduler.type, LrScheduleType::kNone);
  EXPECT_THAT(c.warnings, Contains(HasSubstr("scheduler: no type given")));
}

TEST(LrSchedule, AutoTakesTheFrontendsValues) {
  AutoValues a;
  a.lr = 0.004;
  a.warmup_num_steps = 7;
  a.total_num_steps = 70;
  Config c = Parse(R"({"optimizer": {"params": {"lr": "auto"}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto",
      "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}})",
                   a);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 0.004);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 7);
  EXPECT_EQ(c.scheduler.total_num_steps, 70);
  EXPECT_THAT(c.notices, Contains("scheduler.params.total_num_steps: \"auto\" resolved to 70 "
                                  "(given by the frontend)"));
}

TEST(LrSchedule, ConfigToJsonRoundTrips) {
  for (
      const char* text :
      {R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}})",
       R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9}}})",
       R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9}}})",
       R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1}}})",
       R"({"scheduler": {"type": "LRRangeTest"}})"}) {
    SCOPED_TRACE(text);
    Config c = Parse(text);
    EXPECT_NE(c.scheduler.type, LrScheduleType::kNone);
    StatusOr<Config> again = ParseConfig(ConfigToJson(c));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(*again == c);
    EXPECT_TRUE(again->warnings.empty());
  }
}

}  // namespace
}  // namespace strata
