// src/scheduler/host_array.h — a flat host array (4 KiB-aligned, sized for
// O_DIRECT I/O) that may be page-locked through the device.
//
// Threading: not synchronized; its owner's.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "src/common/aligned_buffer.h"
#include "src/gpu/device.h"
#include "strata/status.h"

namespace strata::scheduler {

// A flat host array that may be page-locked through the device (a failure to
// pin is logged once and leaves it pageable).
class HostArray {
 public:
  HostArray() = default;
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;
  ~HostArray();
  Status Allocate(int64_t bytes, gpu::Device* pin_with, const std::string& what);
  void* data() { return buf_.data(); }
  const void* data() const { return buf_.data(); }
  template <typename T>
  T* as() {
    return buf_.as<T>();
  }
  int64_t bytes() const { return bytes_; }
  bool pinned() const { return pinned_by_ != nullptr; }
  void swap(HostArray& o);

  // The bytes every HostArray of the process holds now, page-locked and
  // pageable (what the tier plan's pinned and dram rows account for).
  struct Live {
    int64_t pinned = 0;
    int64_t pageable = 0;
  };
  static Live LiveBytes();

 private:
  void Release();
  AlignedBuffer buf_;
  int64_t bytes_ = 0;
  gpu::Device* pinned_by_ = nullptr;
};

}  // namespace strata::scheduler
