#include "src/common/aligned_buffer.h"

#include <cstdlib>
#include <string>
#include <utility>

namespace strata {

StatusOr<AlignedBuffer> AlignedBuffer::Allocate(size_t size, size_t alignment) {
  if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0)
    return InvalidArgumentError("AlignedBuffer: alignment " + std::to_string(alignment) +
                                " is not a power of two >= " + std::to_string(sizeof(void*)));
  AlignedBuffer b;
  const size_t bytes = AlignUp(size == 0 ? 1 : size, alignment);
  void* p = nullptr;
  if (int rc = posix_memalign(&p, alignment, bytes); rc != 0)
    return ResourceExhaustedError("AlignedBuffer: cannot allocate " + std::to_string(bytes) +
                                  " bytes aligned to " + std::to_string(alignment));
  b.data_ = p;
  b.size_ = size;
  b.alignment_ = alignment;
  return b;
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    alignment_ = std::exchange(o.alignment_, 0);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

}  // namespace strata
