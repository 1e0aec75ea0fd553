// Heap buffers with a chosen alignment (O_DIRECT needs the device's logical
// block size, SIMD kernels like 64 bytes). Move-only RAII; the memory is not
// initialized. Not thread-safe; the bytes are the caller's to synchronize.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "strata/status.h"

namespace strata {

constexpr size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }
constexpr size_t AlignDown(size_t n, size_t a) { return n / a * a; }
inline bool IsAligned(const void* p, size_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // REQUIRES: alignment is a power of two ≥ sizeof(void*). Size is rounded up
  // to a multiple of the alignment; size() reports the requested size.
  static StatusOr<AlignedBuffer> Allocate(size_t size, size_t alignment = 64);

  AlignedBuffer(AlignedBuffer&& o) noexcept { *this = std::move(o); }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  void* data() { return data_; }
  const void* data() const { return data_; }
  template <typename T>
  T* as() {
    return static_cast<T*>(data_);
  }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data_);
  }
  size_t size() const { return size_; }
  size_t alignment() const { return alignment_; }
  std::span<std::byte> bytes() { return {static_cast<std::byte*>(data_), size_}; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t alignment_ = 0;
};

}  // namespace strata
