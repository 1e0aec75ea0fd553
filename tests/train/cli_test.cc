// `strata train` as a user runs it: --json parses and its byte counters match
// the placement; bad input is a one-line error and a nonzero exit before any
// training step.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tests/test_util.h"
#include "tests/train/cli_process.h"

namespace strata {
namespace {

using cli_testing::ReadFile;
using cli_testing::RunResult;
using cli_testing::Spawn;
using cli_testing::Strata;
using cli_testing::SwapFilesIn;
using cli_testing::WaitFor;
using ::testing::HasSubstr;
using json = nlohmann::json;

std::string WriteConfig(const std::string& dir, const std::string& name, const std::string& opt,
                        const std::string& par, const std::string& extra = "") {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "bf16": {"enabled": true}, "optimizer": {"params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": ")"
                      << opt << R"(", "nvme_path": ")" << dir << R"(/nvme"},
      "offload_param": {"device": ")"
                      << par << R"(", "nvme_path": ")" << dir << R"(/nvme", "buffer_count": 8},
      "sub_group_size": 20000, "stage3_max_live_parameters": 30000,
      "stage3_param_persistence_threshold": 1000, "reduce_bucket_size": 1e6},
    "strata": {"device": "host", "hbm_budget": "4M", "threads": 2)"
                      << extra << R"(,
      "model": {"layers": 2, "hidden": 32, "seq_len": 16}}})";
  return path;
}

std::vector<std::string> Lines(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string l; std::getline(ss, l);)
    if (l.find("[strata info]") == std::string::npos && l.find("[strata warn") == std::string::npos)
      out.push_back(l);
  return out;
}

TEST(TrainCli, JsonParsesAndCountersMatchThePlacement) {
  testing::ScratchDir dir;
  for (const auto& [opt, par] :
       {std::pair{"nvme", "nvme"}, {"cpu", "cpu"}, {"nvme", "cpu"}, {"cpu", "nvme"}}) {
    SCOPED_TRACE(std::string(opt) + "/" + par);
    const std::string cfg = WriteConfig(dir.str(), "c.json", opt, par,
                                        R"(, "trace_path": ")" + dir.str() + "/trace.json\"");
    RunResult r = Strata("train --config " + cfg + " --steps 3 --json", dir.str());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    json j = json::parse(r.out);  // ONE object on stdout
    for (const char* key :
         {"final_loss", "initial_loss", "steps", "step_time_s", "overlap_efficiency",
          "hbm_high_water_bytes", "nvme_read_bytes", "nvme_written_bytes", "pcie_h2d_bytes",
          "pcie_d2h_bytes", "device", "losses", "tokens_per_s"})
      EXPECT_TRUE(j.contains(key)) << key;
    // The step bound: a fraction of the step, named by its component, with
    // the link rates measured at Plan().
    EXPECT_GT(j["bound_efficiency"].get<double>(), 0.0);
    EXPECT_LE(j["bound_efficiency"].get<double>(), 1.0);
    EXPECT_THAT(j["bound_by"].get<std::string>(),
                ::testing::AnyOf("compute", "pcie_h2d", "pcie_d2h", "cpu_optimizer", "nvme"));
    EXPECT_GT(j["h2d_gbytes_per_s"].get<double>(), 0.0);
    EXPECT_GT(j["per_step"][1]["bound_s"].get<double>(), 0.0);
    // Each step's bytes, adding up to the run's.
    for (const char* key :
         {"nvme_read_bytes", "nvme_written_bytes", "pcie_h2d_bytes", "pcie_d2h_bytes"}) {
      int64_t sum = 0;
      for (const json& st : j["per_step"]) sum += st[key].get<int64_t>();
      EXPECT_EQ(sum, j[key].get<int64_t>()) << key;
    }
    EXPECT_GT(j["per_step"][1]["pcie_d2h_bytes"].get<int64_t>(), 0);
    EXPECT_EQ(j["steps"], 3);
    EXPECT_EQ(j["losses"].size(), 3u);
    EXPECT_EQ(j["device"], "host");
    EXPECT_EQ(j["initial_loss"], j["losses"][0]);
    EXPECT_EQ(j["final_loss"], j["losses"][2]);
    EXPECT_GT(j["step_time_s"].get<double>(), 0);
    EXPECT_GT(j["overlap_efficiency"].get<double>(), 0);
    EXPECT_LE(j["overlap_efficiency"].get<double>(), 1);
    EXPECT_LE(j["hbm_high_water_bytes"].get<int64_t>(), 4 << 20);
    EXPECT_GT(j["hbm_high_water_bytes"].get<int64_t>(), 0);
    // Parameters live off the device: they are fetched (H2D) every use; gradients always leave
    // (D2H).
    EXPECT_GT(j["pcie_h2d_bytes"].get<int64_t>(), 0);
    EXPECT_GT(j["pcie_d2h_bytes"].get<int64_t>(), 0);
    const bool nvme = std::string(opt) == "nvme" || std::string(par) == "nvme";
    EXPECT_EQ(j["nvme_read_bytes"].get<int64_t>() > 0, nvme);
    EXPECT_EQ(j["nvme_written_bytes"].get<int64_t>() > 0, nvme);
    // Progress went to stderr, one line per step.
    int progress = 0;
    for (const std::string& l : Lines(r.err)) progress += l.rfind("step ", 0) == 0;
    EXPECT_EQ(progress, 3);
    EXPECT_EQ(j["trace_path"], dir.str() + "/trace.json");
    EXPECT_FALSE(
        json::parse(std::ifstream(dir.str() + "/trace.json"), nullptr, false).is_discarded());
  }
}

TEST(TrainCli, TableAndPlotData) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "cpu", "cpu");
  RunResult r =
      Strata("train --config " + cfg + " --steps 2 --plot " + dir.str() + "/plots", dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("step    1/2"));
  EXPECT_THAT(r.out, HasSubstr("loss "));
  EXPECT_THAT(r.out, HasSubstr("overlap"));
  EXPECT_THAT(r.out, HasSubstr("nvme read"));
  std::ifstream loss(dir.str() + "/plots/loss.dat");
  ASSERT_TRUE(loss.good());
  int rows = 0;
  for (std::string l; std::getline(loss, l);) rows += !l.empty() && l[0] != '#';
  EXPECT_EQ(rows, 2);
  EXPECT_TRUE(std::ifstream(dir.str() + "/plots/step_time.dat").good());
  // SVGs with gnuplot; without it, one line saying so (and still exit 0).
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) {
    for (const char* f : {"/plots/loss.svg", "/plots/step_time.svg"}) {
      std::stringstream svg;
      svg << std::ifstream(dir.str() + f).rdbuf();
      EXPECT_THAT(svg.str(), HasSubstr("<svg")) << f;
    }
  } else {
    EXPECT_THAT(r.err, HasSubstr("gnuplot not found"));
  }
}

void ExpectOneLineFailure(const RunResult& r, const std::string& what) {
  EXPECT_NE(r.exit_code, 0);
  std::vector<std::string> lines = Lines(r.err);
  ASSERT_EQ(lines.size(), 1u) << r.err;
  EXPECT_THAT(lines[0], HasSubstr("strata train: "));
  EXPECT_THAT(lines[0], HasSubstr(what));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("step ")));
}

TEST(TrainCli, BadConfigIsOneLineErrorBeforeTraining) {
  testing::ScratchDir dir;
  std::ofstream(dir.str() + "/bad.json") << R"({"strata": {"model": {"vocab": 1000}}})";
  ExpectOneLineFailure(Strata("train --config " + dir.str() + "/bad.json --steps 2", dir.str()),
                       "strata.model.vocab");
  std::ofstream(dir.str() + "/broken.json") << "{\"zero_optimization\": {";
  ExpectOneLineFailure(Strata("train --config " + dir.str() + "/broken.json", dir.str()),
                       "malformed JSON");
  ExpectOneLineFailure(Strata("train --config " + dir.str() + "/missing.json", dir.str()),
                       "missing.json");
}

TEST(TrainCli, UnwritableNvmePathIsOneLineErrorBeforeTraining) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "nvme", "nvme");
  ExpectOneLineFailure(
      Strata("train --config " + cfg + " --steps 2 --nvme-path /proc/strata-nvme", dir.str()),
      "/proc/strata-nvme");
  // /proc itself is a directory, writable by root, with no storage.
  const RunResult r = Strata("train --config " + cfg + " --steps 2 --nvme-path /proc", dir.str());
  ExpectOneLineFailure(r,
                       "nvme path /proc is on a proc filesystem (kernel objects, no storage), "
                       "not a writable regular filesystem");
}

TEST(TrainCli, PlanThatCannotFitIsOneLineError) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "cpu", "cpu");
  std::string text;
  {
    std::stringstream ss;
    ss << std::ifstream(cfg).rdbuf();
    text = ss.str();
  }
  const size_t at = text.find("\"4M\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 4, "\"64K\"");
  std::ofstream(cfg) << text;
  ExpectOneLineFailure(Strata("train --config " + cfg + " --steps 2", dir.str()), "hbm");
}

// --steps 0 and negative counts are errors (0 used to mean the default).
TEST(TrainCli, StepsZeroOrNegativeIsAnError) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "cpu", "cpu");
  for (const char* steps : {"0", "-1", "-5"}) {
    SCOPED_TRACE(steps);
    RunResult r = Strata("train --config " + cfg + " --steps " + steps, dir.str());
    EXPECT_NE(r.exit_code, 0);
    EXPECT_THAT(r.err, HasSubstr("--steps"));
    EXPECT_THAT(r.err, HasSubstr("at least 1"));
    EXPECT_THAT(r.out, ::testing::Not(HasSubstr("step ")));
  }
}

// A failed run with --json still prints one object: the error and the steps
// completed (none here: the plan cannot fit).
TEST(TrainCli, FailedRunWithJsonPrintsOneObjectWithTheError) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "cpu", "cpu");
  std::stringstream ss;
  ss << std::ifstream(cfg).rdbuf();
  std::string text = ss.str();
  text.replace(text.find("\"4M\""), 4, "\"64K\"");
  std::ofstream(cfg) << text;
  RunResult r = Strata("train --config " + cfg + " --steps 2 --json", dir.str());
  EXPECT_EQ(r.exit_code, 4);  // resource error
  json j = json::parse(r.out);
  EXPECT_THAT(j["error"].get<std::string>(), HasSubstr("hbm"));
  EXPECT_EQ(j["steps"], 0);
  EXPECT_TRUE(j["losses"].empty());
}

// SIGTERM / SIGINT mid-run: the run stops at the next micro-batch, the
// engine closes (its swap files removed), the exit code is 128 + signal and
// --json prints the steps completed with the error.
TEST(TrainCli, SigtermAndSigintEndTheRunCleanly) {
  for (const int sig : {SIGTERM, SIGINT}) {
    SCOPED_TRACE(sig == SIGTERM ? "SIGTERM" : "SIGINT");
    testing::ScratchDir dir;
    const std::string cfg = WriteConfig(dir.str(), "c.json", "nvme", "nvme");
    const pid_t pid = Spawn("train --config " + cfg + " --steps 1000000 --json", dir.str());
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(WaitFor(dir.str() + "/stderr", "step    2/")) << ReadFile(dir.str() + "/stderr");
    EXPECT_EQ(SwapFilesIn(dir.str() + "/nvme"), 1u);
    ASSERT_EQ(kill(pid, sig), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
    EXPECT_EQ(WEXITSTATUS(status), 128 + sig);
    EXPECT_EQ(SwapFilesIn(dir.str() + "/nvme"), 0u) << "swap files removed";
    const std::string err = ReadFile(dir.str() + "/stderr");
    EXPECT_THAT(err,
                HasSubstr(sig == SIGTERM ? "interrupted by SIGTERM" : "interrupted by SIGINT"));
    json j = json::parse(ReadFile(dir.str() + "/stdout"));
    EXPECT_THAT(j["error"].get<std::string>(), HasSubstr("Cancelled"));
    EXPECT_GE(j["steps"].get<int>(), 2);
    EXPECT_EQ(j["losses"].size(), j["steps"].get<size_t>());
  }
}

// kill -9 leaves the swap file behind, unlocked; the next run on the path
// removes it with a notice naming it, and trains.
TEST(TrainCli, SwapFileOfAKilledRunIsRemovedByTheNextRun) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "nvme", "nvme");
  const pid_t pid = Spawn("train --config " + cfg + " --steps 1000000", dir.str());
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(WaitFor(dir.str() + "/stdout", "step    1/")) << ReadFile(dir.str() + "/stderr");
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_EQ(SwapFilesIn(dir.str() + "/nvme"), 1u);
  std::string leftover;
  for (const auto& e : std::filesystem::directory_iterator(dir.str() + "/nvme"))
    leftover = e.path().string();
  RunResult r = Strata("train --config " + cfg + " --steps 1", dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("removed leftover swap file " + leftover));
  EXPECT_EQ(SwapFilesIn(dir.str() + "/nvme"), 0u);
}

// Under a low address-space limit the run ends with a Status (or trains), it
// neither hangs in OpenBLAS's buffer allocation nor aborts.
TEST(TrainCli, LowAddressLimitEndsWithAStatusNotAHang) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of address space: no ulimit -v here";
#endif
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "nvme", "nvme");
  // The lowest limit (in 50 MB steps) under which the binary still loads:
  // its shared libraries take a few hundred MB of address space, more or
  // less with each distribution (the GPU libraries are opened only when a
  // GPU path needs them).
  int64_t load_kb = 0;
  for (int64_t kb = 500000; kb <= 4000000 && load_kb == 0; kb += 50000) {
    const std::string probe = "bash -c 'ulimit -v " + std::to_string(kb) + "; exec " +
                              STRATA_CLI_PATH + " --help' >/dev/null 2>&1";
    const int st = std::system(probe.c_str());
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) load_kb = kb;
  }
  ASSERT_GT(load_kb, 0) << "strata --help does not start under 4 GB of address space";
  // Just above it (the engine's allocations hit the limit) and 400 MB more.
  for (const std::string& kb :
       {std::to_string(load_kb + 50000), std::to_string(load_kb + 400000)}) {
    SCOPED_TRACE(std::string("ulimit -v ") + kb);
    const std::string cmd = std::string("bash -c 'ulimit -v ") + kb + "; exec timeout 120 " +
                            STRATA_CLI_PATH + " train --config " + cfg + " --steps 2' >" +
                            dir.str() + "/stdout 2>" + dir.str() + "/stderr";
    const int st = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(st));
    const int code = WEXITSTATUS(st);
    const std::string err = ReadFile(dir.str() + "/stderr");
    EXPECT_NE(code, 124) << "hung: " << err;
    EXPECT_TRUE(code == 0 || code == 4) << code << ": " << err;  // 4: resource error
    if (code == 4) {
      EXPECT_THAT(err, HasSubstr("ResourceExhausted"));
    }
  }
}

// The host backend's losses are the same bits whatever the environment says
// about BLAS threads, and under an address-space limit (which makes strata
// restart itself with OPENBLAS_NUM_THREADS=1). The GEMMs here (128 tokens,
// hidden 128, ffn 512) are large enough for OpenBLAS to split them.
TEST(TrainCli, LossesAreBitwiseIndependentOfBlasThreadsAndLimits) {
  testing::ScratchDir dir;
  const std::string cfg = dir.str() + "/c.json";
  std::ofstream(cfg) << R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
      "offload_param": {"device": "cpu"}},
    "strata": {"device": "host", "hbm_budget": "64M", "threads": 2,
      "model": {"layers": 2, "hidden": 128, "seq_len": 64}}})";
  auto losses = [&](const std::string& prefix) {
    const std::string cmd = "bash -c '" + prefix + " exec " + STRATA_CLI_PATH + " train --config " +
                            cfg + " --steps 2 --json' >" + dir.str() + "/stdout 2>" + dir.str() +
                            "/stderr";
    const int st = std::system(cmd.c_str());
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << prefix << ReadFile(dir.str() + "/stderr");
    const json j = json::parse(ReadFile(dir.str() + "/stdout"), nullptr, false);
    if (!j.is_object() || !j.contains("losses")) return std::vector<double>();
    return j["losses"].get<std::vector<double>>();
  };
  const std::vector<double> one = losses("export OPENBLAS_NUM_THREADS=1;");
  ASSERT_EQ(one.size(), 2u);
  EXPECT_EQ(losses("export OPENBLAS_NUM_THREADS=2;"), one);
  EXPECT_EQ(losses("export OPENBLAS_NUM_THREADS=4;"), one);
#if !defined(__SANITIZE_ADDRESS__)  // ASan reserves terabytes of address space
  EXPECT_EQ(losses("unset OPENBLAS_NUM_THREADS; ulimit -v 4000000;"), one);
#endif
}

// STRATA_CPU_ISA runs the CPU optimizer of a whole run on one ISA; every
// ISA this machine has gives the same per-step losses, bit for bit (the
// kernels multiply then add everywhere, as the scalar loop does), for fp32
// and int8 states, with gradient accumulation and sub-groups whose sizes
// leave vector tails. An unknown or unsupported name fails before training,
// naming the variable.
TEST(TrainCli, LossesAreBitwiseEqualUnderEveryCpuIsa) {
  testing::ScratchDir dir;
  const RunResult info = Strata("info --json", dir.str());
  ASSERT_EQ(info.exit_code, 0) << info.err;
  const json ij = json::parse(info.out, nullptr, false);
  ASSERT_TRUE(ij.is_object() && ij.contains("cpu")) << info.out;
  std::vector<std::string> isas;
  for (const auto& i : ij["cpu"]["available_isas"])
    isas.push_back(i.get<std::string>() == "avx2+fma" ? "avx2" : i.get<std::string>());
  ASSERT_GE(isas.size(), 2u) << "at least one SIMD ISA and scalar";
  for (const std::string states : {"fp32", "int8"}) {
    const std::string cfg = WriteConfig(dir.str(), "c_" + states + ".json", "cpu", "cpu",
                                        R"(, "optimizer_states": ")" + states + R"(")");
    std::vector<double> first;
    for (const std::string& isa : isas) {
      const RunResult r =
          Strata("train --config " + cfg + " --steps 3 --json", dir.str(), "STRATA_CPU_ISA=" + isa);
      ASSERT_EQ(r.exit_code, 0) << isa << " " << states << ": " << r.err;
      const json j = json::parse(r.out, nullptr, false);
      ASSERT_TRUE(j.is_object()) << r.out;
      const std::vector<double> losses = j["losses"].get<std::vector<double>>();
      ASSERT_EQ(losses.size(), 3u);
      EXPECT_NE(losses.front(), losses.back()) << "the model did not train";
      if (first.empty()) {
        first = losses;
      } else {
        EXPECT_EQ(losses, first) << isa << " vs " << isas.front() << " (" << states << ")";
      }
    }
  }
  const std::string cfg = WriteConfig(dir.str(), "c.json", "cpu", "cpu");
  const RunResult bad =
      Strata("train --config " + cfg + " --steps 1", dir.str(), "STRATA_CPU_ISA=neon");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("STRATA_CPU_ISA"));
  EXPECT_THAT(bad.err, HasSubstr("avx512, avx2, sse4.2, scalar"));
  EXPECT_EQ(Lines(bad.err).size(), 1u) << bad.err;
  if (std::find(isas.begin(), isas.end(), "avx512") == isas.end()) {
    const RunResult no =
        Strata("train --config " + cfg + " --steps 1", dir.str(), "STRATA_CPU_ISA=avx512");
    EXPECT_NE(no.exit_code, 0);
    EXPECT_THAT(no.err, HasSubstr("usable here"));
  }
}

// What can still change the bits (the OpenBLAS build and the kernels it picks
// for the CPU) is in the checkpoint's manifest; resuming on other kernels
// (OPENBLAS_CORETYPE here) warns.
TEST(TrainCli, ResumeOnOtherBlasKernelsWarns) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "cpu", "cpu");
  const std::string ck = dir.str() + "/ck";
  // The arithmetic recorded in the newest checkpoint's note (ckpt-<N>, N
  // zero-padded: the greatest name).
  auto recorded = [&] {
    std::string newest;
    for (const auto& e : std::filesystem::directory_iterator(ck))
      if (std::filesystem::exists(e.path() / "MANIFEST.json"))
        newest = std::max(newest, e.path().string());
    if (newest.empty()) return std::string();
    const json m = json::parse(ReadFile(newest + "/MANIFEST.json"));
    return json::parse(m["note"].get<std::string>())["arithmetic"].get<std::string>();
  };
  RunResult r = Strata("train --config " + cfg + " --steps 2 --checkpoint-dir " + ck, dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string arithmetic = recorded();
  EXPECT_THAT(arithmetic, HasSubstr("host: OpenBLAS"));
  EXPECT_THAT(arithmetic, HasSubstr("; 1 thread"));
  r = Strata("train --config " + cfg + " --steps 3 --checkpoint-dir " + ck + " --resume", dir.str(),
             "OPENBLAS_CORETYPE=Nehalem");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string now = recorded();
  if (now == arithmetic)
    GTEST_SKIP() << "OPENBLAS_CORETYPE=Nehalem picks no other kernels here: " << arithmetic;
  EXPECT_THAT(r.err,
              HasSubstr("was written with other arithmetic (" + arithmetic + ") than this run's (" +
                        now + "): the losses from step 3 on may differ"));
}

// A thread refused under `ulimit -v` names the limit. Where the engine's
// threads fail depends on what the process has mapped; the limits tried
// bracket it (each run ends before the first step). Only limits under which
// the binary's libraries load are tried: below those a library may stop
// the process before main (Debian 13's OpenBLAS 0.3.29 spins in its
// load-time initialisation under about 400 MB, OpenBLAS issue 5289), where
// no message of Strata's can be printed.
TEST(TrainCli, ThreadThatCannotStartUnderAddressLimitNamesTheLimit) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of address space: no ulimit -v here";
#endif
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "cpu", "cpu");
  int hits = 0;
  int lowest_loading_kb = 0;
  for (int kb = 200000; kb >= 50000; kb -= 10000) {
    // Descending: a limit too low to load at is followed by lower ones.
    const std::string probe = "bash -c 'ulimit -v " + std::to_string(kb) +
                              "; exec timeout -s KILL 10 " + STRATA_CLI_PATH +
                              " --help' >/dev/null 2>&1";
    const int st = std::system(probe.c_str());
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) break;
    lowest_loading_kb = kb;
    const std::string cmd = "bash -c 'ulimit -v " + std::to_string(kb) +
                            "; exec timeout -s KILL 120 " + STRATA_CLI_PATH + " train --config " +
                            cfg + " --steps 2' >/dev/null 2>" + dir.str() + "/stderr";
    std::system(cmd.c_str());
    const std::string err = ReadFile(dir.str() + "/stderr");
    if (err.find("cannot start its 4 threads") == std::string::npos) continue;
    ++hits;
    EXPECT_THAT(err,
                HasSubstr("RLIMIT_AS (`ulimit -v`) is " + std::to_string(kb * 1024LL) + " bytes"));
  }
  if (lowest_loading_kb == 0)
    GTEST_SKIP() << "strata --help does not finish under ulimit -v 200000: its libraries need "
                    "more address space to load here than the limits this test tries";
  if (hits == 0) GTEST_SKIP() << "no limit tried stopped the host device's threads here";
}

// --resume: an empty directory says there is nothing to resume and starts
// at step 0; one that does not exist is a usage error (nothing is created).
TEST(TrainCli, ResumeFromAnEmptyOrMissingDirectory) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "cpu", "cpu");
  std::filesystem::create_directory(dir.str() + "/empty");
  RunResult r = Strata(
      "train --config " + cfg + " --steps 2 --checkpoint-dir " + dir.str() + "/empty --resume",
      dir.str());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--resume: nothing to resume in " + dir.str() +
                               "/empty (no checkpoint there): starting from step 0"));
  r = Strata("train --config " + cfg + " --steps 2 --checkpoint-dir " + dir.str() +
                 "/mistyped --resume --json",
             dir.str());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--checkpoint-dir " + dir.str() + "/mistyped does not exist"));
  EXPECT_FALSE(std::filesystem::exists(dir.str() + "/mistyped"));
  // No step ran: no losses to report.
  const json j = json::parse(r.out);
  EXPECT_TRUE(j["initial_loss"].is_null()) << r.out;
  EXPECT_TRUE(j["final_loss"].is_null()) << r.out;
}

// --steps is the total: below the checkpoint's step is a usage error, equal
// to it is a finished run (one line, exit 0); a refused resume reports no
// resumed_from_step.
TEST(TrainCli, ResumeWithStepsAtOrBelowTheCheckpoint) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "cpu", "cpu");
  const std::string ck = " --checkpoint-dir " + dir.str() + "/ck";
  ASSERT_EQ(Strata("train --config " + cfg + " --steps 3" + ck, dir.str()).exit_code, 0);
  RunResult r = Strata("train --config " + cfg + " --steps 2 --resume --json" + ck, dir.str());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--steps 2 is the total, and checkpoint "));
  EXPECT_THAT(r.err, HasSubstr(" is at step 3 already: give --steps above 3 to train on"));
  EXPECT_TRUE(json::parse(r.out)["resumed_from_step"].is_null()) << r.out;
  r = Strata("train --config " + cfg + " --steps 3 --resume --json" + ck, dir.str());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr(" is at step 3, which is --steps: nothing to train"));
  EXPECT_EQ(json::parse(r.out)["resumed_from_step"], 3);
  // Another config: the resume is refused.
  const std::string other = dir.str() + "/other.json";
  std::string text = ReadFile(cfg);
  text.replace(text.find("\"seq_len\": 16"), 13, "\"seq_len\": 16, \"seed\": 7");
  std::ofstream(other) << text;
  r = Strata("train --config " + other + " --steps 4 --resume --json" + ck, dir.str());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("different config"));
  EXPECT_TRUE(json::parse(r.out)["resumed_from_step"].is_null()) << r.out;
}

// A run whose loss ends NaN (learning rate 1e30) fails, in one line.
TEST(TrainCli, RunEndingWithANanLossFails) {
  testing::ScratchDir dir;
  std::string text = ReadFile(WriteConfig(dir.str(), "c.json", "cpu", "cpu"));
  text.replace(text.find("\"lr\": 3e-3"), 10, "\"lr\": 1e30");
  text.replace(text.find("\"bf16\": {\"enabled\": true}, "), 27, "");
  const std::string cfg = dir.str() + "/nan.json";
  std::ofstream(cfg) << text;
  RunResult r = Strata("train --config " + cfg + " --steps 3 --json", dir.str());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err,
              HasSubstr("strata train: FailedPrecondition: the loss is NaN from step 2 to the "
                        "last, step 3: the run diverged"));
  const json j = json::parse(r.out);
  EXPECT_THAT(j["error"].get<std::string>(), HasSubstr("the loss is NaN"));
  EXPECT_EQ(j["steps"], 3);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// `strata plan`: the tier table and the predicted step of the config, the
// NVMe traffic equal to what `strata train` measures where the engine's
// traffic is exact (the optimizer states and the updated parameters), and
// the largest model that fits; a plan that does not fit exits 4.
TEST(PlanCli, JsonTableMatchesTheTrainedRun) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "nvme", "nvme");
  RunResult r = Strata("plan --config " + cfg + " --json", dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json plan = json::parse(r.out);
  EXPECT_TRUE(plan["fits"].get<bool>());
  std::vector<std::string> tiers;
  for (const json& t : plan["tiers"]) tiers.push_back(t["tier"].get<std::string>());
  EXPECT_THAT(tiers, ::testing::ElementsAre("hbm", "pinned", "nvme", "dram"));
  const int64_t params = plan["model"]["parameters"].get<int64_t>();
  double nvme_write = -1, d2h = -1, h2d = -1, adam = -1;
  for (const json& t : plan["step"]) {
    if (t["resource"] == "pcie_h2d") h2d = t["amount"].get<double>();
    if (t["resource"] == "nvme_write") nvme_write = t["amount"].get<double>();
    if (t["resource"] == "pcie_d2h") d2h = t["amount"].get<double>();
    if (t["resource"] == "cpu_optimizer") adam = t["amount"].get<double>();
  }
  EXPECT_EQ(adam, static_cast<double>(params));
  EXPECT_GT(plan["rates"]["nvme_write_gbytes_per_s"].get<double>(), 0);
  EXPECT_GT(plan["bound_s"].get<double>(), 0);
  EXPECT_GT(plan["largest"]["layers"].get<int64_t>(), plan["model"]["layers"].get<int64_t>());
  EXPECT_FALSE(plan["largest"]["limited_by"].get<std::string>().empty());
  // The trained run's counters per step: the NVMe writes (states and
  // updated parameters) and the gradients' copies within 15 % of the
  // prediction (the first step's and the initial writes count in the totals
  // too); the fetches no more than predicted (the prediction assumes every
  // module fetched for forward and for backward).
  RunResult t = Strata("train --config " + cfg + " --steps 3 --json", dir.str());
  ASSERT_EQ(t.exit_code, 0) << t.err;
  const json run = json::parse(t.out);
  const double steps = run["steps"].get<double>();
  EXPECT_NEAR(run["nvme_written_bytes"].get<double>() / steps, nvme_write, 0.15 * nvme_write);
  EXPECT_NEAR(run["pcie_d2h_bytes"].get<double>() / steps, d2h, 0.15 * d2h);
  EXPECT_LE(run["pcie_h2d_bytes"].get<double>() / steps, h2d);
  // --params: the config's width, as many blocks as make about that many.
  r = Strata("plan --config " + cfg + " --params 2M --no-nvme-bench --json", dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json big = json::parse(r.out);
  EXPECT_NEAR(big["model"]["parameters"].get<double>(), 2e6, 0.05e6);
  EXPECT_EQ(big["rates"]["nvme_read_gbytes_per_s"].get<double>(), 0);
  // Human-readable: the table and the verdict.
  r = Strata("plan --config " + cfg + " --no-nvme-bench", dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("largest that fits"));
  EXPECT_THAT(r.out, HasSubstr("predicted step"));
}

// strata train's summary sets the plan's prediction (Engine::PredictedStep)
// beside what the steady steps moved: the NVMe writes and the gradients'
// copies as predicted (within 5 %), the fetches no more than predicted.
TEST(PlanCli, TrainSummaryHasThePredictionBesideTheMeasurement) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "nvme", "nvme");
  RunResult t = Strata("train --config " + cfg + " --steps 4 --json", dir.str());
  ASSERT_EQ(t.exit_code, 0) << t.err;
  const json run = json::parse(t.out);
  std::map<std::string, std::pair<double, double>> got;  // resource -> (predicted, measured)
  for (const json& p : run["predicted_step"])
    got[p["resource"].get<std::string>()] = {p["amount"].get<double>(),
                                             p["measured_amount"].get<double>()};
  ASSERT_TRUE(got.count("nvme_write") && got.count("pcie_d2h") && got.count("pcie_h2d"));
  for (const char* r : {"nvme_write", "pcie_d2h"})
    EXPECT_NEAR(got[r].second, got[r].first, 0.05 * got[r].first) << r;
  EXPECT_LE(got["pcie_h2d"].second, got["pcie_h2d"].first);
  EXPECT_GT(got["pcie_h2d"].second, 0);
  EXPECT_EQ(got["cpu_optimizer"].second, -1);  // its busy time is in per_step
  RunResult table = Strata("train --config " + cfg + " --steps 2", dir.str());
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("predicted s"));
  EXPECT_THAT(table.out, HasSubstr("measured busy"));
}

// Planning a GPU machine from one without its GPU: a config naming cuda
// where no CUDA device opens plans a GPU of strata.hbm_budget bytes, --gpu
// a preset's; the output names the figures that are nominal, and the NVMe
// directory of that machine is neither created nor measured. Without a
// budget or a preset the error names both; an unknown preset is a usage
// error. (On a machine with a GPU only the --gpu cases run.)
TEST(PlanCli, PlansAGpuThatIsNotHere) {
  testing::ScratchDir dir;
  const RunResult info = Strata("info --json", dir.str());
  ASSERT_EQ(info.exit_code, 0) << info.err;
  const bool have_gpu = !json::parse(info.out)["gpu"]["devices"].empty();
  const std::string missing = dir.str() + "/other-machine/nvme";
  auto config = [&](const std::string& budget) {
    const std::string path = dir.str() + "/gpu" + budget + ".json";
    std::ofstream(path) << R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": ")"
                        << missing << R"("},
        "offload_param": {"device": "cpu"}, "sub_group_size": 1e7},
      "strata": {"device": "cuda", )"
                        << (budget.empty() ? "" : R"("hbm_budget": ")" + budget + R"(", )")
                        << R"("model": {"layers": 8, "hidden": 1024, "seq_len": 256}}})";
    return path;
  };
  if (!have_gpu) {
    const RunResult r = Strata("plan --config " + config("2G") + " --json", dir.str());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const json j = json::parse(r.out);
    EXPECT_THAT(j["device"].get<std::string>(), HasSubstr("described, not opened"));
    const auto nominal = j["nominal"].get<std::vector<std::string>>();
    for (const char* n : {"h2d", "d2h", "device_copy", "nvme"})
      EXPECT_NE(std::find(nominal.begin(), nominal.end(), n), nominal.end()) << n << " " << r.out;
    EXPECT_EQ(std::find(nominal.begin(), nominal.end(), "hbm_budget"), nominal.end());
    EXPECT_EQ(j["tiers"][0]["tier"], "hbm");
    EXPECT_EQ(j["tiers"][0]["available_bytes"], int64_t{2} << 30);
    EXPECT_GT(j["rates"]["h2d_gbytes_per_s"].get<double>(), 0);
    EXPECT_GT(j["rates"]["cpu_adam_elems_per_s"].get<double>(), 0) << "the CPU is measured";
    EXPECT_FALSE(std::filesystem::exists(missing)) << "another machine's directory was created";
    const RunResult t = Strata("plan --config " + config("2G"), dir.str());
    EXPECT_EQ(t.exit_code, 0) << t.err;
    EXPECT_THAT(t.out, HasSubstr("nominal, not measured here: h2d, d2h"));
    const RunResult none = Strata("plan --config " + config(""), dir.str());
    EXPECT_EQ(none.exit_code, 3) << none.err;
    EXPECT_THAT(none.err, HasSubstr("set strata.hbm_budget"));
    EXPECT_THAT(none.err, HasSubstr("--gpu h100, h100-pcie, h200"));
  }
  const RunResult h = Strata("plan --config " + config("") + " --gpu H200 --json", dir.str());
  ASSERT_EQ(h.exit_code, 0) << h.err;
  const json hj = json::parse(h.out);
  EXPECT_THAT(hj["device"].get<std::string>(), HasSubstr("NVIDIA H200"));
  const auto nominal = hj["nominal"].get<std::vector<std::string>>();
  EXPECT_NE(std::find(nominal.begin(), nominal.end(), "hbm_budget"), nominal.end());
  EXPECT_EQ(hj["tiers"][0]["available_bytes"], (int64_t{141} << 30) - (int64_t{1} << 30));
  // PCIe 5.0 x16: 63.0 GB/s raw per direction, 0.8 of it nominal.
  EXPECT_NEAR(hj["rates"]["h2d_gbytes_per_s"].get<double>(), 0.8 * 32 * 16 * 128 / 130 / 8, 1e-9);
  const RunResult over = Strata("plan --config " + config("100G") + " --gpu a100-40g", dir.str());
  EXPECT_EQ(over.exit_code, 3) << over.err;
  EXPECT_THAT(over.err, HasSubstr("is more than the 42949672960 bytes of the NVIDIA A100"));
  const RunResult bad = Strata("plan --config " + config("2G") + " --gpu h300", dir.str());
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_THAT(bad.err, HasSubstr("h300 is not one of h100, h100-pcie"));
}

TEST(PlanCli, PlanThatDoesNotFitExitsFourWithTheRowMarked) {
  testing::ScratchDir dir;
  const std::string cfg = WriteConfig(dir.str(), "c.json", "cpu", "cpu");
  RunResult r = Strata("plan --config " + cfg + " --params 50M", dir.str());
  // 4 MiB of HBM holds the slots of this width: what overflows is the host.
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string text = ReadFile(cfg);
  const size_t at = text.find("\"4M\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 4, "\"64K\"");
  std::ofstream(cfg) << text;
  r = Strata("plan --config " + cfg, dir.str());
  EXPECT_EQ(r.exit_code, 4) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("<-- over"));
  EXPECT_THAT(r.out, HasSubstr("does not fit"));
}

}  // namespace
}  // namespace strata
