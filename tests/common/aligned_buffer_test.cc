#include "src/common/aligned_buffer.h"

#include <gtest/gtest.h>

#include <cstring>

#include "src/common/env_param.h"
#include "src/common/timer.h"

namespace strata {
namespace {

TEST(AlignedBufferTest, AlignmentAndSize) {
  for (size_t align : {64u, 512u, 4096u}) {
    auto b = AlignedBuffer::Allocate(1000, align);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(IsAligned(b->data(), align));
    EXPECT_EQ(b->size(), 1000u);
    std::memset(b->data(), 0xab, b->size());
  }
}

TEST(AlignedBufferTest, RejectsBadAlignment) {
  auto b = AlignedBuffer::Allocate(10, 48);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("48"), std::string_view::npos);
}

TEST(AlignedBufferTest, MoveTransfersOwnership) {
  auto b = AlignedBuffer::Allocate(128);
  ASSERT_TRUE(b.ok());
  void* p = b->data();
  AlignedBuffer c = std::move(*b);
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(b->data(), nullptr);
}

TEST(AlignHelpersTest, UpAndDown) {
  EXPECT_EQ(AlignUp(0, 512), 0u);
  EXPECT_EQ(AlignUp(1, 512), 512u);
  EXPECT_EQ(AlignUp(512, 512), 512u);
  EXPECT_EQ(AlignDown(1023, 512), 512u);
}

TEST(EnvParamTest, ReadsAndFallsBack) {
  setenv("STRATA_TEST_KNOB", "12", 1);
  EXPECT_EQ(EnvInt("STRATA_TEST_KNOB", 3), 12);
  setenv("STRATA_TEST_KNOB", "junk", 1);
  EXPECT_EQ(EnvInt("STRATA_TEST_KNOB", 3), 3);
  setenv("STRATA_TEST_KNOB", "on", 1);
  EXPECT_TRUE(EnvBool("STRATA_TEST_KNOB", false));
  unsetenv("STRATA_TEST_KNOB");
  EXPECT_EQ(EnvString("STRATA_TEST_KNOB", "d"), "d");
}

TEST(StopwatchTest, Monotonic) {
  Stopwatch w;
  int64_t a = w.Nanos();
  int64_t b = w.Nanos();
  EXPECT_LE(a, b);
  EXPECT_GE(w.Seconds(), 0.0);
}

}  // namespace
}  // namespace strata
