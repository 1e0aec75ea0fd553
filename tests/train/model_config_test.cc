// strata.model, the example model's section of the config
// (examples/train/model_config.cc): defaults, every key, errors naming the
// key, unknown keys, and the round trip through the library's Config.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "examples/train/model.h"
#include "strata/config.h"

namespace strata::example {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

Config Parse(const std::string& text) {
  StatusOr<Config> c = ParseConfig(text);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : Config{};
}

TEST(ModelConfig, Defaults) {
  StatusOr<ModelConfig> m = ModelConfigFromConfig(Parse("{}"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->layers, 4);
  EXPECT_EQ(m->hidden, 256);
  EXPECT_EQ(m->seq_len, 64);
  EXPECT_EQ(m->vocab, 256);
  EXPECT_EQ(m->seed, 1234);
  EXPECT_EQ(m->steps, 0);
  StatusOr<ModelConfig> empty = ModelConfigFromConfig(Parse(R"({"strata": {"model": {}}})"));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(*empty == ModelConfig{});
}

// The parameter count comes from the sizes (a huge model builds no list),
// and it is what ParameterList's tensors add up to.
TEST(ModelShape, NumParametersIsTheSumOfTheParameterList) {
  for (const auto& [layers, hidden] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {2, 32}, {4, 384}, {7, 100}}) {
    ModelShape s;
    s.layers = layers;
    s.hidden = hidden;
    int64_t sum = 0;
    for (const ParamInfo& p : ParameterList(s)) sum += p.numel;
    EXPECT_EQ(s.num_parameters(), sum) << layers << " x " << hidden;
  }
  ModelShape demo;
  demo.layers = 4;
  demo.hidden = 384;
  EXPECT_EQ(demo.num_parameters(), 5119744);  // docs/cli.md: configs/demo.json
  ModelShape huge;
  huge.layers = kMaxModelLayers;
  huge.hidden = int64_t{1} << 20;
  EXPECT_GT(huge.num_parameters(), int64_t{1} << 59);  // no list of 400000 tensors was built
}

TEST(ModelConfig, EveryKeyIsRead) {
  std::vector<std::string> warnings;
  StatusOr<ModelConfig> m = ModelConfigFromConfig(
      Parse(R"({"strata": {"model": {"layers": 12, "hidden": 1e3, "seq_len": 128, "vocab": 256,
                                     "seed": 7, "steps": 40}}})"),
      &warnings);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(*m ==
              (ModelConfig{.layers = 12, .hidden = 1000, .seq_len = 128, .seed = 7, .steps = 40}));
  EXPECT_TRUE(warnings.empty());
}

TEST(ModelConfig, BadValuesNameTheKey) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"layers": 0})", "strata.model.layers: 0 is not allowed; must be > 0"},
      {R"({"hidden": 4})", "strata.model.hidden: 4 is not allowed; must be >= 8"},
      {R"({"seq_len": 1})", "strata.model.seq_len: 1 is not allowed; must be >= 2"},
      {R"({"vocab": 50257})", "strata.model.vocab: 50257 is not allowed; must be 256"},
      {R"({"seed": -1})", "strata.model.seed: -1 is not allowed; must be >= 0"},
      {R"({"steps": -3})", "strata.model.steps: -3 is not allowed; must be >= 0"},
      {R"({"layers": "many"})", "strata.model.layers: \"many\" is not an integer"},
      {R"({"hidden": 2.5})", "strata.model.hidden: 2.5 is not an integer"},
      {R"({"layers": "auto"})",
       "strata.model.layers: \"auto\" is not an integer (\"auto\" is "
       "not accepted for this key)"},
      {R"({"seed": null})", "strata.model.seed: null is not an integer"},
  };
  for (auto [model, want] : cases) {
    SCOPED_TRACE(model);
    StatusOr<ModelConfig> m =
        ModelConfigFromConfig(Parse(std::string(R"({"strata": {"model": )") + model + "}}"));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(m.status().message(), HasSubstr(want));
  }
}

TEST(ModelConfig, UnknownKeyWarns) {
  std::vector<std::string> warnings;
  StatusOr<ModelConfig> m =
      ModelConfigFromConfig(Parse(R"({"strata": {"model": {"heads": 8}}})"), &warnings);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_THAT(warnings, Contains("unknown key strata.model.heads (ignored)"));
}

TEST(ModelConfig, ShapeFromConfigChecksTheSection) {
  StatusOr<ModelShape> s = ShapeFromConfig(Parse(R"({"strata": {"model": {"hidden": 4}}})"));
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("strata.model.hidden: 4 is not allowed"));
}

TEST(ModelConfig, RoundTripThroughTheLibrary) {
  const ModelConfig want{
      .layers = 3, .hidden = 96, .seq_len = 33, .vocab = 256, .seed = 99, .steps = 17};
  Config c;
  SetModelConfig(want, &c);
  ASSERT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  StatusOr<Config> back = ParseConfig(ConfigToJson(c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == c);
  StatusOr<ModelConfig> m = ModelConfigFromConfig(*back);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(*m == want);
}

}  // namespace
}  // namespace strata::example
