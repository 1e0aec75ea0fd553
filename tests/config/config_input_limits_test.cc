// Tests for src/config/config.cc on hostile input:
// values nested 100,000 levels deep (they used to overflow the stack in the
// error message's serialization), nesting just inside and outside the limit,
// text over kMaxConfigBytes, and large but legal inputs. Every input gives a
// Config or a one-line error; none crashes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "strata/config.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

std::string Nested(int levels, char open, char close, const std::string& inner = "1") {
  return std::string(levels, open) + inner + std::string(levels, close);
}

// {"a": {"a": ... value ... }} with `levels` objects.
std::string NestedObjects(int levels, const std::string& inner = "1") {
  std::string s;
  for (int i = 0; i < levels; ++i) s += "{\"a\":";
  s += inner;
  s += std::string(levels, '}');
  return s;
}

std::string ErrorOf(const std::string& text) {
  StatusOr<Config> c = ParseConfig(text);
  EXPECT_FALSE(c.ok()) << "parsed but should not have (" << text.size() << " bytes)";
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status();
  return std::string(c.status().message());
}

TEST(ConfigInputLimits, DeepNestingUnderKeysWhoseErrorsPrintTheValue) {
  const std::string deep_array = Nested(100'000, '[', ']');
  const std::string deep_object = NestedObjects(100'000);
  for (const std::string& deep : {deep_array, deep_object}) {
    for (const char* prefix :
         {R"({"aio": )", R"({"zero_optimization": {"stage": )",
          R"({"optimizer": {"params": {"lr": )", R"({"strata": {"device": )", R"({"unknown": )"}) {
      SCOPED_TRACE(prefix);
      std::string text =
          prefix + deep + (std::string(prefix).find("{\"", 2) != std::string::npos ? "}}" : "}");
      if (std::string(prefix).find("\"params\"") != std::string::npos) text += "}";
      const std::string msg = ErrorOf(text);
      EXPECT_THAT(msg, AllOf(HasSubstr("nested deeper than 64 levels"),
                             HasSubstr("DeepSpeed config needs")));
      EXPECT_LT(msg.size(), 400u) << msg;
    }
  }
  // At the top level, and unterminated.
  EXPECT_THAT(ErrorOf(deep_array),
              AllOf(HasSubstr("[0][0][0]"), HasSubstr("...: nested deeper than 64 levels")));
  EXPECT_THAT(ErrorOf(std::string(100'000, '[')), HasSubstr("nested deeper than 64 levels"));
  EXPECT_THAT(ErrorOf(std::string(100'000, '{')), HasSubstr("malformed JSON"));
}

TEST(ConfigInputLimits, TheErrorNamesWhereTheNestingStarts) {
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage": )" + Nested(200, '[', ']') + "}}"),
              HasSubstr("zero_optimization.stage[0][0]"));
}

TEST(ConfigInputLimits, DepthUpToTheLimitIsAccepted) {
  // The top-level object is level 1: a value at level 64 is fine, 65 is not.
  StatusOr<Config> ok =
      ParseConfig(R"({"unknown": )" + Nested(kMaxConfigDepth - 1, '[', ']') + "}");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_THAT(ok->warnings, Contains("unknown key unknown (ignored)"));
  EXPECT_THAT(ErrorOf(R"({"unknown": )" + Nested(kMaxConfigDepth, '[', ']') + "}"),
              HasSubstr("nested deeper than 64"));
  // A value error on a moderately deep value prints a bounded excerpt.
  const std::string msg = ErrorOf(R"({"aio": {"queue_depth": )" + Nested(60, '[', ']') + "}}");
  EXPECT_THAT(
      msg, AllOf(HasSubstr("aio.queue_depth: [[[[[[[[[...]]]]]]]]"), HasSubstr("not an integer")));
}

TEST(ConfigInputLimits, TextOverTheLimitIsRefused) {
  std::string big = R"({"x": ")" + std::string(kMaxConfigBytes, 'a') + "\"}";
  EXPECT_THAT(ErrorOf(big),
              AllOf(HasSubstr("the config is " + std::to_string(big.size()) + " bytes"),
                    HasSubstr("at most 4194304 (4 MiB)")));
  testing::ScratchDir dir;
  const std::string path = dir.str() + "/huge.json";
  std::ofstream(path) << big;
  StatusOr<Config> c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()),
              AllOf(HasSubstr(path), HasSubstr("at most 4194304")));
}

// A regular file is refused with its own size (not the bytes read up to the
// limit); a device has no size, and the error claims none.
TEST(ConfigInputLimits, FileOverTheLimitIsRefusedWithItsSize) {
  testing::ScratchDir dir;
  const std::string path = dir.str() + "/100mb.json";
  std::ofstream(path).close();
  std::filesystem::resize_file(path, 100'000'000);  // sparse: no 100 MB written
  StatusOr<Config> c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()),
              AllOf(HasSubstr(path + ": the config is 100000000 bytes"),
                    HasSubstr("at most 4194304 (4 MiB)")));
  // A device is not read at all: only regular files are configs.
  c = LoadConfigFile("/dev/zero");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kIOError);
  const std::string m(c.status().message());
  EXPECT_THAT(m, HasSubstr("/dev/zero: not a regular file (a device)"));
  EXPECT_THAT(m, Not(HasSubstr("the config is")));
}

// A FIFO (here without a writer, which would block open() for ever) is
// refused at once, naming it.
TEST(ConfigInputLimits, FifoIsRefusedWithoutBlocking) {
  testing::ScratchDir dir;
  const std::string path = dir.str() + "/fifo.json";
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0);
  StatusOr<Config> c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kIOError);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(path + ": not a regular file (a FIFO)"));
}

TEST(ConfigInputLimits, NulByteIsNamedWithItsOffset) {
  const std::string text("{\"a\":\n \0 1}", 10);
  EXPECT_THAT(ErrorOf(text), HasSubstr("<string>:2:2: a NUL byte (0x00) at byte offset 7"));
}

TEST(ConfigInputLimits, NullDocumentIsNamedOnce) {
  EXPECT_EQ(ErrorOf("null"), "the top level is null, expected a JSON object { ... }");
  EXPECT_THAT(ErrorOf("[1]"), HasSubstr("the top level is array [1], expected a JSON object"));
}

TEST(ConfigInputLimits, LargeLegalInputsParse) {
  // A 3 MiB string where an enum is expected: a short error.
  const std::string msg =
      ErrorOf(R"({"strata": {"device": ")" + std::string(3 << 20, 'x') + "\"}}");
  EXPECT_THAT(msg, AllOf(HasSubstr("strata.device: \"xxx"), HasSubstr("..."),
                         HasSubstr("auto, cuda, host")));
  EXPECT_LT(msg.size(), 300u);
  // Half a million numbers and a hundred thousand keys under unknown keys.
  std::string numbers = R"({"big": [)";
  for (int i = 0; i < 500'000; ++i) numbers += i ? ",7" : "7";
  numbers += "]}";
  StatusOr<Config> a = ParseConfig(numbers);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(a->warnings, Contains("unknown key big (ignored)"));
  std::string keys = R"({"zero_optimization": {"stage": 3}, "many": {)";
  for (int i = 0; i < 100'000; ++i)
    keys += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":" + std::to_string(i);
  keys += "}}";
  StatusOr<Config> b = ParseConfig(keys);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->zero_optimization.stage, 3);
  // ...and a duplicate among them is still found.
  EXPECT_THAT(ErrorOf(keys.substr(0, keys.size() - 2) + ",\"k77\":1}}"),
              HasSubstr("many.k77: duplicate key"));
}

TEST(ConfigInputLimits, HostileKeysAreShownSafely) {
  // A long key with control characters: the warning is one bounded line.
  const std::string key = std::string(1000, 'k') + "\\n\\u0001";
  StatusOr<Config> c = ParseConfig("{\"" + key + "\": 1}");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->warnings.size(), 1u);
  EXPECT_EQ(c->warnings[0].find('\n'), std::string::npos);
  EXPECT_LT(c->warnings[0].size(), 120u);
}

}  // namespace
}  // namespace strata
