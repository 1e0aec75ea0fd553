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

TEST(ConfigSchema, UndeclaredKeysAreUnknown) {
  StatusOr<Config> c = ParseConfig(R"({"zero_optimization": {"stage3_prefetch": 1}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(FindKey("zero_optimization.stage3_prefetch"), nullptr);
  EXPECT_THAT(c->warnings, Contains("unknown key zero_optimization.stage3_prefetch (ignored)"));
}

}  // namespace
}  // namespace strata
