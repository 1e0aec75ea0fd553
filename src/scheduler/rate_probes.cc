#include "src/scheduler/rate_probes.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "src/common/aligned_buffer.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/scheduler/state_homes.h"

namespace strata::scheduler {

StatusOr<LinkRates> MeasureLinkRates(gpu::Device* device, int64_t bytes) {
  gpu::PinnedPoolOptions popts;
  popts.classes.push_back({static_cast<size_t>(bytes), 1});
  popts.allow_pageable_fallback = true;
  ASSIGN_OR_RETURN(std::unique_ptr<gpu::PinnedPool> pool, gpu::PinnedPool::Create(popts, device));
  ASSIGN_OR_RETURN(gpu::PinnedBuffer host, pool->Acquire(static_cast<size_t>(bytes)));
  std::memset(host.data(), 1, static_cast<size_t>(bytes));
  ASSIGN_OR_RETURN(gpu::DeviceBuffer dev, device->Allocate(static_cast<size_t>(bytes)));
  LinkRates r;
  for (int rep = 0; rep < 3; ++rep) {
    for (bool h2d : {true, false}) {
      gpu::Stream& s = h2d ? device->h2d() : device->d2h();
      const int64_t t0 = NowNanos();
      RETURN_IF_ERROR(
          h2d ? device->CopyH2D(dev.data(), host.data(), static_cast<size_t>(bytes), s)
              : device->CopyD2H(host.data(), dev.data(), static_cast<size_t>(bytes), s));
      RETURN_IF_ERROR(s.Synchronize());
      const double secs = std::max<double>(static_cast<double>(NowNanos() - t0) * 1e-9, 1e-9);
      double& best = h2d ? r.h2d_gbytes_per_s : r.d2h_gbytes_per_s;
      best = std::max(best, static_cast<double>(bytes) / secs * 1e-9);
    }
    // Plain malloc'd memory, allocated for each copy as a framework's would be
    // (a Status, not an exception, when the address space is exhausted).
    StatusOr<AlignedBuffer> pageable = AlignedBuffer::Allocate(static_cast<size_t>(bytes));
    if (!pageable.ok())
      return pageable.status().WithContext("Plan: measuring the pageable device-to-host rate");
    std::memset(pageable->data(), 1, static_cast<size_t>(bytes));
    const int64_t t0 = NowNanos();
    RETURN_IF_ERROR(
        device->CopyD2H(pageable->data(), dev.data(), static_cast<size_t>(bytes), device->d2h()));
    RETURN_IF_ERROR(device->d2h().Synchronize());
    const double secs = std::max<double>(static_cast<double>(NowNanos() - t0) * 1e-9, 1e-9);
    r.d2h_pageable_gbytes_per_s =
        std::max(r.d2h_pageable_gbytes_per_s, static_cast<double>(bytes) / secs * 1e-9);
    if (!device->is_host()) {
      const size_t half = static_cast<size_t>(bytes) / 2;
      const int64_t c0 = NowNanos();
      RETURN_IF_ERROR(
          device->CopyD2D(dev.as<uint8_t>() + half, dev.data(), half, device->compute()));
      RETURN_IF_ERROR(device->compute().Synchronize());
      const double csecs = std::max<double>(static_cast<double>(NowNanos() - c0) * 1e-9, 1e-9);
      r.d2d_gbytes_per_s =
          std::max(r.d2d_gbytes_per_s, 2.0 * static_cast<double>(half) / csecs * 1e-9);
    }
  }
  return r;
}

StatusOr<double> MeasureAccumulateRate(cpu_adam::CpuOptimizer* adam, int64_t elems) {
  StatusOr<AlignedBuffer> acc_buf = AlignedBuffer::Allocate(static_cast<size_t>(elems) * 4);
  StatusOr<AlignedBuffer> grad_buf = AlignedBuffer::Allocate(static_cast<size_t>(elems) * 2);
  for (const auto* b : {&acc_buf, &grad_buf})
    if (!b->ok()) return b->status().WithContext("Plan: measuring the accumulation rate");
  float* acc = acc_buf->as<float>();
  uint16_t* grad = grad_buf->as<uint16_t>();
  std::fill(acc, acc + elems, 0.f);
  std::fill(grad, grad + elems, uint16_t{0x3f80});  // bf16 1.0
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const int64_t t0 = NowNanos();
    RETURN_IF_ERROR(adam->Accumulate(acc, grad, DType::kBf16, static_cast<size_t>(elems)));
    const double secs = std::max<double>(static_cast<double>(NowNanos() - t0) * 1e-9, 1e-9);
    best = std::max(best, static_cast<double>(cpu_adam::AccumulateBytesPerElement(DType::kBf16)) *
                              static_cast<double>(elems) / secs * 1e-9);
  }
  return best;
}

StatusOr<double> MeasureAdamRate(cpu_adam::CpuOptimizer* adam, int64_t elems,
                                 cpu_adam::StateFormat states) {
  const auto n = static_cast<size_t>(elems);
  const size_t blocks = (n + cpu_adam::kStateBlock - 1) / cpu_adam::kStateBlock;
  StatusOr<AlignedBuffer> buf = AlignedBuffer::Allocate(n * 4 * 4 + n * 2 + blocks * 2 * 4);
  if (!buf.ok()) return buf.status().WithContext("measuring the CPU optimizer's rate");
  float* f = buf->as<float>();
  std::fill(f, f + 4 * n, 0.25f);
  cpu_adam::ShardStep st;
  st.count = n;
  st.grad = f + n;
  // The states at f (master), f + 2n and f + 3n (the moments) in their
  // format; zero moments, a master of 0.25.
  if (states != cpu_adam::StateFormat::kFp32) std::fill(f + 2 * n, f + 4 * n, 0.f);
  StateArrays view{.format = states, .master = f, .exp_avg = f + 2 * n, .exp_avg_sq = f + 3 * n};
  if (states == cpu_adam::StateFormat::kBf16Master)
    std::fill(reinterpret_cast<uint16_t*>(f), reinterpret_cast<uint16_t*>(f) + n,
              uint16_t{0x3e80});  // bf16 0.25
  if (states == cpu_adam::StateFormat::kInt8) {
    view.exp_avg_scale = f + 4 * n + (n + 1) / 2;
    view.exp_avg_sq_scale = view.exp_avg_scale + blocks;
    std::fill(view.exp_avg_scale, view.exp_avg_scale + 2 * blocks, 0.f);
  }
  view.Point(0, &st);
  st.copy_out = f + 4 * n;
  st.copy_dtype = DType::kBf16;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    st.hp.step = rep + 1;
    const int64_t t0 = NowNanos();
    RETURN_IF_ERROR(adam->Step(st).status());
    const double secs = std::max<double>(static_cast<double>(NowNanos() - t0) * 1e-9, 1e-9);
    best = std::max(best, static_cast<double>(elems) / secs);
  }
  return best;
}

StatusOr<PlanRates> MeasurePlanRates(gpu::Device* device, cpu_adam::CpuOptimizer* adam,
                                     int64_t elems, bool cpu, cpu_adam::StateFormat states) {
  PlanRates r;
  const int64_t probe =
      device == nullptr
          ? 0
          : std::min<int64_t>(
                int64_t{16} << 20,
                static_cast<int64_t>(device->Stats().largest_free_bytes) / 2 / 4096 * 4096);
  if (probe >= (int64_t{64} << 10)) {
    ASSIGN_OR_RETURN(r.link, MeasureLinkRates(device, probe));
  }
  if (cpu) {
    const int64_t n = std::clamp<int64_t>(elems, int64_t{1} << 18, int64_t{1} << 23);
    ASSIGN_OR_RETURN(r.accumulate_gbps, MeasureAccumulateRate(adam, n));
    ASSIGN_OR_RETURN(r.adam_elems_per_s, MeasureAdamRate(adam, n, states));
  }
  return r;
}

StatusOr<nvme::NvmeBenchResult> MeasureDiskRates(const Config& config, const std::string& path,
                                                 uint64_t bytes) {
  nvme::NvmeBenchOptions nb;
  nb.paths = {path};
  nb.io = nvme::IoOptionsFromConfig(config);
  const uint64_t unit = std::max<uint64_t>(nb.io.block_size, uint64_t{1} << 20);
  nb.size = std::clamp<uint64_t>(bytes / unit * unit, unit, uint64_t{256} << 20);
  nb.request_bytes = std::min<uint64_t>(nb.size, uint64_t{64} << 20);
  return nvme::RunEngineBench(nb);
}

}  // namespace strata::scheduler
