// PinnedPool: page-locked host buffers in fixed size classes (see device.h).
//
// The whole plan is checked against the budget before any memory is taken;
// each class is one 4096-aligned allocation (so the same memory suits
// O_DIRECT and io_uring fixed buffers), pinned through the Device
// (cudaHostRegister on CUDA, mlock on the host backend). If pinning is refused
// the pool keeps the memory pageable and says once how to raise the limit.
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>

#include "src/common/aligned_buffer.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/gpu/arena.h"
#include "src/gpu/device.h"

namespace strata::gpu {
namespace {
constexpr size_t kPage = 4096;

Status MlockDirect(void* p, size_t n) {
  if (mlock(p, n) != 0) return ErrnoError(fmt::format("mlock of {}", FormatBytes(n)), errno);
  return Status::Ok();
}
}  // namespace

// ---- PinnedBuffer ----

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    pool_ = std::exchange(o.pool_, nullptr);
    ptr_ = std::exchange(o.ptr_, nullptr);
    size_ = std::exchange(o.size_, 0);
    class_ = std::exchange(o.class_, -1);
  }
  return *this;
}

void PinnedBuffer::Reset() {
  if (ptr_ != nullptr) pool_->Return(class_, ptr_);
  pool_ = nullptr;
  ptr_ = nullptr;
  size_ = 0;
  class_ = -1;
}

// ---- PinnedPool ----

PinnedPoolOptions PlanPinnedPool(size_t budget_bytes, size_t buffer_bytes) {
  PinnedPoolOptions o;
  const size_t b = AlignUp(std::max<size_t>(buffer_bytes, 1), kPage);
  o.classes.push_back({b, std::max<size_t>(1, budget_bytes / b)});
  o.budget_bytes = budget_bytes;
  return o;
}

StatusOr<std::unique_ptr<PinnedPool>> PinnedPool::Create(const PinnedPoolOptions& options,
                                                         Device* device) {
  if (options.classes.empty()) return InvalidArgumentError("pinned pool: no size classes");
  // Plan the total first: nothing is allocated if it does not fit.
  size_t total = 0;
  for (size_t i = 0; i < options.classes.size(); ++i) {
    const PinnedSizeClass& c = options.classes[i];
    if (c.buffer_bytes == 0 || c.buffer_bytes % kPage != 0 || c.count == 0)
      return InvalidArgumentError(fmt::format(
          "pinned pool: size class {} ({} bytes × {}) must have a nonzero multiple of {} bytes "
          "and a nonzero count",
          i, c.buffer_bytes, c.count, kPage));
    if (c.buffer_bytes > (SIZE_MAX - total) / c.count)
      return InvalidArgumentError(fmt::format("pinned pool: size class {} overflows", i));
    total += c.buffer_bytes * c.count;
  }
  if (options.budget_bytes != 0 && total > options.budget_bytes)
    return ResourceExhaustedError(
        fmt::format("pinned pool: the plan needs {} but strata.pinned_budget is {}",
                    FormatBytes(total), FormatBytes(options.budget_bytes)));

  std::unique_ptr<PinnedPool> pool(new PinnedPool());
  pool->device_ = device;
  pool->total_bytes_ = total;
  // Allocate every region before pinning any, so a late allocation failure
  // leaves nothing pinned behind (the destructor frees what was taken).
  {
    MutexLock lock(&pool->mu_);  // uncontended: the pool is not shared yet
    for (const PinnedSizeClass& c : options.classes) {
      const size_t bytes = c.buffer_bytes * c.count;
      void* p = nullptr;
      if (posix_memalign(&p, kPage, bytes) != 0) {
        return ResourceExhaustedError(
            fmt::format("pinned pool: cannot allocate {} of host memory for {} buffers of {}",
                        FormatBytes(bytes), c.count, FormatBytes(c.buffer_bytes)));
      }
      pool->regions_.push_back({p, bytes});
      Class cls{c.buffer_bytes, {}, c.count};
      cls.free.reserve(c.count);
      // Hand out low addresses first (stack order: last pushed is taken first).
      for (size_t k = c.count; k-- > 0;)
        cls.free.push_back(static_cast<char*>(p) + k * c.buffer_bytes);
      pool->classes_.push_back(std::move(cls));
    }
  }
  Status pin_status;
  size_t pinned_regions = 0;
  for (const Region& r : pool->regions_) {
    pin_status = device ? device->PinHostMemory(r.data, r.bytes) : MlockDirect(r.data, r.bytes);
    if (!pin_status.ok()) break;
    ++pinned_regions;
  }
  if (pin_status.ok()) {
    pool->pinned_ = true;
    return pool;
  }
  // Undo the partial pinning, then fall back (or fail) as asked.
  for (size_t i = 0; i < pinned_regions; ++i) {
    const Region& r = pool->regions_[i];
    Status s = device ? device->UnpinHostMemory(r.data, r.bytes) : Status::Ok();
    if (!device) munlock(r.data, r.bytes);
    s.IgnoreError();
  }
  const MemlockLimit lim = ReadMemlockLimit();
  const std::string limit = lim.soft_unlimited ? "unlimited" : FormatBytes(lim.soft_bytes);
  const std::string msg = fmt::format(
      "pinned pool: cannot page-lock {} ({}); RLIMIT_MEMLOCK is {}. Raise it with `ulimit -l "
      "unlimited` (or `memlock` in /etc/security/limits.conf, `--ulimit memlock=-1` for docker), "
      "or lower strata.pinned_budget",
      FormatBytes(total), pin_status.ToString(), limit);
  if (!options.allow_pageable_fallback) return ResourceExhaustedError(msg);
  STRATA_WARN_ONCE("gpu.pinned_fallback", "{}; continuing with pageable memory (slower copies)",
                   msg);
  pool->pinned_ = false;
  return pool;
}

PinnedPool::~PinnedPool() {
  for (const Region& r : regions_) {
    if (pinned_) {
      if (device_) {
        device_->UnpinHostMemory(r.data, r.bytes).IgnoreError();
      } else {
        munlock(r.data, r.bytes);
      }
    }
    std::free(r.data);
  }
}

StatusOr<PinnedBuffer> PinnedPool::Acquire(size_t bytes) {
  MutexLock lock(&mu_);
  int best = -1;
  for (size_t i = 0; i < classes_.size(); ++i) {
    if (classes_[i].buffer_bytes < bytes) continue;
    if (best >= 0 && classes_[i].buffer_bytes >= classes_[best].buffer_bytes) continue;
    best = static_cast<int>(i);
  }
  if (best < 0) {
    ++exhausted_;
    size_t largest = 0;
    for (const Class& c : classes_) largest = std::max(largest, c.buffer_bytes);
    return InvalidArgumentError(
        fmt::format("pinned pool: {} asked, larger than the largest size class ({})",
                    FormatBytes(bytes), FormatBytes(largest)));
  }
  // The smallest class that fits; if it is empty take the next larger one
  // that has a free buffer.
  int cls = -1;
  for (size_t i = 0; i < classes_.size(); ++i) {
    const Class& c = classes_[i];
    if (c.buffer_bytes < bytes || c.free.empty()) continue;
    if (cls >= 0 && c.buffer_bytes >= classes_[cls].buffer_bytes) continue;
    cls = static_cast<int>(i);
  }
  if (cls < 0) {
    ++exhausted_;
    const Class& c = classes_[best];
    return ResourceExhaustedError(fmt::format(
        "pinned pool: no free buffer for {}: all {} buffers of {} (and of every larger class) are "
        "in use",
        FormatBytes(bytes), c.count, FormatBytes(c.buffer_bytes)));
  }
  Class& c = classes_[cls];
  PinnedBuffer b;
  b.pool_ = this;
  b.ptr_ = c.free.back();
  b.size_ = c.buffer_bytes;
  b.class_ = cls;
  c.free.pop_back();
  ++acquired_;
  return b;
}

void PinnedPool::Return(int cls, void* p) {
  MutexLock lock(&mu_);
  classes_[cls].free.push_back(p);  // capacity reserved at creation: no allocation
}

PinnedPool::Stats PinnedPool::GetStats() const {
  MutexLock lock(&mu_);
  Stats s;
  s.total_bytes = total_bytes_;
  s.pinned = pinned_;
  for (const Class& c : classes_) s.free_per_class.push_back(c.free.size());
  s.acquired = acquired_;
  s.exhausted = exhausted_;
  return s;
}

}  // namespace strata::gpu
