// The schema table (src/config/schema.cc) against the loader: it declares
// every key ConfigToJson writes, with the default ParseConfig("{}") fills
// in, and its verdicts on keys nobody reads are the warnings and errors the
// parser gives.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "src/config/config_internal.h"
#include "strata/config.h"

namespace strata {
namespace {

using config_internal::EditDistance;
using config_internal::FindKey;
using config_internal::KeySpec;
using config_internal::KeyType;
using config_internal::KeyUse;
using config_internal::Schema;
using json = nlohmann::json;
using ::testing::Contains;
using ::testing::HasSubstr;

// Every path in `j` (objects only; arrays are values), with its value.
void Walk(const json& j, const std::string& prefix,
          std::vector<std::pair<std::string, json>>* out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string path = prefix.empty() ? it.key() : prefix + "." + it.key();
    out->emplace_back(path, *it);
    if (it->is_object()) Walk(*it, path, out);
  }
}

// A JSON document with `value` at dotted `path`.
json Nest(const std::string& path, const json& value) {
  json root = json::object();
  json* at = &root;
  size_t start = 0;
  for (size_t dot; (dot = path.find('.', start)) != std::string::npos; start = dot + 1)
    at = &(*at)[path.substr(start, dot - start)];
  (*at)[path.substr(start)] = value;
  return root;
}

TEST(ConfigSchema, PathsAreUnique) {
  std::set<std::string_view> seen;
  for (const KeySpec& k : Schema()) EXPECT_TRUE(seen.insert(k.path).second) << k.path;
}

TEST(ConfigSchema, DeclaresEveryKeyConfigToJsonWritesWithItsDefault) {
  StatusOr<Config> c = ParseConfig("{}");
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<std::pair<std::string, json>> written;
  Walk(json::parse(ConfigToJson(*c)), "", &written);
  std::set<std::string> paths;
  for (const auto& [path, value] : written) {
    SCOPED_TRACE(path);
    paths.insert(path);
    const KeySpec* k = FindKey(path);
    ASSERT_NE(k, nullptr) << "written by ConfigToJson but not declared in the schema";
    EXPECT_EQ(k->use, KeyUse::kRead);
    if (value.is_object()) {
      EXPECT_EQ(k->type, KeyType::kObject);
      continue;
    }
    ASSERT_FALSE(k->default_json.empty()) << "a written key needs its default in the schema";
    EXPECT_EQ(json::parse(k->default_json), value);
  }
  // And every default the schema states is one ConfigToJson writes.
  for (const KeySpec& k : Schema()) {
    if (!k.default_json.empty()) {
      EXPECT_TRUE(paths.count(std::string(k.path))) << k.path;
    }
  }
}

TEST(ConfigSchema, UnusedAndNeutralUnsupportedKeysWarnAsDeepSpeedKeys) {
  for (const KeySpec& k : Schema()) {
    if (k.use != KeyUse::kUnused && k.use != KeyUse::kUnsupported) continue;
    SCOPED_TRACE(k.path);
    // The value: DeepSpeed's neutral one for unsupported settings; any value
    // otherwise (allgather_size is read only in the legacy form).
    json value = k.use == KeyUse::kUnsupported ? json::parse(k.neutral_text) : json(1);
    StatusOr<Config> c = ParseConfig(Nest(std::string(k.path), value).dump());
    ASSERT_TRUE(c.ok()) << c.status();
    const std::string want =
        k.use == KeyUse::kUnused && !k.note.empty()
            ? "DeepSpeed key " + std::string(k.path) + " is not used by Strata (ignored; " +
                  std::string(k.note) + ")"
            : "DeepSpeed key " + std::string(k.path) + " is not used by Strata (ignored)";
    EXPECT_THAT(c->warnings, Contains(want));
  }
}

TEST(ConfigSchema, UnsupportedSettingsAreErrorsAwayFromTheirNeutralValue) {
  for (const KeySpec& k : Schema()) {
    if (k.use != KeyUse::kUnsupported) continue;
    SCOPED_TRACE(k.path);
    const json value = k.type == KeyType::kBool ? json(true) : json(0.5);
    StatusOr<Config> c = ParseConfig(Nest(std::string(k.path), value).dump());
    ASSERT_FALSE(c.ok());
    EXPECT_THAT(c.status().message(), HasSubstr(std::string(k.path) + ": " + value.dump() +
                                                " is not supported: " + std::string(k.note)));
  }
}

TEST(ConfigSchema, UndeclaredKeysInASectionAreErrors) {
  EXPECT_EQ(FindKey("zero_optimization.stage3_prefetch"), nullptr);
  StatusOr<Config> c = ParseConfig(R"({"zero_optimization": {"stage3_prefetch": 1}})");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(),
            "zero_optimization.stage3_prefetch: unknown key (no such key in "
            "zero_optimization)");
}

// Each key of the schema with its first letter doubled (one edit away) is
// refused, naming the key; at the top level only the names Strata reads are
// suggested.
TEST(ConfigSchema, EveryMisspeltKeyIsRefusedWithItsName) {
  for (const KeySpec& k : Schema()) {
    const std::string path(k.path);
    const size_t dot = path.rfind('.');
    const std::string section = dot == std::string::npos ? "" : path.substr(0, dot);
    const std::string name = path.substr(dot == std::string::npos ? 0 : dot + 1);
    if (section.empty() && k.use != KeyUse::kRead) continue;
    // A key of an application's section: the application reads and checks it.
    if (k.use == KeyUse::kApplication && section != "strata") continue;
    SCOPED_TRACE(path);
    const std::string typo = name.substr(0, 1) + name;
    const std::string typo_path = (section.empty() ? "" : section + ".") + typo;
    StatusOr<Config> c = ParseConfig(Nest(typo_path, json::object()).dump());
    ASSERT_FALSE(c.ok());
    EXPECT_THAT(c.status().message(),
                HasSubstr(typo_path + ": unknown key; did you mean " + name + "?"));
  }
}

// The resume column: a free key is one the config has (ConfigToJson writes
// it, or it lies in an application's section) and says why it may differ.
TEST(ConfigSchema, KeysFreeOnResumeAreConfigKeysWithAReason) {
  StatusOr<Config> c = ParseConfig("{}");
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<std::pair<std::string, json>> written;
  Walk(json::parse(ConfigToJson(*c)), "", &written);
  std::set<std::string> paths;
  for (const auto& [path, value] : written) paths.insert(path);
  int free = 0;
  for (const KeySpec& k : Schema()) {
    if (k.free_on_resume.empty()) continue;
    SCOPED_TRACE(k.path);
    ++free;
    EXPECT_TRUE(paths.count(std::string(k.path)) || k.use == KeyUse::kApplication);
    EXPECT_GT(k.free_on_resume.size(), 10u);
  }
  EXPECT_GT(free, 0);
  EXPECT_THAT(config_internal::ApplicationSections(), ::testing::ElementsAre("model"));
}

TEST(ConfigSchema, EditDistanceCountsSwapsAsOneEdit) {
  EXPECT_EQ(EditDistance("devcie", "device", 2), 1u);
  EXPECT_EQ(EditDistance("zero_optimisation", "zero_optimization", 2), 1u);
  EXPECT_EQ(EditDistance("dev", "device", 2), 3u);  // above the limit: limit + 1
  EXPECT_EQ(EditDistance("abcd", "bacd", 0), 1u);
  EXPECT_EQ(EditDistance("", "ab", 2), 2u);
  EXPECT_EQ(EditDistance("same", "same", 2), 0u);
}

}  // namespace
}  // namespace strata
