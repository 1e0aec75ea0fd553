#include "src/scheduler/host_array.h"

#include <algorithm>
#include <utility>

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/units.h"
#include "src/scheduler/layout.h"

namespace strata::scheduler {
namespace {
std::atomic<int64_t> g_pinned_bytes{0};
std::atomic<int64_t> g_pageable_bytes{0};
}  // namespace

HostArray::Live HostArray::LiveBytes() {
  return Live{g_pinned_bytes.load(std::memory_order_relaxed),
              g_pageable_bytes.load(std::memory_order_relaxed)};
}

void HostArray::Release() {
  if (pinned_by_ != nullptr)
    pinned_by_->UnpinHostMemory(buf_.data(), static_cast<size_t>(IoBytes(bytes_))).IgnoreError();
  (pinned_by_ != nullptr ? g_pinned_bytes : g_pageable_bytes)
      .fetch_sub(bytes_, std::memory_order_relaxed);
  pinned_by_ = nullptr;
  bytes_ = 0;
  buf_ = AlignedBuffer();
}

Status HostArray::Allocate(int64_t bytes, gpu::Device* pin_with, const std::string& what) {
  Release();
  ASSIGN_OR_RETURN(
      buf_, AlignedBuffer::Allocate(static_cast<size_t>(std::max<int64_t>(bytes, 64)), kIoAlign));
  bytes_ = bytes;
  if (pin_with != nullptr && bytes > 0) {
    Status s = pin_with->PinHostMemory(buf_.data(), static_cast<size_t>(IoBytes(bytes)));
    if (s.ok()) {
      pinned_by_ = pin_with;
    } else {
      STRATA_WARN_ONCE("scheduler.pin." + what,
                       "pin_memory: could not page-lock {} for {} ({}); using pageable memory "
                       "(raise the limit with `ulimit -l unlimited` or LimitMEMLOCK=infinity)",
                       FormatBytes(bytes), what, s.ToString());
    }
  }
  (pinned_by_ != nullptr ? g_pinned_bytes : g_pageable_bytes)
      .fetch_add(bytes_, std::memory_order_relaxed);
  return Status();
}

HostArray::~HostArray() { Release(); }

void HostArray::swap(HostArray& o) {
  std::swap(buf_, o.buf_);
  std::swap(bytes_, o.bytes_);
  std::swap(pinned_by_, o.pinned_by_);
}

}  // namespace strata::scheduler
