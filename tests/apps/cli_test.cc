// Smoke tests of the `strata` command as a user runs it: exit codes, one-line
// errors, parseable --json.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/test_util.h"

namespace strata {
namespace {

struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

RunResult RunCli(const std::string& args, const std::string& scratch) {
  const std::string err_file = scratch + "/stderr.txt";
  const std::string cmd = std::string(STRATA_CLI_PATH) + " " + args + " 2>" + err_file;
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int st = pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream f(err_file);
  r.err.assign(std::istreambuf_iterator<char>(f), {});
  return r;
}

size_t Lines(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += (c == '\n');
  return n;
}

class CliTest : public ::testing::Test {
 protected:
  testing::ScratchDir dir_;
};

TEST_F(CliTest, HelpListsSubcommands) {
  RunResult r = RunCli("--help", dir_.str());
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("info"), std::string::npos);
  EXPECT_NE(r.out.find("bench"), std::string::npos);
}

TEST_F(CliTest, UnknownSubcommandIsOneLineError) {
  RunResult r = RunCli("frobnicate", dir_.str());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LE(Lines(r.err), 2u) << r.err;  // the error, then "Run 'strata --help'"
  EXPECT_NE(r.err.find("strata:"), std::string::npos) << r.err;
}

TEST_F(CliTest, BadOptionIsOneLineError) {
  RunResult r = RunCli("info --no-such-flag", dir_.str());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LE(Lines(r.err), 2u) << r.err;
  EXPECT_NE(r.err.find("no-such-flag"), std::string::npos) << r.err;
}

TEST_F(CliTest, InfoJsonParses) {
  RunResult r = RunCli("info --json --path " + dir_.str(), dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_TRUE(j.contains("version"));
  EXPECT_TRUE(j.contains("memlock"));
}

TEST_F(CliTest, InfoPrintsEffectiveConfig) {
  RunResult r = RunCli(
      std::string("info --json --config ") + STRATA_SOURCE_DIR + "/configs/zero3_cpu_offload.json",
      dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["config"]["zero_optimization"]["stage"], 3);
  EXPECT_EQ(j["config"]["zero_optimization"]["offload_param"]["device"], "cpu");
}

TEST_F(CliTest, MissingConfigIsOneLineErrorNamingPath) {
  RunResult r = RunCli("info --config /nonexistent/strata.json", dir_.str());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("/nonexistent/strata.json"), std::string::npos) << r.err;
}

TEST_F(CliTest, MalformedConfigNamesLineAndColumn) {
  const std::string path = dir_.str() + "/bad.json";
  std::ofstream(path) << "{\n  \"zero_optimization\": {\n    \"stage\": 3,,\n  }\n}\n";
  RunResult r = RunCli("info --config " + path, dir_.str());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find(path + ":3:"), std::string::npos) << r.err;
}

TEST_F(CliTest, BadConfigValueNamesKeyPath) {
  const std::string path = dir_.str() + "/enum.json";
  std::ofstream(path)
      << R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}})";
  RunResult r = RunCli("info --config " + path, dir_.str());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("zero_optimization.offload_optimizer.device"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace strata
