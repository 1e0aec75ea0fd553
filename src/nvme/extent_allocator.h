// ExtentAllocator: first-fit allocation of aligned extents in [0, capacity),
// with neighbours coalesced on Free. Used by SwapStore, one per swap file.
// Not thread-safe (SwapStore locks around it).
#pragma once

#include <cstdint>
#include <map>

#include "strata/status.h"

namespace strata::nvme {

class ExtentAllocator {
 public:
  // REQUIRES: alignment > 0; capacity is rounded down to it.
  ExtentAllocator(uint64_t capacity, uint64_t alignment);

  // Offset of a fresh extent of AlignUp(bytes) bytes; ResourceExhausted naming
  // the bytes asked, free and the largest free extent when none fits.
  StatusOr<uint64_t> Allocate(uint64_t bytes);
  // REQUIRES: (offset, bytes) came from Allocate(bytes). Errors on a double or
  // unknown free (InvalidArgument) instead of corrupting the free list.
  Status Free(uint64_t offset, uint64_t bytes);

  uint64_t capacity() const { return capacity_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free() const;
  size_t free_extents() const { return free_.size(); }

 private:
  uint64_t capacity_;
  uint64_t align_;
  uint64_t free_bytes_;
  std::map<uint64_t, uint64_t> free_;  // offset → length, disjoint, non-adjacent
  std::map<uint64_t, uint64_t> used_;  // offset → length
};

}  // namespace strata::nvme
