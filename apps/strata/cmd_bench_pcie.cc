// strata bench pcie: host↔device bandwidth — pinned vs pageable, both
// directions at once, and the engine's path (chunked through the pinned pool)
// beside one raw cudaMemcpyAsync per transfer. Without a GPU it says so and
// exits 0; --device host measures the host backend instead (labelled so).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "apps/strata/bench_stats.h"
#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "src/common/log.h"
#include "src/gpu/device.h"

namespace strata::cli {
namespace {

using nlohmann::json;

struct Args {
  std::string sizes = "64K..1G";
  std::string device = "auto";
  int reps = 5;
  std::string chunk = "4M";
  double link_gbps = 0, link_latency_us = 0;
  bool json = false;
};

int RunBenchPcie(const Args& a) {
  std::vector<size_t> sizes;
  std::string err;
  if (!ParseSizes(a.sizes, &sizes, &err, "64K..1G", "64K, 4M, 1G")) {
    std::fprintf(stderr, "strata bench pcie: %s\n", err.c_str());
    return kExitUsage;
  }
  uint64_t chunk = 0;
  if (!ParseByteSize(a.chunk, &chunk) || chunk == 0) {
    std::fprintf(stderr, "strata bench pcie: --chunk: \"%s\" is not a size\n", a.chunk.c_str());
    return kExitUsage;
  }
  if (a.reps < 1) {
    std::fprintf(stderr, "strata bench pcie: --reps must be at least 1\n");
    return kExitUsage;
  }
  size_t max_size = 0;
  for (size_t s : sizes) max_size = std::max(max_size, s);

  gpu::DeviceOptions o;
  o.kind = a.device == "host" ? DeviceKind::kHost : DeviceKind::kCuda;
  // Two device buffers of the largest size, rounded for the arena.
  o.hbm_budget_bytes = (2 * ((max_size + (2 << 20) - 1) / (2 << 20)) + 2) * (2 << 20);
  o.link_gbytes_per_s = a.link_gbps;
  o.link_latency_us = a.link_latency_us;
  auto device = gpu::CreateDevice(o);
  if (!device.ok()) {
    // Not an error: this machine has nothing to measure.
    if (a.device != "host" && ReportNoDevice("strata bench pcie", device.status(), a.json,
                                             "Use --device host to measure the host backend."))
      return 0;
    std::fprintf(stderr, "strata bench pcie: %s\n", device.status().ToString().c_str());
    return ExitCodeOf(device.status());
  }
  gpu::PcieBenchOptions bo;
  bo.sizes = sizes;
  bo.repetitions = a.reps;
  bo.chunk_bytes = chunk;
  auto report = gpu::RunPcieBench(**device, bo);
  if (!report.ok()) {
    std::fprintf(stderr, "strata bench pcie: %s\n", report.status().ToString().c_str());
    return ExitCodeOf(report.status());
  }
  const gpu::PcieBenchReport& r = *report;
  const std::string label = (*device)->is_host() ? "host backend (no GPU): " + r.device : r.device;
  const double one_dir = std::max(r.h2d_pinned_peak, r.d2h_pinned_peak);
  const double bidir_ratio = one_dir > 0 ? r.bidir_peak / one_dir : 0;
  if (a.json) {
    json pts = json::array();
    for (const auto& p : r.points)
      pts.push_back({{"bytes", p.bytes},
                     {"h2d_pinned_gbytes_per_s", p.h2d_pinned},
                     {"d2h_pinned_gbytes_per_s", p.d2h_pinned},
                     {"h2d_pageable_gbytes_per_s", p.h2d_pageable},
                     {"d2h_pageable_gbytes_per_s", p.d2h_pageable},
                     {"bidir_gbytes_per_s", p.bidir},
                     {"h2d_engine_gbytes_per_s", p.h2d_engine},
                     {"d2h_engine_gbytes_per_s", p.d2h_engine}});
    json j = {{"device", label},
              {"host_backend", (*device)->is_host()},
              {"host_memory_pinned", r.host_pinned},
              {"h2d_pinned_gbytes_per_s", r.h2d_pinned_peak},
              {"d2h_pinned_gbytes_per_s", r.d2h_pinned_peak},
              {"bidir_gbytes_per_s", r.bidir_peak},
              {"bidir_vs_one_direction", bidir_ratio},
              {"h2d_pageable_gbytes_per_s", r.h2d_pageable_peak},
              {"engine_path_vs_raw", r.engine_path_vs_raw},
              {"engine_path_vs_raw_h2d", r.engine_vs_raw_h2d},
              {"engine_path_vs_raw_d2h", r.engine_vs_raw_d2h},
              {"repetitions", a.reps},
              {"chunk_bytes", chunk},
              {"sizes", pts}};
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf("device: %s\nhost buffers: %s; %d repetitions, medians; engine path: %s chunks\n",
              label.c_str(), r.host_pinned ? "pinned" : "PAGEABLE (page-locking refused)", a.reps,
              SizeLabel(chunk).c_str());
  std::printf("%8s %10s %10s %10s %10s %10s %10s %10s   GB/s\n", "size", "h2d-pin", "d2h-pin",
              "h2d-page", "d2h-page", "bidir", "h2d-eng", "d2h-eng");
  for (const auto& p : r.points)
    std::printf("%8s %10.2f %10.2f %10.2f %10.2f %10.2f %10.2f %10.2f\n",
                SizeLabel(p.bytes).c_str(), p.h2d_pinned, p.d2h_pinned, p.h2d_pageable,
                p.d2h_pageable, p.bidir, p.h2d_engine, p.d2h_engine);
  std::printf(
      "peak: h2d pinned %.2f, d2h pinned %.2f, h2d pageable %.2f, bidir %.2f GB/s "
      "(%.2fx one direction; target >= 1.6)\n",
      r.h2d_pinned_peak, r.d2h_pinned_peak, r.h2d_pageable_peak, r.bidir_peak, bidir_ratio);
  std::printf("engine path vs raw (%s): h2d %.3f, d2h %.3f (target >= 0.9 at >= 64M)\n",
              max_size >= (size_t{64} << 20) ? "sizes >= 64M" : "largest size only",
              r.engine_vs_raw_h2d, r.engine_vs_raw_d2h);
  return 0;
}

CommandRegistrar reg("bench", [](CLI::App& bench, CliResult& result) {
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "pcie", "Host<->device bandwidth: pinned vs pageable, both directions, engine path vs raw");
  cmd->add_option("--sizes", args->sizes,
                  "Transfer sizes: a range 64K..1G (x4 steps) or a list 1M,64M")
      ->capture_default_str();
  cmd->add_option("--device", args->device,
                  "auto|cuda (measure the GPU) or host (the host backend)")
      ->check(CLI::IsMember({"auto", "cuda", "host"}))
      ->capture_default_str();
  cmd->add_option("--reps", args->reps, "Repetitions per point (interleaved; medians)")
      ->transform(CountSuffix())
      ->capture_default_str();
  cmd->add_option("--chunk", args->chunk, "Pinned-pool buffer size of the engine path")
      ->capture_default_str();
  cmd->add_option("--link-gbps", args->link_gbps,
                  "Host backend: modelled link bandwidth per direction (0 = memcpy speed)")
      ->check(FiniteNumber());
  cmd->add_option("--link-latency-us", args->link_latency_us,
                  "Host backend: modelled per-copy latency")
      ->check(FiniteNumber());
  cmd->add_flag("--json", args->json, "Machine-readable output");
  cmd->callback([args, &result] { result.exit_code = RunBenchPcie(*args); });
});

}  // namespace
}  // namespace strata::cli
