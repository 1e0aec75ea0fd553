// Arena: a best-fit sub-allocator over one contiguous address range with a
// hard byte budget (the range's size). Both backends use it: CudaDevice over
// one cudaMalloc'd block, HostDevice over an mmap reservation. It never
// touches the memory itself, so it is tested on the CPU alone.
//
// Blocks are aligned to kAlign (offsets are multiples of it) and sizes are
// rounded up to it. Free neighbours are coalesced on Free. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

#include "src/common/thread_annotations.h"
#include "src/gpu/device.h"

namespace strata::gpu {

class Arena {
 public:
  static constexpr size_t kAlign = kDeviceAlignment;  // cudaMalloc's alignment

  // `base` is the start of the range (aligned to kAlign), `bytes` its size
  // (the budget). `release` runs on destruction to free the range (may be
  // empty). `label` prefixes error messages ("HBM arena").
  Arena(void* base, size_t bytes, std::string label, std::function<void()> release = {});
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // ResourceExhausted (with bytes asked, in use, budget, largest free block)
  // or InvalidArgument for 0 bytes.
  StatusOr<void*> Allocate(size_t bytes) EXCLUDES(mu_);
  // REQUIRES: p came from Allocate and was not freed. Returns Internal for
  // an unknown pointer (never corrupts the free lists).
  Status Free(void* p) EXCLUDES(mu_);
  ArenaStats Stats() const EXCLUDES(mu_);
  void ResetHighWater() EXCLUDES(mu_);
  bool Contains(const void* p, size_t bytes) const;
  void* base() const { return base_; }
  size_t budget() const { return bytes_; }

 private:
  void InsertFree(size_t off, size_t len) REQUIRES(mu_);
  void EraseFree(std::map<size_t, size_t>::iterator it) REQUIRES(mu_);

  char* const base_;
  const size_t bytes_;
  const std::string label_;
  std::function<void()> release_;

  mutable Mutex mu_;
  std::map<size_t, size_t> free_by_off_ GUARDED_BY(mu_);             // offset → length
  std::set<std::pair<size_t, size_t>> free_by_len_ GUARDED_BY(mu_);  // (length, offset)
  std::unordered_map<size_t, size_t> used_ GUARDED_BY(mu_);          // offset → length
  size_t in_use_ GUARDED_BY(mu_) = 0;
  size_t high_water_ GUARDED_BY(mu_) = 0;
  uint64_t total_ GUARDED_BY(mu_) = 0;
  uint64_t failed_ GUARDED_BY(mu_) = 0;
};

// "1.50 GiB (1610612736 bytes)"
std::string FormatBytes(size_t bytes);

}  // namespace strata::gpu
