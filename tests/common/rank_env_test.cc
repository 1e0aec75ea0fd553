// ReadRankEnv / RankEnvInteger: the launcher's rank variables, read in one
// place; every value that is not a usable rank description is refused with
// the variable and the value named.
#include "src/common/rank_env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

namespace strata {
namespace {

using Vars = std::map<std::string, std::string>;

constexpr const char* kNames[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};

// Sets the four variables as given (absent: unset) for one test and puts
// back what was there.
class ScopedRankEnv {
 public:
  explicit ScopedRankEnv(const std::map<std::string, std::string>& values) {
    for (const char* n : kNames) {
      if (const char* v = std::getenv(n); v != nullptr) saved_[n] = v;
      unsetenv(n);
    }
    for (const auto& [k, v] : values) setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedRankEnv() {
    for (const char* n : kNames) unsetenv(n);
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }

 private:
  std::map<std::string, std::string> saved_;
};

TEST(RankEnvTest, NothingSetIsOneRank) {
  ScopedRankEnv env(Vars{});
  StatusOr<RankEnv> e = ReadRankEnv();
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->rank, 0);
  EXPECT_EQ(e->world_size, 1);
  EXPECT_EQ(e->local_rank, 0);
  EXPECT_EQ(e->local_world_size, 1);
}

TEST(RankEnvTest, TorchrunsFourVariables) {
  ScopedRankEnv env(
      Vars{{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}});
  StatusOr<RankEnv> e = ReadRankEnv();
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->rank, 5);
  EXPECT_EQ(e->world_size, 8);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->local_world_size, 4);
}

TEST(RankEnvTest, LocalValuesDefaultToTheGlobalOnes) {
  ScopedRankEnv env(Vars{{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  StatusOr<RankEnv> e = ReadRankEnv();
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->local_rank, 2);
  EXPECT_EQ(e->local_world_size, 3);
}

TEST(RankEnvTest, ValuesThatAreNotRanksAreRefusedByName) {
  const std::map<std::string, std::string> cases[] = {
      {{"WORLD_SIZE", "two"}},
      {{"WORLD_SIZE", "-2"}},
      {{"WORLD_SIZE", "2x"}},
      {{"WORLD_SIZE", "99999999999999999999"}},
      {{"RANK", "1.5"}, {"WORLD_SIZE", "2"}},
      {{"LOCAL_RANK", "1,2"}, {"WORLD_SIZE", "2"}},
      {{"LOCAL_WORLD_SIZE", "16777217"}, {"WORLD_SIZE", "2"}},
  };
  for (const auto& values : cases) {
    ScopedRankEnv env(values);
    StatusOr<RankEnv> e = ReadRankEnv();
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
    // The variable whose value is wrong, with the value.
    for (const auto& [k, v] : values) {
      if (k == "WORLD_SIZE" && values.size() > 1) continue;
      EXPECT_NE(e.status().message().find(k + "=\"" + v + "\""), std::string::npos)
          << e.status().ToString();
    }
  }
}

TEST(RankEnvTest, RanksThatDoNotFitTheWorldAreRefused) {
  {
    ScopedRankEnv env(Vars{{"WORLD_SIZE", "0"}});
    StatusOr<RankEnv> e = ReadRankEnv();
    ASSERT_FALSE(e.ok());
    EXPECT_NE(e.status().message().find("WORLD_SIZE=0"), std::string::npos);
  }
  {
    ScopedRankEnv env(
        Vars{{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}});
    StatusOr<RankEnv> e = ReadRankEnv();
    ASSERT_FALSE(e.ok());
    EXPECT_NE(e.status().message().find("RANK=2 is not below WORLD_SIZE=2"), std::string::npos)
        << e.status().ToString();
  }
  {
    ScopedRankEnv env(
        Vars{{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}});
    StatusOr<RankEnv> e = ReadRankEnv();
    ASSERT_FALSE(e.ok());
    EXPECT_NE(e.status().message().find("LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2"),
              std::string::npos)
        << e.status().ToString();
  }
}

TEST(RankEnvTest, OneVariableUnsetOrEmptyIsNoValue) {
  {
    ScopedRankEnv env(Vars{});
    StatusOr<std::optional<int>> v = RankEnvInteger("WORLD_SIZE");
    ASSERT_TRUE(v.ok());
    EXPECT_FALSE(v->has_value());
  }
  {
    ScopedRankEnv env(Vars{{"WORLD_SIZE", ""}});
    StatusOr<std::optional<int>> v = RankEnvInteger("WORLD_SIZE");
    ASSERT_TRUE(v.ok());
    EXPECT_FALSE(v->has_value());
  }
  {
    ScopedRankEnv env(Vars{{"WORLD_SIZE", "16777216"}});
    StatusOr<std::optional<int>> v = RankEnvInteger("WORLD_SIZE");
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(**v, 1 << 24);
  }
}

}  // namespace
}  // namespace strata
