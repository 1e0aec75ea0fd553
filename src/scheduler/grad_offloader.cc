#include "src/scheduler/grad_offloader.h"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <system_error>
#include <vector>

#include "src/common/half.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"

namespace strata::scheduler {
namespace {

constexpr int64_t kNormBlock = 1 << 16;  // elements per partial sum (fixed: deterministic)

void ZeroArray(float* a, int64_t n) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kNormBlock), [&](const auto& r) {
    std::memset(a + r.begin(), 0, static_cast<size_t>(r.end() - r.begin()) * sizeof(float));
  });
}

}  // namespace

GradOffloader::GradOffloader(gpu::Device* device, const Layout* layout,
                             cpu_adam::CpuOptimizer* adam, StepCounters* counters)
    : dev_(device), layout_(layout), adam_(adam), counters_(counters) {}

GradOffloader::~GradOffloader() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  if (worker_.joinable()) worker_.join();
}

Status GradOffloader::Start(bool second_accumulator, int64_t* pinned_bytes, bool host_accumulator) {
  const int64_t bytes = host_accumulator ? kGradAccBytesPerElem * layout_->total_elems() : 0;
  RETURN_IF_ERROR(acc_.Allocate(bytes, nullptr, "gradient accumulator"));
  std::memset(acc_.data(), 0, static_cast<size_t>(bytes));
  if (second_accumulator) {
    RETURN_IF_ERROR(alt_.Allocate(bytes, nullptr, "second gradient accumulator"));
    std::memset(alt_.data(), 0, static_cast<size_t>(bytes));
  }
  gpu::PinnedPoolOptions popts;
  popts.classes.push_back(
      {static_cast<size_t>(IoBytes(std::max<int64_t>(layout_->grad_staging_bytes(), kIoAlign))),
       static_cast<size_t>(kGradStagingBuffers)});
  popts.allow_pageable_fallback = true;
  ASSIGN_OR_RETURN(pool_, gpu::PinnedPool::Create(popts, dev_));
  *pinned_bytes += static_cast<int64_t>(pool_->total_bytes());
  try {
    worker_ = std::thread([this] { Worker(); });
  } catch (const std::system_error& e) {
    return ResourceExhaustedError(
        fmt::format("starting the gradient worker thread: {} (RLIMIT_NPROC?)", e.what()));
  }
  return Status();
}

Status GradOffloader::Accumulate(const Job& job) {
  const auto* base = static_cast<const uint8_t*>(job.staging.data());
  float* acc = acc_.as<float>();
  std::vector<cpu_adam::AccumulateShard> shards;
  for (const Layout::Slice& sl : layout_->ByteSlices(job.module, job.byte_begin, job.byte_end)) {
    cpu_adam::AccumulateShard sh;
    sh.acc = acc + sl.elem_begin;
    sh.grad = base + (sl.byte_offset - job.byte_begin);
    sh.grad_dtype = layout_->param(sl.param).dtype;
    sh.count = static_cast<size_t>(sl.elem_end - sl.elem_begin);
    shards.push_back(sh);
  }
  return adam_->AccumulateMany(shards);
}

Status GradOffloader::Offload(int m, const void* device_grad, gpu::Event& computed) {
  const ModuleExtent& me = layout_->module(m);
  const int64_t chunk = layout_->grad_staging_bytes();
  // The gradients are complete once the framework's work on the compute
  // stream is; the D2H stream waits for that, then copies them out in chunks.
  RETURN_IF_ERROR(dev_->d2h().Wait(computed));
  for (int64_t b = me.byte_begin; b < me.byte_end; b += chunk) {
    const int64_t e = std::min(me.byte_end, b + chunk);
    StatusOr<gpu::PinnedBuffer> staging = pool_->Acquire(static_cast<size_t>(e - b));
    while (!staging.ok() && staging.status().code() == StatusCode::kResourceExhausted) {
      // Every buffer is held by a chunk not yet accumulated: wait for the
      // worker to finish one, then try again. With no chunk pending, the
      // buffers were all returned since the failed Acquire: one more try.
      bool none_pending = false;
      {
        MutexLock lock(&mu_);
        none_pending = pending_ == 0;
        const int64_t before = pending_;
        if (!none_pending)
          while (pending_ >= before) cv_.Wait(&mu_);  // the worker goes on after an error
      }
      staging = pool_->Acquire(static_cast<size_t>(e - b));
      if (none_pending) break;
    }
    if (!staging.ok()) return staging.status().WithContext("staging gradients");
    Job job;
    job.module = m;
    job.byte_begin = b;
    job.byte_end = e;
    job.staging = std::move(*staging);
    ASSIGN_OR_RETURN(job.done, dev_->CreateEvent());
    void* dst = job.staging.data();
    const void* src = static_cast<const uint8_t*>(device_grad) + (b - me.byte_begin);
    RETURN_IF_ERROR(counters_->TimedCopy(
        dev_->d2h(), Link::kD2H, fmt::format("grads module {}", m), e - b,
        [&] { return dev_->CopyD2H(dst, src, static_cast<size_t>(e - b), dev_->d2h()); }));
    RETURN_IF_ERROR(dev_->d2h().Record(*job.done));
    {
      MutexLock lock(&mu_);
      queue_.push_back(std::move(job));
      ++pending_;
    }
    cv_.NotifyAll();
  }
  return Status();
}

void GradOffloader::Worker() {
  for (;;) {
    Job job;
    {
      MutexLock lock(&mu_);
      while (!stop_ && queue_.empty()) cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping and drained
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    Status s = job.done->Synchronize().WithContext("gradient copy");
    const int64_t t0 = NowNanos();
    if (s.ok()) s = Accumulate(job).WithContext(fmt::format("accumulating module {}", job.module));
    const int64_t t1 = NowNanos();
    counters_->AddGradBusy(t1 - t0);
    counters_->timeline().Add("grad accumulate", fmt::format("module {}", job.module), "cpu", t0,
                              t1 - t0, job.byte_end - job.byte_begin);
    job.staging.Reset();
    {
      MutexLock lock(&mu_);
      if (!s.ok() && error_.ok()) error_ = s;
      --pending_;
    }
    cv_.NotifyAll();
  }
}

Status GradOffloader::Drain() {
  MutexLock lock(&mu_);
  while (pending_ != 0) cv_.Wait(&mu_);
  Status s = error_;
  error_ = Status();
  return s;
}

float* GradOffloader::SwapForStep() {
  acc_.swap(alt_);
  return alt_.as<float>();
}

void GradOffloader::Zero() { ZeroArray(acc_.as<float>(), acc_.bytes() / kGradAccBytesPerElem); }

void GradOffloader::ZeroAll() {
  for (HostArray* a : {&acc_, &alt_})
    if (a->data() != nullptr) ZeroArray(a->as<float>(), a->bytes() / kGradAccBytesPerElem);
}

void GradOffloader::GlobalChecks(bool* overflow, double* sumsq) const {
  const float* acc = static_cast<const float*>(acc_.data());
  const int64_t total = acc_.bytes() / kGradAccBytesPerElem;
  const int64_t blocks = (total + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  std::vector<uint8_t> bad(static_cast<size_t>(blocks), 0);
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks), [&](const auto& r) {
    for (int64_t blk = r.begin(); blk < r.end(); ++blk) {
      const int64_t b = blk * kNormBlock, e = std::min(total, b + kNormBlock);
      double s = 0;
      bool nonfinite = false;
      for (int64_t i = b; i < e; ++i) {
        const double x = acc[i];
        nonfinite |= !std::isfinite(acc[i]);
        s += x * x;
      }
      partial[static_cast<size_t>(blk)] = s;
      bad[static_cast<size_t>(blk)] = nonfinite;
    }
  });
  double sum = 0;
  bool any_bad = false;
  for (int64_t blk = 0; blk < blocks; ++blk) {  // fixed order: deterministic
    sum += partial[static_cast<size_t>(blk)];
    any_bad |= bad[static_cast<size_t>(blk)] != 0;
  }
  *overflow = any_bad;
  *sumsq = sum;
}

}  // namespace strata::scheduler
