#include "src/scheduler/fetch_trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace strata {
namespace {

using ::testing::ElementsAre;

// Five modules of 10, 20, 30, 40, 50 elements. Forward 0..4 then backward 4..0.
std::vector<int> FwdBwd() { return {0, 1, 2, 3, 4, 4, 3, 2, 1, 0}; }

void RunStep(FetchTrace& t, const std::vector<int>& order) {
  t.BeginStep();
  for (int m : order) t.Observe(m);
  t.EndStep();
}

TEST(FetchTraceTest, FirstStepRecordsThenFollows) {
  FetchTrace t({10, 20, 30, 40, 50});
  t.BeginStep();
  EXPECT_FALSE(t.following());
  EXPECT_FALSE(t.Observe(0));
  EXPECT_TRUE(t.Lookahead(1000).empty());  // nothing to prefetch while recording
  for (int m : {1, 2, 3, 4, 4, 3, 2, 1, 0}) t.Observe(m);
  t.EndStep();
  EXPECT_EQ(t.trace(), FwdBwd());

  t.BeginStep();
  EXPECT_TRUE(t.following());
  EXPECT_TRUE(t.Observe(0));
  EXPECT_THAT(t.Lookahead(1000), ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(t.Lookahead(60), ElementsAre(1, 2));  // 20 + 30 fit, +40 does not
  EXPECT_TRUE(t.Lookahead(15).empty());             // even the next one is too big
}

TEST(FetchTraceTest, LookaheadSkipsDuplicatesAndReuseDistanceCountsElements) {
  FetchTrace t({10, 20, 30, 40, 50});
  RunStep(t, FwdBwd());
  t.BeginStep();
  for (int m : {0, 1, 2, 3, 4}) ASSERT_TRUE(t.Observe(m));
  // After forward of 4, the trace continues 4 (again), 3, 2, 1, 0.
  EXPECT_THAT(t.Lookahead(1000), ElementsAre(3, 2, 1, 0));  // 4 is in use now
  EXPECT_EQ(t.ReuseDistance(), 0);                          // module 4 is used again right away
  t.Observe(4);
  EXPECT_EQ(t.ReuseDistance(), FetchTrace::kNever);
  t.Observe(3);
  EXPECT_EQ(t.ReuseDistance(), FetchTrace::kNever);
}

TEST(FetchTraceTest, ReuseDistanceOfEarlyModule) {
  FetchTrace t({10, 20, 30, 40, 50});
  RunStep(t, FwdBwd());
  t.BeginStep();
  t.Observe(1 - 1);  // module 0 used again at the very end: 20+30+40+50+50+40+30+20 between
  EXPECT_EQ(t.ReuseDistance(), 20 + 30 + 40 + 50 + 50 + 40 + 30 + 20);
}

TEST(FetchTraceTest, DivergenceStopsPrefetchAndRerecords) {
  FetchTrace t({10, 20, 30, 40, 50});
  RunStep(t, FwdBwd());
  t.BeginStep();
  EXPECT_TRUE(t.Observe(0));
  EXPECT_FALSE(t.Observe(2));  // skipped module 1: a different path
  EXPECT_FALSE(t.following());
  EXPECT_TRUE(t.Lookahead(1000).empty());
  for (int m : {4, 4, 2, 0}) t.Observe(m);
  t.EndStep();
  EXPECT_EQ(t.rerecords(), 1);
  EXPECT_THAT(t.trace(), ElementsAre(0, 2, 4, 4, 2, 0));
  t.BeginStep();
  EXPECT_TRUE(t.Observe(0));
  EXPECT_THAT(t.Lookahead(1000), ElementsAre(2, 4));
}

TEST(FetchTraceTest, ShorterOrLongerStepRerecords) {
  FetchTrace t({10, 20, 30});
  RunStep(t, {0, 1, 2});
  RunStep(t, {0, 1});  // prefix matches, but ends early
  EXPECT_EQ(t.rerecords(), 1);
  EXPECT_THAT(t.trace(), ElementsAre(0, 1));
  RunStep(t, {0, 1, 2});  // runs past the trace: diverges at position 2
  EXPECT_EQ(t.rerecords(), 2);
  EXPECT_THAT(t.trace(), ElementsAre(0, 1, 2));
  RunStep(t, {0, 1, 2});
  EXPECT_EQ(t.rerecords(), 2);
}

}  // namespace
}  // namespace strata
