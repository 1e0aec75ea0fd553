// Smoke tests of the `strata` command as a user runs it: exit codes, one-line
// errors, parseable --json.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "apps/strata/launch_ranks.h"
#include "strata/strata.h"
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

// --threads: above the machine's PUs, or negative, is a one-line error naming
// the value and the range (not a 309-digit bound); 0 stays "all PUs".
TEST_F(CliTest, BenchThreadsOutOfRangeIsOneLineErrorNamingTheRange) {
  for (const char* bench : {"adam", "accumulate"}) {
    SCOPED_TRACE(bench);
    RunResult r =
        RunCli(std::string("bench ") + bench + " --params 1000 --threads 100000", dir_.str());
    EXPECT_NE(r.exit_code, 0);
    EXPECT_LE(Lines(r.err), 2u) << r.err;
    EXPECT_NE(r.err.find("100000 threads is more than this machine's"), std::string::npos) << r.err;
    r = RunCli(std::string("bench ") + bench + " --params 1000 --threads -1", dir_.str());
    EXPECT_NE(r.exit_code, 0);
    EXPECT_LE(Lines(r.err), 2u) << r.err;
    EXPECT_NE(r.err.find("\"-1\" is not a thread count: give 0 (all"), std::string::npos) << r.err;
    EXPECT_LT(r.err.size(), 200u) << r.err;
  }
  RunResult r = RunCli("bench adam --params 1000 --threads 0 --reps 1 --json", dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_GE(nlohmann::json::parse(r.out)["threads"].get<int>(), 1);
}

// bench adam's and bench accumulate's fraction of their roofline is the
// median of roofline/kernel pairs (one per slab and repetition), reported
// with their spread and with how often other work took the cores.
TEST_F(CliTest, BenchAdamReportsTheRooflineFractionOfPairsWithItsSpread) {
  for (const std::string bench : {"adam", "accumulate"}) {
    RunResult r =
        RunCli("bench " + bench + " --params 20000 --threads 1 --reps 5 --json", dir_.str());
    ASSERT_EQ(r.exit_code, 0) << bench << ": " << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["slabs"].get<int>(), 1) << bench;
    EXPECT_EQ(j["pairs"].get<int>(), 5) << bench;
    const double lo = j["roofline_fraction_min"], q1 = j["roofline_fraction_p25"],
                 med = j["roofline_fraction"], q3 = j["roofline_fraction_p75"],
                 hi = j["roofline_fraction_max"];
    EXPECT_GT(lo, 0) << bench;
    EXPECT_LE(lo, q1) << bench;
    EXPECT_LE(q1, med) << bench;
    EXPECT_LE(med, q3) << bench;
    EXPECT_LE(q3, hi) << bench;
    EXPECT_GE(j["involuntary_context_switches"].get<int64_t>(), 0) << bench;
    EXPECT_TRUE(j["cores_contended"].is_boolean()) << bench;
    // The text form names the pairs and the spread.
    r = RunCli("bench " + bench + " --params 20000 --threads 1 --reps 3", dir_.str());
    ASSERT_EQ(r.exit_code, 0) << bench << ": " << r.err;
    EXPECT_NE(r.out.find("median of 3 roofline/strata pairs"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("p25"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("involuntary context switches/s"), std::string::npos) << r.out;
  }
}

// bench adam --states: each compact format is stepped against its own
// roofline, with bytes/param at the stored sizes; a format the optimizer
// does not support is a one-line error naming both.
TEST_F(CliTest, BenchAdamStatesFormats) {
  const std::pair<const char*, double> formats[] = {
      {"fp32", 28}, {"bf16", 20}, {"bf16-master", 16}, {"int8", 16.0625}};
  for (const auto& [name, bpp] : formats) {
    SCOPED_TRACE(name);
    RunResult r = RunCli(
        std::string("bench adam --params 20000 --threads 1 --reps 1 --json --states ") + name,
        dir_.str());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["states"].get<std::string>(), name);
    EXPECT_EQ(j["bytes_per_param"].get<double>(), bpp);
    EXPECT_EQ(j["roofline_bytes_per_param"].get<double>(), bpp);
    EXPECT_GT(j["roofline_fraction"].get<double>(), 0);
  }
  RunResult r = RunCli("bench adam --params 1000 --states int8", dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("exp_avg 1r+1w + exp_avg_sq 1r+1w + scales 0.03125r+0.03125w = 16.0625"),
            std::string::npos)
      << r.out;
  r = RunCli("bench adam --params 1000 --states bf16-master --optimizer lion", dir_.str());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LE(Lines(r.err), 2u) << r.err;
  EXPECT_NE(r.err.find("--states bf16-master is not supported for --optimizer lion"),
            std::string::npos)
      << r.err;
}

// bench adam --states with several formats (or all) measures them
// interleaved in one process: each against its own roofline, and its rate
// against the first listed as the median of the repetitions' ratios (the
// first's own ratio is exactly 1). Bad lists are one-line errors naming the
// value and what is allowed.
TEST_F(CliTest, BenchAdamStatesListIsInterleavedWithRatiosToTheFirst) {
  RunResult r = RunCli(
      "bench adam --params 20000 --threads 1 --reps 3 --json --states fp32,int8,bf16", dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["baseline"], "fp32");
  ASSERT_EQ(j["formats"].size(), 3u);
  const std::pair<const char*, double> want[] = {{"fp32", 28}, {"int8", 16.0625}, {"bf16", 20}};
  for (size_t i = 0; i < 3; ++i) {
    const auto& f = j["formats"][i];
    SCOPED_TRACE(want[i].first);
    EXPECT_EQ(f["states"], want[i].first);
    EXPECT_EQ(f["bytes_per_param"].get<double>(), want[i].second);
    EXPECT_EQ(f["pairs"].get<int>(), 3);
    EXPECT_GT(f["roofline_fraction"].get<double>(), 0);
    EXPECT_GT(f["params_per_s"].get<double>(), 0);
    const double q1 = f["speedup_vs_baseline_p25"], med = f["speedup_vs_baseline"],
                 q3 = f["speedup_vs_baseline_p75"];
    EXPECT_GT(q1, 0);
    EXPECT_LE(q1, med);
    EXPECT_LE(med, q3);
  }
  EXPECT_EQ(j["formats"][0]["speedup_vs_baseline"].get<double>(), 1.0);
  // "all": every format the optimizer supports (Lion has no bf16 master).
  r = RunCli("bench adam --params 3000 --threads 1 --reps 1 --json --states all --optimizer lion",
             dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["formats"].size(), 3u);
  EXPECT_EQ(j["formats"][2]["states"], "int8");
  // The text form: a row per format with its ratio to the first.
  r = RunCli("bench adam --params 3000 --threads 1 --reps 1 --states bf16,fp32", dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("states bf16,fp32 interleaved"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("vs bf16"), std::string::npos) << r.out;
  for (const auto& [states, msg] :
       {std::pair{"fp32,int4",
                  "--states: \"int4\" is not a state format (fp32, bf16, "
                  "bf16-master, int8, a comma-separated list of them, or all)"},
        std::pair{"fp32,", "--states: \"\" is not a state format"},
        std::pair{"int8,fp32,int8", "--states lists int8 twice"},
        std::pair{"fp32,bf16-master",
                  "--states bf16-master is not supported for --optimizer "
                  "lion"}}) {
    r = RunCli(std::string("bench adam --params 1000 --optimizer lion --states ") + states,
               dir_.str());
    EXPECT_EQ(r.exit_code, 2) << states;
    EXPECT_LE(Lines(r.err), 2u) << r.err;
    EXPECT_NE(r.err.find(msg), std::string::npos) << states << ": " << r.err;
  }
}

// bench adam checks memory before allocating its arrays: under an address
// limit far below what --params needs it fails at once, naming both sides.
TEST_F(CliTest, BenchAdamRefusesParamsThatDoNotFitBeforeAllocating) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of address space: no ulimit -v here";
#endif
  const std::string cmd = "bash -c 'ulimit -v 3000000; exec " + std::string(STRATA_CLI_PATH) +
                          " bench adam --params 1e9' 2>" + dir_.str() + "/err.txt";
  const int st = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 4);  // resource error
  std::ifstream f(dir_.str() + "/err.txt");
  const std::string err(std::istreambuf_iterator<char>(f), {});
  EXPECT_NE(err.find("needs 16000000000 bytes"), std::string::npos) << err;
  // The address limit, or less memory than that on this machine.
  EXPECT_TRUE(err.find("RLIMIT_AS") != std::string::npos ||
              err.find("MemAvailable") != std::string::npos)
      << err;
}

// bench nvme --size beyond the free space fails on the space, before its
// buffers (not an allocation error of 2 GiB of buffers).
TEST_F(CliTest, BenchNvmeSizeBeyondFreeSpaceFailsBeforeAllocating) {
  RunResult r = RunCli("bench nvme --path " + dir_.str() + " --size 100T", dir_.str());
  EXPECT_EQ(r.exit_code, 4);  // resource error
  EXPECT_EQ(Lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("needs 109951162777600 bytes"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("available"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("AlignedBuffer"), std::string::npos) << r.err;
}

// info --path lists the swap files there: a leftover (no lock) with its
// size and age, in JSON and in the table.
TEST_F(CliTest, InfoListsLeftoverSwapFiles) {
  const std::string leftover = dir_.str() + "/strata-swap-0123456789abcdef-42-0.bin";
  std::ofstream(leftover) << std::string(8192, 'x');
  RunResult r = RunCli("info --json --path " + dir_.str(), dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["io"]["swap_files"].size(), 1u) << r.out;
  EXPECT_EQ(j["io"]["swap_files"][0]["path"], leftover);
  EXPECT_EQ(j["io"]["swap_files"][0]["state"], "leftover");
  EXPECT_GE(j["io"]["swap_files"][0]["size_bytes"].get<int64_t>(), 8192);
  EXPECT_GE(j["io"]["swap_files"][0]["age_s"].get<double>(), 0.0);
  r = RunCli("info --path " + dir_.str(), dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("leftover  " + leftover), std::string::npos) << r.out;
  EXPECT_TRUE(std::ifstream(leftover).good()) << "info only lists";
}

// The exit codes of docs/cli.md's table, one case per row that needs no run.
TEST_F(CliTest, ExitCodesFollowTheTable) {
  const std::string d = dir_.str();
  std::ofstream(d + "/bad.json") << R"({"train_micro_batch_size_per_gpu": -1})";
  const std::pair<std::string, int> cases[] = {
      {"frobnicate", 2},                                   // usage: unknown subcommand
      {"info --no-such-flag", 2},                          // usage: unknown option
      {"train", 2},                                        // usage: missing --config
      {"train --config " + d + "/bad.json --steps x", 2},  // usage: bad value
      {"bench nvme --path " + d + " --threads 100", 2},    // usage: out of range
      {"info --config " + d + "/none.json", 3},            // config: missing file
      {"train --config " + d + "/bad.json", 3},            // config: bad value
      {"bench nvme --path " + d + " --size 100T", 4},      // resource: disk space
  };
  for (const auto& [args, code] : cases) {
    SCOPED_TRACE(args);
    RunResult r = RunCli(args, d);
    EXPECT_EQ(r.exit_code, code) << r.err;
    EXPECT_LE(Lines(r.err), 2u) << r.err;
  }
}

// bench nvme's checks name its flags, and the block size rule says where the
// config's differs.
TEST_F(CliTest, BenchNvmeFlagErrorsNameTheFlags) {
  RunResult r = RunCli("bench nvme --path " + dir_.str() + " --threads 100", dir_.str());
  EXPECT_NE(r.err.find("--threads: 100 is not between 1 and 64"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("intra_op_parallelism"), std::string::npos) << r.err;
  r = RunCli("bench nvme --path " + dir_.str() + " --block-size 1536", dir_.str());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--block-size: 1536 is not a multiple of 4096"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the config check accepts any multiple of 512"), std::string::npos) << r.err;
  r = RunCli("bench nvme --path " + dir_.str() + " --in-flight 0", dir_.str());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--in-flight: 0 is not between 1 and 1024"), std::string::npos) << r.err;
}

// One request at a time: the time per request is reported, and the run's
// ratios against fio (when fio is installed) come with their spread.
TEST_F(CliTest, BenchNvmeOneRequestAtATimeReportsTheTimePerRequest) {
  RunResult r = RunCli("bench nvme --path " + dir_.str() +
                           " --size 256K --block-size 64K --request-size 64K --queue-depth 1 "
                           "--in-flight 1 --runs 3 --json",
                       dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["requests_in_flight"].get<int>(), 1);
  EXPECT_EQ(j["requests_per_pass"].get<double>(), 4.0);
  EXPECT_GT(j["read_us_per_request"].get<double>(), 0.0);
  EXPECT_NEAR(j["read_us_per_request"].get<double>(),
              256.0 * 1024 / (j["read_gbytes_per_s"].get<double>() * 1e9) / 4 * 1e6, 1e-6);
  if (std::system("command -v fio >/dev/null 2>&1") != 0) return;
  r = RunCli("bench nvme --path " + dir_.str() + " --size 1M --block-size 256K --runs 3 --vs-fio",
             dir_.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("median of 3 runs' ratios"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("p25"), std::string::npos) << r.out;
}

// Under `ulimit -v` of 600 MB the command starts and the host device plans:
// the GPU libraries (cuBLAS with cuBLASLt, NCCL: about 1 GB of address space
// together) are opened at their first use, not mapped before main, so nothing
// here maps them. Loaded at start, they stopped the loader (exit 127) or
// crashed cuBLASLt's initializer under such a limit.
TEST_F(CliTest, StartsAndPlansOnTheHostUnder600MBOfAddressSpace) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of address space: no ulimit -v here";
#endif
  const std::string d = dir_.str();
  const std::string limited = "cd " + d + " && bash -c 'ulimit -v 614400; exec timeout 120 " +
                              std::string(STRATA_CLI_PATH) + " ";
  const std::pair<std::string, std::string> cases[] = {
      {"--version", std::string(strata::Version())},
      {"--help", "plan"},
      {"plan --config " STRATA_SOURCE_DIR "/configs/demo.json --device host --no-nvme-bench",
       "fits"},
  };
  for (const auto& [args, expected] : cases) {
    SCOPED_TRACE("ulimit -v 614400; strata " + args);
    const std::string cmd = limited + args + "' >" + d + "/out 2>" + d + "/err";
    const int st = std::system(cmd.c_str());
    std::ifstream out_file(d + "/out"), err_file(d + "/err");
    const std::string out{std::istreambuf_iterator<char>(out_file), {}};
    const std::string err{std::istreambuf_iterator<char>(err_file), {}};
    ASSERT_TRUE(WIFEXITED(st)) << "killed by a signal: " << err;
    EXPECT_EQ(WEXITSTATUS(st), 0) << err;
    EXPECT_NE(out.find(expected), std::string::npos) << out << err;
  }
}

}  // namespace
}  // namespace strata

// The launcher's one-GPU-per-local-rank rule (the GPU count given, so it runs
// without a GPU): more ranks than GPUs is refused naming both counts and the
// way out; host, no GPU, or enough GPUs pass.
TEST(LaunchRanksTest, MoreLocalRanksThanGpusIsRefusedBeforeStarting) {
  using strata::cli::GpusForLocalRanks;
  const strata::Status s = GpusForLocalRanks(2, "cuda", 1, "--nproc-per-node");
  EXPECT_EQ(s.code(), strata::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("--nproc-per-node 2"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("has 1 CUDA device(s)"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("--device host"), std::string::npos) << s.ToString();
  EXPECT_FALSE(GpusForLocalRanks(3, "auto", 2, "--nproc").ok());
  EXPECT_TRUE(GpusForLocalRanks(2, "host", 1, "--nproc").ok());
  EXPECT_TRUE(GpusForLocalRanks(2, "auto", 0, "--nproc").ok());
  EXPECT_TRUE(GpusForLocalRanks(2, "cuda", 2, "--nproc").ok());
}
