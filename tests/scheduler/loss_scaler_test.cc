#include "src/scheduler/loss_scaler.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

Fp16Config Dynamic(int power, int64_t window, int hysteresis, double min_scale) {
  Fp16Config c;
  c.enabled = true;
  c.loss_scale = 0;
  c.initial_scale_power = power;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.min_loss_scale = min_scale;
  return c;
}

TEST(LossScalerTest, DisabledIsOneAndNeverChanges) {
  LossScaler s = LossScaler::FromConfig(Fp16Config{});  // fp16.enabled = false (bf16/fp32)
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_FALSE(s.Update(false));
  EXPECT_TRUE(s.Update(true));  // an overflow is still reported so the step is skipped
  EXPECT_EQ(s.scale(), 1.0);
}

TEST(LossScalerTest, StaticScaleSkipsButKeepsScale) {
  Fp16Config c;
  c.enabled = true;
  c.loss_scale = 128;
  LossScaler s = LossScaler::FromConfig(c);
  EXPECT_FALSE(s.dynamic());
  EXPECT_EQ(s.scale(), 128);
  EXPECT_TRUE(s.Update(true));
  EXPECT_EQ(s.scale(), 128);
  for (int i = 0; i < 5000; ++i) s.Update(false);
  EXPECT_EQ(s.scale(), 128);
}

TEST(LossScalerTest, StartsAtTwoToInitialPower) {
  EXPECT_EQ(LossScaler::FromConfig(Dynamic(16, 1000, 2, 1)).scale(), 65536.0);
  EXPECT_EQ(LossScaler::FromConfig(Dynamic(3, 1000, 2, 1)).scale(), 8.0);
}

TEST(LossScalerTest, HysteresisAbsorbsOverflowsBeforeHalving) {
  LossScaler s = LossScaler::FromConfig(Dynamic(10, 1000, 3, 1));
  EXPECT_TRUE(s.Update(true));  // hysteresis 3 → 2, scale kept
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_TRUE(s.Update(true));  // 2 → 1
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_TRUE(s.Update(true));  // spent: halve
  EXPECT_EQ(s.scale(), 512);
  EXPECT_TRUE(s.Update(true));  // stays spent until a full clean window: halve again
  EXPECT_EQ(s.scale(), 256);
}

TEST(LossScalerTest, RaisesAfterWindowOfCleanStepsAndRestoresHysteresis) {
  LossScaler s = LossScaler::FromConfig(Dynamic(4, 3, 2, 1));  // scale 16, window 3
  EXPECT_FALSE(s.Update(false));
  EXPECT_FALSE(s.Update(false));
  EXPECT_EQ(s.scale(), 16);
  EXPECT_FALSE(s.Update(false));  // third clean step since start
  EXPECT_EQ(s.scale(), 32);
  s.Update(true);  // absorbed by hysteresis (2 → 1)
  EXPECT_EQ(s.scale(), 32);
  EXPECT_EQ(s.hysteresis_left(), 1);
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 32);
  s.Update(false);  // three clean steps since the overflow: raise, restore
  EXPECT_EQ(s.scale(), 64);
  EXPECT_EQ(s.hysteresis_left(), 2);
}

TEST(LossScalerTest, NeverBelowMinimum) {
  LossScaler s = LossScaler::FromConfig(Dynamic(2, 1000, 1, 1));  // scale 4, min 1
  s.Update(true);
  EXPECT_EQ(s.scale(), 2);
  s.Update(true);
  EXPECT_EQ(s.scale(), 1);
  s.Update(true);
  EXPECT_EQ(s.scale(), 1);
}

TEST(LossScalerTest, RestoredStateBehavesIdentically) {
  // A scaler part-way through hysteresis and a window, restored into a fresh
  // one from the same config: every later decision and scale is the same.
  const Fp16Config c = Dynamic(6, 3, 2, 1);
  LossScaler a = LossScaler::FromConfig(c);
  const bool pattern[] = {false, true, false, false, true, true, false, false, false, false};
  for (bool o : pattern) a.Update(o);
  LossScaler b = LossScaler::FromConfig(c);
  EXPECT_NE(b.state(), a.state());
  b.Restore(a.state());
  EXPECT_EQ(b.state(), a.state());
  for (int i = 0; i < 40; ++i) {
    const bool o = i % 7 == 3 || i % 11 == 0;
    EXPECT_EQ(a.Update(o), b.Update(o));
    EXPECT_EQ(a.scale(), b.scale()) << i;
    EXPECT_EQ(a.state(), b.state()) << i;
  }
}

}  // namespace
}  // namespace strata
