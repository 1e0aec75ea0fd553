#include "src/scheduler/timeline.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace strata {
namespace {

TEST(TimelineTest, DisabledRecordsNothing) {
  Timeline t(false);
  t.Add("h2d", "copy", "pcie", 100, 50);
  EXPECT_EQ(t.size(), 0u);
}

TEST(TimelineTest, WritesChromeTraceWithTracks) {
  testing::ScratchDir dir;
  Timeline t(true);
  t.Add("h2d", "fetch layer0", "pcie", 2'000, 1'000, 4096);
  t.Add("adam", "subgroup 0", "optimizer", 1'000, 5'000);
  t.Add("h2d", "fetch layer1", "pcie", 4'000, 1'000, 8192);
  const std::string path = dir.str() + "/trace.json";
  ASSERT_TRUE(t.WriteJson(path).ok());
  std::ifstream f(path);
  nlohmann::json j = nlohmann::json::parse(f);
  const auto& ev = j["traceEvents"];
  int meta = 0, complete = 0;
  for (const auto& e : ev) {
    if (e["ph"] == "M") ++meta;
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_GE(e["ts"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(meta, 2);  // two tracks
  EXPECT_EQ(complete, 3);
  // Times are relative to the earliest event, in microseconds.
  bool saw_first = false;
  for (const auto& e : ev)
    if (e["ph"] == "X" && e["name"] == "subgroup 0") {
      EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 0.0);
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 5.0);
      saw_first = true;
    }
  EXPECT_TRUE(saw_first);
}

TEST(TimelineTest, UnwritablePathIsError) {
  Timeline t(true);
  t.Add("x", "y", "z", 0, 1);
  Status s = t.WriteJson("/nonexistent-dir/trace.json");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent-dir/trace.json"), std::string_view::npos);
}

}  // namespace
}  // namespace strata
