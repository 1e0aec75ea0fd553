// strata tune nvme: sweep block size × queue depth × threads through the swap
// store and print the best `aio` section (what DeepSpeed's ds_nvme_tune does).
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "apps/strata/bench_stats.h"
#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "src/nvme/nvme_bench.h"

namespace strata::cli {
namespace {

using nlohmann::json;

struct TuneNvmeArgs {
  std::vector<std::string> paths;
  std::string size = "256M";
  std::vector<std::string> block_sizes = {"128K", "256K", "512K", "1M", "2M", "4M"};
  std::vector<int> queue_depths = {4, 8, 16, 32};
  std::vector<int> threads = {1, 2};
  std::string engine = "uring";
  int confirm_top = 4;
  int confirm_runs = 2;
  bool json = false;
};

// A message about the command line: the usage error's exit code.
int Fail(const std::string& msg) {
  std::fprintf(stderr, "strata tune nvme: %s\n", msg.c_str());
  return kExitUsage;
}

int RunTuneNvme(const TuneNvmeArgs& a) {
  nvme::NvmeBenchOptions base;
  base.paths = a.paths;
  if (!ParseByteSize(a.size, &base.size) || base.size == 0)
    return Fail("--size: \"" + a.size + "\" is not a size");
  auto kind = nvme::ParseEngineKind(a.engine);
  if (!kind.ok()) return Fail(std::string(kind.status().message()));
  base.io.engine = *kind;
  std::vector<uint64_t> bss;
  for (const auto& s : a.block_sizes) {
    uint64_t v = 0;
    if (!ParseByteSize(s, &v)) return Fail("--block-sizes: \"" + s + "\" is not a size");
    bss.push_back(v);
  }
  for (uint64_t bs : bss)
    for (int qd : a.queue_depths)
      for (int t : a.threads) {
        nvme::IoOptions io = base.io;
        io.block_size = bs;
        io.queue_depth = qd;
        io.threads = t;
        // The flags' own names (nvme::ValidateIoOptions names the config keys).
        if (bs == 0 || bs % 4096 != 0 || bs > (uint64_t{1} << 30))
          return Fail("--block-sizes: " + std::to_string(bs) + " " + kBlockSizeRule);
        if (qd < 1 || qd > 4096)
          return Fail("--queue-depths: " + std::to_string(qd) + " is not between 1 and 4096");
        if (t < 1 || t > 64)
          return Fail("--threads: " + std::to_string(t) + " is not between 1 and 64");
        if (Status s = nvme::ValidateIoOptions(io); !s.ok()) return Fail(std::string(s.message()));
      }
  auto points = nvme::RunTune(
      base, bss, a.queue_depths, a.threads,
      [](size_t i, size_t n, const nvme::TunePoint& p) {
        std::fprintf(stderr,
                     "[%zu/%zu] block %llu depth %d threads %d: write %.3f read %.3f GB/s\n", i, n,
                     static_cast<unsigned long long>(p.block_size), p.queue_depth, p.threads,
                     p.result.write_gbytes_per_s, p.result.read_gbytes_per_s);
      },
      a.confirm_top, a.confirm_runs);
  if (!points.ok()) {
    std::fprintf(stderr, "strata tune nvme: %s\n", points.status().ToString().c_str());
    return ExitCodeOf(points.status());
  }
  const auto& best = points->front();
  json aio = {{"block_size", best.block_size},
              {"queue_depth", best.queue_depth},
              {"intra_op_parallelism", best.threads},
              {"single_submit", false},
              {"overlap_events", true},
              {"use_gds", false}};
  if (a.json) {
    json all = json::array();
    for (const auto& p : *points)
      all.push_back({{"block_size", p.block_size},
                     {"queue_depth", p.queue_depth},
                     {"threads", p.threads},
                     {"write_gbytes_per_s", p.result.write_gbytes_per_s},
                     {"read_gbytes_per_s", p.result.read_gbytes_per_s}});
    json out = {{"aio", aio},
                {"engine", best.result.engine},
                {"best_write_gbytes_per_s", best.result.write_gbytes_per_s},
                {"best_read_gbytes_per_s", best.result.read_gbytes_per_s},
                {"results", all}};
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::printf(
      "best (median over %d run(s) of the geometric mean of read and write): write %.3f GB/s, read "
      "%.3f GB/s\n",
      a.confirm_runs + 1, best.result.write_gbytes_per_s, best.result.read_gbytes_per_s);
  std::printf("paste into your config:\n%s\n", json{{"aio", aio}}.dump(2).c_str());
  return 0;
}

CommandRegistrar reg("tune", [](CLI::App& tune, CliResult& r) {
  auto* cmd = tune.add_subcommand(
      "nvme", "Sweep block size × queue depth × threads; print the best aio section");
  auto a = std::make_shared<TuneNvmeArgs>();
  cmd->add_option("--path", a->paths, "Directory for the swap file; repeat to stripe over several")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--size", a->size, "Bytes written then read per setting (default 256M)");
  cmd->add_option("--block-sizes", a->block_sizes,
                  "Block sizes to try (default 128K 256K 512K 1M 2M 4M)");
  cmd->add_option("--queue-depths", a->queue_depths, "Queue depths to try (default 4 8 16 32)");
  cmd->add_option("--threads", a->threads, "Ring counts to try (default 1 2)");
  cmd->add_option("--engine", a->engine, "uring|posix|auto (default uring)")
      ->check(CLI::IsMember({"uring", "io_uring", "posix", "auto"}));
  cmd->add_option("--confirm-top", a->confirm_top, "Re-measure this many leaders (default 4)");
  cmd->add_option("--confirm-runs", a->confirm_runs,
                  "Extra runs per leader; medians decide (default 2)");
  cmd->add_flag("--json", a->json, "Machine-readable output (every point)");
  cmd->callback([&r, a] { r.exit_code = RunTuneNvme(*a); });
});

}  // namespace
}  // namespace strata::cli
