#include "src/nvme/extent_allocator.h"

#include <algorithm>

#include <fmt/format.h>

#include "src/common/aligned_buffer.h"

namespace strata::nvme {

ExtentAllocator::ExtentAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(AlignDown(capacity, alignment)), align_(alignment), free_bytes_(capacity_) {
  if (capacity_ > 0) free_[0] = capacity_;
}

uint64_t ExtentAllocator::largest_free() const {
  uint64_t m = 0;
  for (auto& [off, len] : free_) m = std::max(m, len);
  return m;
}

StatusOr<uint64_t> ExtentAllocator::Allocate(uint64_t bytes) {
  if (bytes == 0) return InvalidArgumentError("extent of 0 bytes");
  uint64_t need = AlignUp(bytes, align_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    uint64_t off = it->first;
    uint64_t rest = it->second - need;
    free_.erase(it);
    if (rest > 0) free_[off + need] = rest;
    used_[off] = need;
    free_bytes_ -= need;
    return off;
  }
  return ResourceExhaustedError(fmt::format(
      "extent of {} bytes does not fit: {} of {} bytes free, largest free extent {} bytes", need,
      free_bytes_, capacity_, largest_free()));
}

Status ExtentAllocator::Free(uint64_t offset, uint64_t bytes) {
  auto u = used_.find(offset);
  if (u == used_.end() || u->second != AlignUp(bytes, align_))
    return InvalidArgumentError(
        fmt::format("free of extent at {} ({} bytes) that is not allocated", offset, bytes));
  uint64_t len = u->second;
  used_.erase(u);
  free_bytes_ += len;
  auto next = free_.lower_bound(offset);
  // Coalesce with the following extent.
  if (next != free_.end() && offset + len == next->first) {
    len += next->second;
    next = free_.erase(next);
  }
  // Coalesce with the preceding extent.
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += len;
      return Status::Ok();
    }
  }
  free_[offset] = len;
  return Status::Ok();
}

}  // namespace strata::nvme
