// The `strata` command against hostile inputs: absurd model sizes, a closed
// stdout, NaN and infinite options, FIFOs where files are read. Each run is
// bounded (`timeout`, and an address-space limit where a run could allocate
// without bound), so a regression fails instead of hanging or eating memory.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadFile(const std::string& path) {
  std::stringstream ss;
  ss << std::ifstream(path).rdbuf();
  return ss.str();
}

// How the child's stdout is set up.
enum class Stdout {
  kFile,        // dir/stdout
  kClosed,      // `>&-`: descriptor 1 closed
  kClosedPipe,  // a pipe whose read end is already closed (`| head -c1`, deterministic)
};

struct RunResult {
  int exit_code = -1;  // -1: killed by a signal (`signal` says which)
  int signal = 0;
  std::string out, err;
};

// `strata <args>` through sh, at most `seconds` (timeout(1): exit 124), under
// an address-space limit of 4 GiB.
RunResult Strata(const std::string& args, const std::string& dir, Stdout mode = Stdout::kFile,
                 int seconds = 60) {
  const std::string out_path = dir + "/stdout", err_path = dir + "/stderr";
  std::filesystem::remove(out_path);
  int fds[2] = {-1, -1};
  if (mode == Stdout::kClosedPipe) {
    EXPECT_EQ(pipe(fds), 0);
    close(fds[0]);
  }
  const pid_t pid = fork();
  if (pid == 0) {
    if (mode == Stdout::kFile) {
      const int fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      close(fd);
    } else if (mode == Stdout::kClosed) {
      close(1);
    } else {
      dup2(fds[1], 1);
      close(fds[1]);
    }
    const std::string cmd = "ulimit -v 4194304; exec timeout -s KILL " + std::to_string(seconds) +
                            " " + STRATA_CLI_PATH + " " + args + " 2>" + err_path;
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  if (fds[1] >= 0) close(fds[1]);
  int status = 0;
  RunResult r;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
    // sh reports a child killed by signal N as 128 + N.
    if (r.exit_code > 128 && r.exit_code < 128 + 32 && r.exit_code != 129 && r.exit_code != 130 &&
        r.exit_code != 143) {
      r.signal = r.exit_code - 128;
      r.exit_code = -1;
    }
  } else if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  }
  r.out = ReadFile(out_path);
  r.err = ReadFile(err_path);
  return r;
}

// A small model on the host device, its states on NVMe under `dir`.
std::string WriteConfig(const std::string& dir, const std::string& name = "c.json",
                        long long hidden = 32) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << R"({"train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")"
                      << dir << R"(/nvme"},
      "offload_param": {"device": "nvme", "nvme_path": ")"
                      << dir << R"(/nvme"}},
    "strata": {"device": "host", "hbm_budget": "4M", "threads": 2,
      "model": {"layers": 2, "hidden": )"
                      << hidden << R"(, "seq_len": 16}}})";
  return path;
}

class CliRobustness : public ::testing::Test {
 protected:
  std::string Dir() const { return dir_.str(); }
  testing::ScratchDir dir_;
};

// --params far beyond what can be laid out: refused from its sizes with the
// bytes, exit 4 (resource), quickly and without allocating in proportion.
TEST_F(CliRobustness, PlanOfAbsurdParamsIsRefusedWithTheBytes) {
  const std::string cfg = WriteConfig(Dir());
  for (const char* params : {"1e13", "1e15", "1e18"}) {
    SCOPED_TRACE(params);
    const RunResult r =
        Strata("plan --config " + cfg + " --no-nvme-bench --params " + std::string(params), Dir());
    EXPECT_EQ(r.signal, 0) << r.err;
    EXPECT_EQ(r.exit_code, 4) << r.err;
    EXPECT_THAT(r.err, HasSubstr("--params"));
    EXPECT_THAT(r.err, HasSubstr("bytes"));
    EXPECT_THAT(r.err, Not(HasSubstr("bad_alloc")));
  }
}

// strata.model.hidden 1000000: 8e12 elements per block. `plan` and `train`
// refuse it from arithmetic (exit 4, the bytes needed and what every tier
// has) instead of dying of std::bad_alloc.
TEST_F(CliRobustness, ModelThatCannotFitIsRefusedWithTheBytes) {
  const std::string cfg = WriteConfig(Dir(), "huge.json", 1000000);
  for (const std::string& cmd :
       std::vector<std::string>{"plan --no-nvme-bench", "train --steps 1"}) {
    SCOPED_TRACE(cmd);
    const RunResult r = Strata(cmd + " --config " + cfg, Dir());
    EXPECT_EQ(r.signal, 0) << r.err;
    EXPECT_EQ(r.exit_code, 4) << r.err;
    EXPECT_THAT(r.err, HasSubstr("the model's parameters alone need"));
    EXPECT_THAT(r.err, HasSubstr("every tier together has"));
  }
}

// A closed stdout, as a pipe whose reader has gone or as a closed
// descriptor: every subcommand exits 5 (I/O) and says so on stderr, instead
// of dying of SIGPIPE or exiting 0 with its output lost.
TEST_F(CliRobustness, ClosedStdoutIsExit5) {
  const std::string cfg = WriteConfig(Dir());
  for (const Stdout mode : {Stdout::kClosedPipe, Stdout::kClosed}) {
    for (const std::string& args :
         {std::string("info --path ") + Dir(), std::string("info --json"),
          "plan --no-nvme-bench --config " + cfg, std::string("--help"), std::string("--version"),
          std::string("bench accumulate --params 1M --threads 1 --reps 1")}) {
      SCOPED_TRACE(args + (mode == Stdout::kClosed ? " >&-" : " | (closed)"));
      const RunResult r = Strata(args, Dir(), mode);
      EXPECT_EQ(r.signal, 0) << r.err;
      EXPECT_EQ(r.exit_code, 5) << r.err;
      EXPECT_THAT(r.err, HasSubstr("stdout: write failed"));
    }
  }
}

// NaN and the infinities are refused for floating-point options, naming the
// option (exit 2), as a negative value is.
TEST_F(CliRobustness, NonFiniteNumbersAreRefused) {
  for (const std::string& args : std::vector<std::string>{
           "report --time-limit nan", "report --time-limit inf", "report --time-limit -inf",
           "report --time-limit 1e999", "bench comm --timeout nan", "bench pcie --link-gbps inf",
           "bench pcie --link-latency-us nan"}) {
    SCOPED_TRACE(args);
    const std::string option = args.substr(args.find("--"), args.rfind(' ') - args.find("--"));
    const RunResult r = Strata(args + " --out " + Dir() + "/report", Dir(), Stdout::kFile, 30);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr(option));
    EXPECT_THAT(r.err, HasSubstr("not a finite number"));
  }
}

// A FIFO (no writer) where the config is read: refused at once, naming it.
TEST_F(CliRobustness, FifoConfigIsRefused) {
  const std::string fifo = Dir() + "/fifo.json";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& cmd :
       std::vector<std::string>{"info", "plan --no-nvme-bench", "train --steps 1"}) {
    SCOPED_TRACE(cmd);
    const RunResult r = Strata(cmd + " --config " + fifo, Dir(), Stdout::kFile, 30);
    EXPECT_EQ(r.signal, 0) << "blocked? " << r.err;
    EXPECT_EQ(r.exit_code, 3) << r.err;
    EXPECT_THAT(r.err, HasSubstr(fifo + ": not a regular file (a FIFO)"));
  }
}

// A FIFO in place of a checkpoint's files: `checkpoint info` and `checkpoint
// export` refuse it (exit 5, the file named) instead of blocking.
TEST_F(CliRobustness, FifoInCheckpointIsRefused) {
  const std::string cfg = WriteConfig(Dir());
  const std::string ckpt = Dir() + "/ckpt";
  const RunResult trained =
      Strata("train --config " + cfg + " --steps 1 --checkpoint-dir " + ckpt, Dir());
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  const std::string step = ckpt + "/ckpt-00000001";
  ASSERT_TRUE(std::filesystem::exists(step + "/MANIFEST.json"));
  for (const std::string& file : std::vector<std::string>{"states.bin", "MANIFEST.json"}) {
    SCOPED_TRACE(file);
    const std::string path = step + "/" + file;
    const std::string kept = Dir() + "/kept";
    std::filesystem::rename(path, kept);
    ASSERT_EQ(mkfifo(path.c_str(), 0600), 0);
    for (const std::string& cmd :
         std::vector<std::string>{"checkpoint info " + step,
                                  "checkpoint export " + step + " --out " + Dir() + "/x.st"}) {
      SCOPED_TRACE(cmd);
      const RunResult r = Strata(cmd, Dir(), Stdout::kFile, 30);
      EXPECT_EQ(r.signal, 0) << "blocked? " << r.err;
      EXPECT_EQ(r.exit_code, 5) << r.err;
      // (The checkpoint readers' wording: src/common/private_fs.h.)
      EXPECT_THAT(r.out + r.err, HasSubstr("a FIFO, not a regular file"));
    }
    std::filesystem::remove(path);
    std::filesystem::rename(kept, path);
  }
}

}  // namespace
}  // namespace strata
