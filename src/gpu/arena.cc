#include "src/gpu/arena.h"

#include <fmt/format.h>

#include "src/common/aligned_buffer.h"

namespace strata::gpu {

std::string FormatBytes(size_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (size_t{1} << 30)) return fmt::format("{:.2f} GiB ({} bytes)", b / (1 << 30), bytes);
  if (bytes >= (size_t{1} << 20)) return fmt::format("{:.2f} MiB ({} bytes)", b / (1 << 20), bytes);
  if (bytes >= (size_t{1} << 10)) return fmt::format("{:.2f} KiB ({} bytes)", b / (1 << 10), bytes);
  return fmt::format("{} bytes", bytes);
}

Arena::Arena(void* base, size_t bytes, std::string label, std::function<void()> release)
    : base_(static_cast<char*>(base)),
      bytes_(AlignDown(bytes, kAlign)),
      label_(std::move(label)),
      release_(std::move(release)) {
  MutexLock lock(&mu_);
  if (bytes_ > 0) InsertFree(0, bytes_);
}

Arena::~Arena() {
  if (release_) release_();
}

void Arena::InsertFree(size_t off, size_t len) {
  free_by_off_.emplace(off, len);
  free_by_len_.emplace(len, off);
}

void Arena::EraseFree(std::map<size_t, size_t>::iterator it) {
  free_by_len_.erase({it->second, it->first});
  free_by_off_.erase(it);
}

StatusOr<void*> Arena::Allocate(size_t bytes) {
  if (bytes == 0) return InvalidArgumentError(label_ + ": allocation of 0 bytes");
  MutexLock lock(&mu_);
  const size_t need = bytes > bytes_ ? bytes : AlignUp(bytes, kAlign);
  // Best fit: the smallest free block that holds `need` (lowest offset on ties).
  auto fit = need > bytes_ ? free_by_len_.end() : free_by_len_.lower_bound({need, 0});
  if (fit == free_by_len_.end()) {
    ++failed_;
    const size_t largest = free_by_len_.empty() ? 0 : free_by_len_.rbegin()->first;
    return ResourceExhaustedError(fmt::format(
        "{}: cannot allocate {}: {} in use of a budget of {} ({} left, largest free block {}{})",
        label_, FormatBytes(bytes), FormatBytes(in_use_), FormatBytes(bytes_),
        FormatBytes(bytes_ - in_use_), FormatBytes(largest),
        bytes_ - in_use_ >= need ? ": fragmented" : ""));
  }
  const auto [len, off] = *fit;
  EraseFree(free_by_off_.find(off));
  if (len > need) InsertFree(off + need, len - need);
  used_.emplace(off, need);
  in_use_ += need;
  if (in_use_ > high_water_) high_water_ = in_use_;
  ++total_;
  return static_cast<void*>(base_ + off);
}

Status Arena::Free(void* p) {
  if (p == nullptr) return Status::Ok();
  MutexLock lock(&mu_);
  const char* c = static_cast<const char*>(p);
  auto it =
      (c >= base_ && c < base_ + bytes_) ? used_.find(static_cast<size_t>(c - base_)) : used_.end();
  if (it == used_.end())
    return InternalError(fmt::format("{}: Free of {} which is not a live allocation", label_, p));
  size_t off = it->first, len = it->second;
  used_.erase(it);
  in_use_ -= len;
  // Coalesce with the free block after and the one before.
  auto next = free_by_off_.lower_bound(off);
  if (next != free_by_off_.end() && next->first == off + len) {
    len += next->second;
    EraseFree(next);
  }
  auto after = free_by_off_.lower_bound(off);
  if (after != free_by_off_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == off) {
      off = prev->first;
      len += prev->second;
      EraseFree(prev);
    }
  }
  InsertFree(off, len);
  return Status::Ok();
}

ArenaStats Arena::Stats() const {
  MutexLock lock(&mu_);
  ArenaStats s;
  s.budget_bytes = bytes_;
  s.in_use_bytes = in_use_;
  s.high_water_bytes = high_water_;
  s.largest_free_bytes = free_by_len_.empty() ? 0 : free_by_len_.rbegin()->first;
  s.allocations = used_.size();
  s.total_allocations = total_;
  s.failed_allocations = failed_;
  return s;
}

void Arena::ResetHighWater() {
  MutexLock lock(&mu_);
  high_water_ = in_use_;
}

bool Arena::Contains(const void* p, size_t bytes) const {
  const char* c = static_cast<const char*>(p);
  return c != nullptr && c >= base_ && bytes <= bytes_ &&
         static_cast<size_t>(c - base_) <= bytes_ - bytes;
}

}  // namespace strata::gpu
