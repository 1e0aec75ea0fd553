// bench_pcie: the PCIe benchmark without the CLI (same code as
// `strata bench pcie`): H2D/D2H pinned and pageable, bidirectional, and the
// engine path (chunked through the pinned pool) vs raw copies.
//
//   build-gpu/bench/bench_pcie [host|cuda] [max_bytes]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "src/gpu/device.h"

int main(int argc, char** argv) {
  using namespace strata;
  const std::string kind = argc > 1 ? argv[1] : "cuda";
  const size_t max_bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : size_t{256} << 20;
  if ((kind != "host" && kind != "cuda") || max_bytes < (64 << 10)) {
    std::fprintf(stderr, "usage: bench_pcie [host|cuda] [max_bytes >= 65536]\n");
    return 2;
  }
  gpu::DeviceOptions o;
  o.kind = kind == "host" ? DeviceKind::kHost : DeviceKind::kCuda;
  o.hbm_budget_bytes = (2 * (max_bytes / (2 << 20) + 1) + 2) * (2 << 20);
  auto device = gpu::CreateDevice(o);
  if (!device.ok()) {
    std::printf("bench_pcie: %s\n", device.status().ToString().c_str());
    // No GPU here: nothing to measure. A GPU that is present but unusable
    // (FailedPrecondition, e.g. a driver older than the runtime) is a failure.
    const StatusCode code = device.status().code();
    return kind == "cuda" && (code == StatusCode::kUnavailable || code == StatusCode::kNotSupported)
               ? 0
               : 1;
  }
  gpu::PcieBenchOptions bo;
  for (size_t s = 64 << 10; s <= max_bytes; s *= 4) bo.sizes.push_back(s);
  auto r = gpu::RunPcieBench(**device, bo);
  if (!r.ok()) {
    std::fprintf(stderr, "bench_pcie: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::printf("device %s, host memory %s\n", r->device.c_str(),
              r->host_pinned ? "pinned" : "pageable");
  std::printf("%12s %9s %9s %9s %9s %9s %9s %9s (GB/s, medians of %d)\n", "bytes", "h2d-pin",
              "d2h-pin", "h2d-page", "d2h-page", "bidir", "h2d-eng", "d2h-eng", bo.repetitions);
  for (const auto& p : r->points)
    std::printf("%12zu %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n", p.bytes, p.h2d_pinned,
                p.d2h_pinned, p.h2d_pageable, p.d2h_pageable, p.bidir, p.h2d_engine, p.d2h_engine);
  std::printf("engine/raw: h2d %.3f d2h %.3f; bidir/one-direction %.2f\n", r->engine_vs_raw_h2d,
              r->engine_vs_raw_d2h,
              r->bidir_peak / std::max(r->h2d_pinned_peak, r->d2h_pinned_peak));
  return 0;
}
