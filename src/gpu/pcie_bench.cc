// The PCIe benchmark behind `strata bench pcie` and bench/bench_pcie.cc:
// raw copies (one cudaMemcpyAsync per transfer) from pinned and pageable host
// memory, both directions at once, and the engine path — the same transfer
// split into pinned-pool buffers as the scheduler issues it. Every variant is
// measured once per repetition, interleaved, and the medians are reported.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/gpu/device.h"

namespace strata::gpu {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

}  // namespace

std::vector<size_t> DefaultPcieSizes() {
  std::vector<size_t> s;
  for (size_t b = size_t{64} << 10; b <= (size_t{1} << 30); b *= 4) s.push_back(b);
  return s;
}

StatusOr<PcieBenchReport> RunPcieBench(Device& device, const PcieBenchOptions& options) {
  std::vector<size_t> sizes = options.sizes.empty() ? DefaultPcieSizes() : options.sizes;
  if (options.repetitions < 1) return InvalidArgumentError("pcie bench: repetitions must be ≥ 1");
  if (options.chunk_bytes == 0 || options.pool_chunks == 0)
    return InvalidArgumentError("pcie bench: chunk size and count must be nonzero");
  for (size_t s : sizes)
    if (s == 0) return InvalidArgumentError("pcie bench: a transfer size of 0 bytes");
  const size_t max_size = *std::max_element(sizes.begin(), sizes.end());

  // Device side: a destination for H2D and a source for D2H (bidirectional
  // needs both at once).
  ASSIGN_OR_RETURN(DeviceBuffer dev_a, device.Allocate(max_size));
  ASSIGN_OR_RETURN(DeviceBuffer dev_b, device.Allocate(max_size));
  // Host side: two big pinned buffers (raw path) and the engine's pool.
  PinnedPoolOptions big;
  big.classes.push_back({AlignUp(max_size, 4096), 2});
  ASSIGN_OR_RETURN(auto big_pool, PinnedPool::Create(big, &device));
  ASSIGN_OR_RETURN(PinnedBuffer pin_src, big_pool->Acquire(max_size));
  ASSIGN_OR_RETURN(PinnedBuffer pin_dst, big_pool->Acquire(max_size));
  PinnedPoolOptions chunks;
  chunks.classes.push_back({AlignUp(options.chunk_bytes, 4096), options.pool_chunks});
  ASSIGN_OR_RETURN(auto chunk_pool, PinnedPool::Create(chunks, &device));
  std::vector<PinnedBuffer> chunk_bufs;
  for (size_t i = 0; i < options.pool_chunks; ++i) {
    ASSIGN_OR_RETURN(PinnedBuffer b, chunk_pool->Acquire(options.chunk_bytes));
    chunk_bufs.push_back(std::move(b));
  }
  ASSIGN_OR_RETURN(AlignedBuffer page_src, AlignedBuffer::Allocate(max_size, 4096));
  ASSIGN_OR_RETURN(AlignedBuffer page_dst, AlignedBuffer::Allocate(max_size, 4096));
  // Touch everything once so page faults are not measured.
  std::memset(pin_src.data(), 1, max_size);
  std::memset(pin_dst.data(), 2, max_size);
  std::memset(page_src.data(), 3, max_size);
  std::memset(page_dst.data(), 4, max_size);
  for (auto& b : chunk_bufs) std::memset(b.data(), 5, b.size());
  // And the device buffers: on the host backend an untouched arena page is
  // the shared zero page, which would make D2H reads look free.
  RETURN_IF_ERROR(device.Fill(dev_a.data(), DType::kFp32, max_size / 4, 1.f, device.compute()));
  RETURN_IF_ERROR(device.Fill(dev_b.data(), DType::kFp32, max_size / 4, 2.f, device.compute()));
  RETURN_IF_ERROR(device.compute().Synchronize());

  Stream& h2d = device.h2d();
  Stream& d2h = device.d2h();
  char* da = dev_a.as<char>();
  char* db = dev_b.as<char>();
  const size_t chunk = options.chunk_bytes;

  PcieBenchReport report;
  report.device = device.Describe();
  report.host_pinned = big_pool->pinned() && chunk_pool->pinned();

  for (size_t size : sizes) {
    const size_t iters = std::max<size_t>(1, (options.min_bytes_per_sample + size - 1) / size);
    // Each variant enqueues `iters` transfers of `size` and waits.
    using Op = std::function<Status()>;
    auto h2d_raw = [&](const void* src) -> Op {
      return [&, src] {
        for (size_t i = 0; i < iters; ++i) RETURN_IF_ERROR(device.CopyH2D(da, src, size, h2d));
        return h2d.Synchronize();
      };
    };
    auto d2h_raw = [&](void* dst) -> Op {
      return [&, dst] {
        for (size_t i = 0; i < iters; ++i) RETURN_IF_ERROR(device.CopyD2H(dst, db, size, d2h));
        return d2h.Synchronize();
      };
    };
    Op bidir = [&] {
      for (size_t i = 0; i < iters; ++i) {
        RETURN_IF_ERROR(device.CopyH2D(da, pin_src.data(), size, h2d));
        RETURN_IF_ERROR(device.CopyD2H(pin_dst.data(), db, size, d2h));
      }
      RETURN_IF_ERROR(h2d.Synchronize());
      return d2h.Synchronize();
    };
    // The scheduler's path: the transfer lives in pool-sized pinned buffers.
    Op h2d_engine = [&] {
      for (size_t i = 0; i < iters; ++i) {
        size_t k = 0;
        for (size_t off = 0; off < size; off += chunk, ++k)
          RETURN_IF_ERROR(device.CopyH2D(da + off, chunk_bufs[k % chunk_bufs.size()].data(),
                                         std::min(chunk, size - off), h2d));
      }
      return h2d.Synchronize();
    };
    Op d2h_engine = [&] {
      for (size_t i = 0; i < iters; ++i) {
        size_t k = 0;
        for (size_t off = 0; off < size; off += chunk, ++k)
          RETURN_IF_ERROR(device.CopyD2H(chunk_bufs[k % chunk_bufs.size()].data(), db + off,
                                         std::min(chunk, size - off), d2h));
      }
      return d2h.Synchronize();
    };
    struct Variant {
      Op op;
      double bytes_per_call;
      std::vector<double> gbps;
    };
    std::vector<Variant> v = {
        {h2d_raw(pin_src.data()), double(size) * iters, {}},
        {d2h_raw(pin_dst.data()), double(size) * iters, {}},
        {h2d_raw(page_src.data()), double(size) * iters, {}},
        {d2h_raw(page_dst.data()), double(size) * iters, {}},
        {bidir, 2.0 * size * iters, {}},
        {h2d_engine, double(size) * iters, {}},
        {d2h_engine, double(size) * iters, {}},
    };
    for (auto& x : v) RETURN_IF_ERROR(x.op());  // warm-up
    for (int r = 0; r < options.repetitions; ++r) {
      for (auto& x : v) {
        Stopwatch sw;
        RETURN_IF_ERROR(x.op());
        x.gbps.push_back(x.bytes_per_call / static_cast<double>(std::max<int64_t>(sw.Nanos(), 1)));
      }
    }
    PciePoint p;
    p.bytes = size;
    p.h2d_pinned = Median(v[0].gbps);
    p.d2h_pinned = Median(v[1].gbps);
    p.h2d_pageable = Median(v[2].gbps);
    p.d2h_pageable = Median(v[3].gbps);
    p.bidir = Median(v[4].gbps);
    p.h2d_engine = Median(v[5].gbps);
    p.d2h_engine = Median(v[6].gbps);
    report.points.push_back(p);
  }

  const size_t kLarge = size_t{64} << 20;
  const size_t ratio_floor = max_size >= kLarge ? kLarge : max_size;
  report.engine_vs_raw_h2d = report.engine_vs_raw_d2h = 1e30;
  for (const PciePoint& p : report.points) {
    report.h2d_pinned_peak = std::max(report.h2d_pinned_peak, p.h2d_pinned);
    report.d2h_pinned_peak = std::max(report.d2h_pinned_peak, p.d2h_pinned);
    report.bidir_peak = std::max(report.bidir_peak, p.bidir);
    report.h2d_pageable_peak = std::max(report.h2d_pageable_peak, p.h2d_pageable);
    if (p.bytes >= ratio_floor) {
      report.engine_vs_raw_h2d = std::min(report.engine_vs_raw_h2d, p.h2d_engine / p.h2d_pinned);
      report.engine_vs_raw_d2h = std::min(report.engine_vs_raw_d2h, p.d2h_engine / p.d2h_pinned);
    }
  }
  report.engine_path_vs_raw = std::min(report.engine_vs_raw_h2d, report.engine_vs_raw_d2h);
  return report;
}

}  // namespace strata::gpu
