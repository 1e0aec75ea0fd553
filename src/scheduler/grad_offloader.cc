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
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/scheduler/plan.h"

namespace strata::scheduler {
namespace {

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

Status GradOffloader::Start(bool second_accumulator, int64_t* pinned_bytes, bool host_accumulator,
                            int64_t landing_bytes, bool pin_landing, bool pin_accumulator) {
  const int64_t bytes = host_accumulator ? kGradAccBytesPerElem * layout_->total_elems() : 0;
  const bool pin_acc = pin_accumulator && host_accumulator && !second_accumulator && bytes > 0;
  RETURN_IF_ERROR(acc_.Allocate(bytes, pin_acc ? dev_ : nullptr, "gradient accumulator"));
  std::memset(acc_.data(), 0, static_cast<size_t>(bytes));
  if (pin_acc && acc_.pinned()) {
    direct_ = true;
    *pinned_bytes += IoBytes(bytes);
    ASSIGN_OR_RETURN(direct_event_, dev_->CreateEvent());
    for (size_t g = 0; g < layout_->num_groups(); ++g)
      for (int64_t b = layout_->group(g).elem_begin, e = layout_->group(g).elem_end; b < e;
           b += kNormBlock)
        blocks_.emplace_back(b, std::min(e, b + kNormBlock));
    pre_partial_.assign(blocks_.size(), 0.0);
    pre_bad_.assign(blocks_.size(), 0);
    pre_done_.assign(blocks_.size(), 0);
    copied_.assign(static_cast<size_t>(layout_->num_modules()), 0);
  } else if (pin_acc) {
    STRATA_LOG_INFO(
        "the gradient accumulator could not be page-locked: the window's sums go through the "
        "staging buffers");
  }
  if (second_accumulator) {
    RETURN_IF_ERROR(alt_.Allocate(bytes, nullptr, "second gradient accumulator"));
    std::memset(alt_.data(), 0, static_cast<size_t>(bytes));
  }
  if (landing_bytes > 0) {
    RETURN_IF_ERROR(
        landing_.Allocate(landing_bytes, pin_landing ? dev_ : nullptr, "gradient landing buffer"));
    if (landing_.pinned()) *pinned_bytes += IoBytes(landing_bytes);
    ASSIGN_OR_RETURN(landed_event_, dev_->CreateEvent());
  }
  landed_.assign(static_cast<size_t>(layout_->num_modules()), 0);
  accumulated_.assign(static_cast<size_t>(layout_->num_modules()), 0);
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

Status GradOffloader::AccumulateNvme(const Job& job) {
  // The chunk's elements as runs within one sub-group each; per sub-group
  // the adds (accumulator offsets from the sub-group's first element) and
  // one Update.
  struct Run {  // elements of one sub-group, contiguous in the staging buffer
    int64_t elem_begin, elem_end;
    const uint8_t* grad;
    DType dtype;
  };
  std::vector<Run> runs;
  auto add_run = [&](int64_t b, int64_t e, const uint8_t* grad, DType dtype) {
    const int64_t size = static_cast<int64_t>(DTypeSize(dtype));
    while (b < e) {
      const SubGroup& sg = layout_->group(layout_->GroupOf(b));
      const int64_t end = std::min(e, sg.elem_end);
      runs.push_back({b, end, grad, dtype});
      grad += (end - b) * size;
      b = end;
    }
  };
  const auto* staged = static_cast<const uint8_t*>(job.staging.data());
  if (job.fp32) {
    add_run(job.elem_begin, job.elem_end, staged, DType::kFp32);
  } else {
    for (const Layout::Slice& sl : layout_->ByteSlices(job.module, job.byte_begin, job.byte_end))
      add_run(sl.elem_begin, sl.elem_end, staged + (sl.byte_offset - job.byte_begin),
              layout_->param(sl.param).dtype);
  }
  // Where backward is: the module's extent and how far its adds have reached.
  const ModuleExtent& me = layout_->module(job.module);
  GradStore::Progress progress;
  progress.module_begin = me.elem_begin;
  progress.module_end = me.elem_end;
  for (size_t i = 0; i < runs.size();) {
    const size_t g = layout_->GroupOf(runs[i].elem_begin);
    const int64_t base = layout_->group(g).elem_begin;
    size_t j = i;
    while (j < runs.size() && layout_->GroupOf(runs[j].elem_begin) == g) ++j;
    progress.chunk_end = runs[j - 1].elem_end;  // what the adds reach after this Update
    RETURN_IF_ERROR(nvme_->Update(
        g,
        [&](float* sums) {
          std::vector<cpu_adam::AccumulateShard> shards;
          for (size_t k = i; k < j; ++k) {
            cpu_adam::AccumulateShard sh;
            sh.acc = sums + (runs[k].elem_begin - base);
            sh.grad = runs[k].grad;
            sh.grad_dtype = runs[k].dtype;
            sh.count = static_cast<size_t>(runs[k].elem_end - runs[k].elem_begin);
            shards.push_back(sh);
          }
          return adam_->AccumulateMany(shards);
        },
        &progress));
    i = j;
  }
  return Status();
}

Status GradOffloader::Accumulate(const Job& job) {
  if (nvme_) return AccumulateNvme(job);
  if (job.fp32) {
    cpu_adam::AccumulateShard sh;
    sh.acc = acc_.as<float>() + job.elem_begin;
    sh.grad = job.staging.data();
    sh.grad_dtype = DType::kFp32;
    sh.count = static_cast<size_t>(job.elem_end - job.elem_begin);
    return adam_->AccumulateMany({&sh, 1});
  }
  return AccumulateBytes(job.module, static_cast<const uint8_t*>(job.staging.data()),
                         job.byte_begin, job.byte_end);
}

Status GradOffloader::AccumulateBytes(int m, const uint8_t* base, int64_t byte_begin,
                                      int64_t byte_end) {
  float* acc = acc_.as<float>();
  std::vector<cpu_adam::AccumulateShard> shards;
  for (const Layout::Slice& sl : layout_->ByteSlices(m, byte_begin, byte_end)) {
    cpu_adam::AccumulateShard sh;
    sh.acc = acc + sl.elem_begin;
    sh.grad = base + (sl.byte_offset - byte_begin);
    sh.grad_dtype = layout_->param(sl.param).dtype;
    sh.count = static_cast<size_t>(sl.elem_end - sl.elem_begin);
    shards.push_back(sh);
  }
  return adam_->AccumulateMany(shards);
}

Status GradOffloader::Offload(int m, const void* device_grad, gpu::Event& computed) {
  const ModuleExtent& me = layout_->module(m);
  const int64_t chunk = layout_->grad_staging_bytes();
  accumulated_[static_cast<size_t>(m)] = 1;
  // The gradients are complete once the framework's work on the compute
  // stream is; the D2H stream waits for that, then copies them out in chunks.
  RETURN_IF_ERROR(dev_->d2h().Wait(computed));
  for (int64_t b = me.byte_begin; b < me.byte_end; b += chunk) {
    const int64_t e = std::min(me.byte_end, b + chunk);
    Job job;
    job.module = m;
    job.byte_begin = b;
    job.byte_end = e;
    RETURN_IF_ERROR(Enqueue(std::move(job),
                            static_cast<const uint8_t*>(device_grad) + (b - me.byte_begin), e - b));
  }
  return Status();
}

Status GradOffloader::OffloadFp32(int m, const float* device_sum, gpu::Event& computed) {
  const ModuleExtent& me = layout_->module(m);
  const int64_t chunk = std::max<int64_t>(1, layout_->grad_staging_bytes() / 4);
  const bool first = accumulated_[static_cast<size_t>(m)] == 0;
  accumulated_[static_cast<size_t>(m)] = 1;
  RETURN_IF_ERROR(dev_->d2h().Wait(computed));
  if (direct_ && first && me.elems() > 0) {
    // Straight into the accumulator: the module's elements take the sums'
    // bits (what adding them to zeros gives).
    float* dst = acc_.as<float>() + me.elem_begin;
    const int64_t bytes = 4 * me.elems();
    RETURN_IF_ERROR(counters_->TimedCopy(
        dev_->d2h(), Link::kD2H, fmt::format("grads module {} (into the accumulator)", m), bytes,
        [&] { return dev_->CopyD2H(dst, device_sum, static_cast<size_t>(bytes), dev_->d2h()); }));
    RETURN_IF_ERROR(dev_->d2h().Record(*direct_event_));
    direct_in_flight_ = true;
    if (!precompute_) return Status();
    // The worker computes the blocks this copy completes once it landed.
    Job job;
    job.module = m;
    job.copied_in = true;
    ASSIGN_OR_RETURN(job.done, dev_->CreateEvent());
    RETURN_IF_ERROR(dev_->d2h().Record(*job.done));
    Push(std::move(job));
    return Status();
  }
  for (int64_t b = me.elem_begin; b < me.elem_end; b += chunk) {
    const int64_t e = std::min(me.elem_end, b + chunk);
    Job job;
    job.module = m;
    job.fp32 = true;
    job.elem_begin = b;
    job.elem_end = e;
    RETURN_IF_ERROR(Enqueue(std::move(job), device_sum + (b - me.elem_begin), 4 * (e - b)));
  }
  return Status();
}

Status GradOffloader::Enqueue(Job job, const void* src, int64_t bytes) {
  StatusOr<gpu::PinnedBuffer> staging = pool_->Acquire(static_cast<size_t>(bytes));
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
    staging = pool_->Acquire(static_cast<size_t>(bytes));
    if (none_pending) break;
  }
  if (!staging.ok()) return staging.status().WithContext("staging gradients");
  job.staging = std::move(*staging);
  ASSIGN_OR_RETURN(job.done, dev_->CreateEvent());
  void* dst = job.staging.data();
  RETURN_IF_ERROR(counters_->TimedCopy(
      dev_->d2h(), Link::kD2H, fmt::format("grads module {}", job.module), bytes,
      [&] { return dev_->CopyD2H(dst, src, static_cast<size_t>(bytes), dev_->d2h()); }));
  RETURN_IF_ERROR(dev_->d2h().Record(*job.done));
  Push(std::move(job));
  return Status();
}

void GradOffloader::Push(Job job) {
  {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(job));
    ++pending_;
  }
  ++queued_;
  cv_.NotifyAll();
}

Status GradOffloader::Land(int m, const void* device_grad, gpu::Event& computed) {
  if (landing_.data() == nullptr || landing_.bytes() == 0)
    return FailedPreconditionError("GradOffloader::Land without a landing buffer");
  const ModuleExtent& me = layout_->module(m);
  uint8_t* dst = landing_.as<uint8_t>() + me.byte_begin;
  if (landed_[static_cast<size_t>(m)] != 0) {
    // Landed before in this window: those gradients go into the accumulator
    // first (after every chunk queued before them), as the plain path would
    // have added them, then the new ones land in their place.
    if (landing_in_flight_)
      RETURN_IF_ERROR(landed_event_->Synchronize().WithContext("gradient copy"));
    landing_in_flight_ = false;
    WaitIdle();
    const int64_t t0 = NowNanos();
    RETURN_IF_ERROR(AccumulateBytes(m, dst, me.byte_begin, me.byte_end)
                        .WithContext(fmt::format("accumulating module {}", m)));
    counters_->AddGradBusy(NowNanos() - t0);
    accumulated_[static_cast<size_t>(m)] = 1;
  }
  RETURN_IF_ERROR(dev_->d2h().Wait(computed));
  RETURN_IF_ERROR(counters_->TimedCopy(
      dev_->d2h(), Link::kD2H, fmt::format("grads module {} (landing)", m), me.bytes(), [&] {
        return dev_->CopyD2H(dst, device_grad, static_cast<size_t>(me.bytes()), dev_->d2h());
      }));
  RETURN_IF_ERROR(dev_->d2h().Record(*landed_event_));
  landing_in_flight_ = true;
  landed_[static_cast<size_t>(m)] = 1;
  return Status();
}

std::vector<uint8_t> GradOffloader::FoldModes() const {
  std::vector<uint8_t> modes(landed_.size(), kAccOnly);
  bool any = false;
  for (size_t m = 0; m < landed_.size(); ++m) {
    if (landed_[m] == 0) continue;
    modes[m] = accumulated_[m] != 0 ? kFoldAcc : kFoldZero;
    any = true;
  }
  if (!any) modes.clear();
  return modes;
}

void GradOffloader::ForgetWindow() {
  std::fill(landed_.begin(), landed_.end(), 0);
  std::fill(accumulated_.begin(), accumulated_.end(), 0);
  std::fill(pre_done_.begin(), pre_done_.end(), 0);
  std::fill(copied_.begin(), copied_.end(), 0);
}

void GradOffloader::WaitIdle() {
  MutexLock lock(&mu_);
  while (pending_ != 0) cv_.Wait(&mu_);
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
    if (job.copied_in) {
      if (s.ok()) ChecksAfterCopy(job.module);
      const int64_t t1 = NowNanos();
      counters_->timeline().Add("grad accumulate",
                                fmt::format("checks after module {}", job.module), "cpu", t0,
                                t1 - t0, 0);
    } else {
      if (s.ok())
        s = Accumulate(job).WithContext(fmt::format("accumulating module {}", job.module));
      if (precompute_) DropChecksOf(job.module);
      const int64_t t1 = NowNanos();
      counters_->AddGradBusy(t1 - t0);
      counters_->timeline().Add("grad accumulate", fmt::format("module {}", job.module), "cpu", t0,
                                t1 - t0, job.byte_end - job.byte_begin);
    }
    job.staging.Reset();
    {
      MutexLock lock(&mu_);
      if (!s.ok() && error_.ok()) error_ = s;
      --pending_;
      ++chunks_done_;
    }
    cv_.NotifyAll();
  }
}

bool GradOffloader::Accumulated(int64_t ticket) {
  MutexLock lock(&mu_);
  return chunks_done_ >= ticket;
}

Status GradOffloader::WaitAccumulated(int64_t ticket) {
  MutexLock lock(&mu_);
  while (chunks_done_ < ticket) cv_.Wait(&mu_);
  return error_;
}

Status GradOffloader::Drain() {
  Status landed;
  if (landing_in_flight_) {
    landed = landed_event_->Synchronize().WithContext("gradient copy (landing)");
    landing_in_flight_ = false;
  }
  if (direct_in_flight_) {
    Status d = direct_event_->Synchronize().WithContext("gradient copy (into the accumulator)");
    if (landed.ok()) landed = d;
    direct_in_flight_ = false;
  }
  MutexLock lock(&mu_);
  while (pending_ != 0) cv_.Wait(&mu_);
  Status s = error_.ok() ? landed : error_;
  error_ = Status();
  return s;
}

std::pair<size_t, size_t> GradOffloader::BlocksOf(int m) const {
  const ModuleExtent& me = layout_->module(m);
  // blocks_ is sorted and tiles the element space.
  auto first = std::upper_bound(blocks_.begin(), blocks_.end(), me.elem_begin,
                                [](int64_t e, const auto& b) { return e < b.second; });
  auto last = std::lower_bound(first, blocks_.end(), me.elem_end,
                               [](const auto& b, int64_t e) { return b.first < e; });
  return {static_cast<size_t>(first - blocks_.begin()),
          static_cast<size_t>(last - blocks_.begin())};
}

void GradOffloader::ChecksAfterCopy(int m) {
  copied_[static_cast<size_t>(m)] = 1;
  const auto [b0, b1] = BlocksOf(m);
  if (b0 >= b1) return;
  // A block is complete when every module overlapping it has been copied
  // in: the modules before m reach into its first block, those after into
  // its last one.
  auto complete = [&](size_t blk) {
    const auto [lo, hi] = blocks_[blk];
    for (int k = 0; k < layout_->num_modules(); ++k) {
      const ModuleExtent& mk = layout_->module(k);
      if (mk.elem_begin < hi && mk.elem_end > lo && mk.elems() > 0 &&
          copied_[static_cast<size_t>(k)] == 0)
        return false;
    }
    return true;
  };
  std::vector<size_t> ready;
  for (size_t blk = b0; blk < b1; ++blk) {
    if (pre_done_[blk] != 0) continue;
    // Blocks inside the module need no search.
    if ((blk == b0 || blk + 1 == b1) && !complete(blk)) continue;
    ready.push_back(blk);
  }
  const float* acc = acc_.as<float>();
  tbb::parallel_for(tbb::blocked_range<size_t>(0, ready.size()), [&](const auto& r) {
    for (size_t i = r.begin(); i < r.end(); ++i) {
      const size_t blk = ready[i];
      const auto [lo, hi] = blocks_[blk];
      NormBlocks(acc + lo, hi - lo, &pre_partial_[blk], &pre_bad_[blk]);
      pre_done_[blk] = 1;
    }
  });
}

void GradOffloader::DropChecksOf(int m) {
  const auto [b0, b1] = BlocksOf(m);
  for (size_t blk = b0; blk < b1; ++blk) pre_done_[blk] = 0;
}

void GradOffloader::ZeroUnsent() {
  if (!direct_) return;
  // The step left the previous window's sums in place: the modules that got
  // none this window are zeroed.
  for (int m = 0; m < layout_->num_modules(); ++m) {
    const ModuleExtent& me = layout_->module(m);
    if (accumulated_[static_cast<size_t>(m)] == 0 && me.elems() > 0 &&
        me.elem_end > device_stepped_)
      std::memset(acc_.as<float>() + me.elem_begin, 0,
                  static_cast<size_t>(me.elems()) * kGradAccBytesPerElem);
  }
}

float* GradOffloader::SwapForStep() {
  acc_.swap(alt_);
  return alt_.as<float>();
}

void GradOffloader::Zero() {
  if (nvme_) nvme_->DropWindow();
  ZeroArray(acc_.as<float>(), acc_.bytes() / kGradAccBytesPerElem);
  ForgetWindow();
}

void GradOffloader::ZeroAll() {
  if (nvme_) nvme_->DropWindow();
  ForgetWindow();
  for (HostArray* a : {&acc_, &alt_})
    if (a->data() != nullptr) ZeroArray(a->as<float>(), a->bytes() / kGradAccBytesPerElem);
}

namespace {

// The window's gradient at element i, in fp32: acc[i], or with the fold the
// sum the accumulation would have written (acc[i] + g, or 0.f + g).
template <int kMode, int kDType>
inline float FoldedAt(const float* acc, const uint8_t* land, int64_t i, int64_t j) {
  if constexpr (kMode == kAccOnly) {
    return acc[i];
  } else {
    float g;
    if constexpr (kDType == static_cast<int>(DType::kFp32)) {
      std::memcpy(&g, land + 4 * j, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, land + 2 * j, 2);
      g = kDType == static_cast<int>(DType::kFp16) ? HalfBitsToFloat(h) : Bf16BitsToFloat(h);
    }
    return (kMode == kFoldAcc ? acc[i] : 0.f) + g;  // acc += g, not written
  }
}

// s + the sum of x^2 over elements [b, e) of one slice, x in double, added
// one element at a time in element order (the plain loop's sum, bit for
// bit): the squares of a chunk are computed first (a loop without a
// reduction, which the compiler vectorizes), then added in order.
template <int kMode, int kDType>
double SumSlice(const float* acc, const uint8_t* land, int64_t b, int64_t e, double s) {
  constexpr int64_t kChunk = 256;
  alignas(64) double sq[kChunk];
  for (int64_t c = b; c < e; c += kChunk) {
    const int64_t n = std::min(kChunk, e - c);
    for (int64_t k = 0; k < n; ++k) {
      const double x = FoldedAt<kMode, kDType>(acc, land, c + k, c - b + k);
      sq[k] = x * x;
    }
    for (int64_t k = 0; k < n; ++k) s += sq[k];
  }
  return s;
}

template <int kMode>
double SumSliceOf(DType d, const float* acc, const uint8_t* land, int64_t b, int64_t e, double s) {
  switch (d) {
    case DType::kFp32:
      return SumSlice<kMode, static_cast<int>(DType::kFp32)>(acc, land, b, e, s);
    case DType::kFp16:
      return SumSlice<kMode, static_cast<int>(DType::kFp16)>(acc, land, b, e, s);
    default:
      return SumSlice<kMode, static_cast<int>(DType::kBf16)>(acc, land, b, e, s);
  }
}

}  // namespace

Status GradOffloader::GlobalChecks(bool* overflow, double* sumsq) const {
  if (nvme_) return nvme_->GlobalChecks(overflow, sumsq);
  std::vector<double> partial;
  std::vector<uint8_t> bad;
  RETURN_IF_ERROR(BlockChecks(0, layout_->num_groups(), &partial, &bad));
  CombineBlocks(partial, bad, overflow, sumsq);
  return Status();
}

Status GradOffloader::BlockChecks(size_t first_group, size_t end_group,
                                  std::vector<double>* partial_out,
                                  std::vector<uint8_t>* bad_out) const {
  if (nvme_)
    return FailedPreconditionError("GradOffloader::BlockChecks: the gradients are on NVMe");
  const float* acc = static_cast<const float*>(acc_.data());
  // The blocks of every sub-group (grad_store.h, kNormBlock), in order.
  std::vector<std::pair<int64_t, int64_t>> blocks;
  end_group = std::min(end_group, layout_->num_groups());
  for (size_t g = first_group; g < end_group; ++g)
    for (int64_t b = layout_->group(g).elem_begin, sge = layout_->group(g).elem_end; b < sge;
         b += kNormBlock)
      blocks.emplace_back(b, std::min(sge, b + kNormBlock));
  const auto nblocks = static_cast<int64_t>(blocks.size());
  const std::vector<uint8_t> modes = FoldModes();
  const uint8_t* land = landing();
  std::vector<double> partial(blocks.size(), 0.0);
  std::vector<uint8_t> bad(blocks.size(), 0);
  // Checks ahead: the blocks the worker computed (the same blocks, from the
  // first sub-group).
  const bool ahead =
      precompute_ && first_group == 0 && modes.empty() && pre_done_.size() >= blocks.size();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, nblocks), [&](const auto& r) {
    for (int64_t blk = r.begin(); blk < r.end(); ++blk) {
      const auto [b, e] = blocks[static_cast<size_t>(blk)];
      double s = 0;
      if (ahead && pre_done_[static_cast<size_t>(blk)] != 0) {
        partial[static_cast<size_t>(blk)] = pre_partial_[static_cast<size_t>(blk)];
        bad[static_cast<size_t>(blk)] = pre_bad_[static_cast<size_t>(blk)];
        continue;
      }
      if (modes.empty()) {
        NormBlocks(acc + b, e - b, &partial[static_cast<size_t>(blk)],
                   &bad[static_cast<size_t>(blk)]);
        continue;
      }
      for (const Layout::Slice& sl : layout_->Slices(b, e)) {
        const ParamRec& p = layout_->param(sl.param);
        const uint8_t* g = land + sl.byte_offset;
        switch (modes[static_cast<size_t>(p.module)]) {
          case kFoldAcc:
            s = SumSliceOf<kFoldAcc>(p.dtype, acc, g, sl.elem_begin, sl.elem_end, s);
            break;
          case kFoldZero:
            s = SumSliceOf<kFoldZero>(p.dtype, acc, g, sl.elem_begin, sl.elem_end, s);
            break;
          default:
            s = SumSlice<kAccOnly, 0>(acc, nullptr, sl.elem_begin, sl.elem_end, s);
        }
      }
      // An inf/nan element makes the block's sum inf/nan, and finite ones
      // cannot: a float squared is below 1.2e77 in double, 2^16 of them
      // below 1e82 (kNormBlock elements).
      static_assert(kNormBlock <= (1 << 20));
      partial[static_cast<size_t>(blk)] = s;
      bad[static_cast<size_t>(blk)] = !std::isfinite(s);
    }
  });
  *partial_out = std::move(partial);
  *bad_out = std::move(bad);
  return Status();
}

}  // namespace strata::scheduler
