// Device base class, buffer handles, backend selection and machine facts.
#include "src/gpu/device.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/gpu/arena.h"

namespace strata::gpu {

// ---- DeviceBuffer ----

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    device_ = std::exchange(o.device_, nullptr);
    ptr_ = std::exchange(o.ptr_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (ptr_ != nullptr) device_->Release(ptr_);
  device_ = nullptr;
  ptr_ = nullptr;
  size_ = 0;
}

// ---- Device ----

Device::Device(bool is_host, std::unique_ptr<Arena> arena)
    : is_host_(is_host), arena_(std::move(arena)) {}

Device::~Device() = default;

StatusOr<DeviceBuffer> Device::Allocate(size_t bytes) {
  ASSIGN_OR_RETURN(void* p, arena_->Allocate(bytes));
  return DeviceBuffer(this, p, bytes);
}

void Device::Release(void* p) {
  Status s = arena_->Free(p);
  if (!s.ok()) STRATA_LOG_ERROR("DeviceBuffer release: {}", s.ToString());  // broken invariant
}

ArenaStats Device::Stats() const { return arena_->Stats(); }
void Device::ResetHighWater() { arena_->ResetHighWater(); }
bool Device::Contains(const void* p, size_t bytes) const { return arena_->Contains(p, bytes); }

Status Device::CheckDev(const void* p, size_t bytes, const char* what, size_t align) const {
  if (p == nullptr) return InvalidArgumentError(fmt::format("{}: null device pointer", what));
  if (reinterpret_cast<uintptr_t>(p) % align != 0)
    return InvalidArgumentError(fmt::format(
        "{}: device pointer {} is not aligned to its {}-byte elements", what, p, align));
  if (!arena_->Contains(p, bytes))
    return InvalidArgumentError(
        fmt::format("{}: [{}, +{} bytes) is not inside the device arena [{}, +{} bytes)", what, p,
                    bytes, arena_->base(), arena_->budget()));
  return Status::Ok();
}

Status Device::CheckHost(const void* p, size_t bytes, const char* what) {
  if (p == nullptr && bytes > 0)
    return InvalidArgumentError(fmt::format("{}: null host pointer", what));
  return Status::Ok();
}

Status Device::CheckNoPartialOverlap(const void* dst, const void* src, size_t bytes) {
  const char* d = static_cast<const char*>(dst);
  const char* s = static_cast<const char*>(src);
  if (d != s && d < s + bytes && s < d + bytes)
    return InvalidArgumentError(
        fmt::format("CopyD2D: source {} and destination {} overlap ({} bytes)", src, dst, bytes));
  return Status::Ok();
}

// ---- Selection ----

StatusOr<DeviceOptions> DeviceOptionsFromConfig(const Config& config) {
  const StrataConfig& s = config.strata;
  DeviceOptions o;
  o.kind = s.device;
  if (s.device_id < 0 || s.device_id > 1024)
    return InvalidArgumentError(
        fmt::format("strata.device_id: {} is not a device ordinal", s.device_id));
  o.device_id = static_cast<int>(s.device_id);
  if (s.hbm_budget_bytes < 0)
    return InvalidArgumentError(fmt::format(
        "strata.hbm_budget_bytes: {} is negative (0 = all free memory)", s.hbm_budget_bytes));
  o.hbm_budget_bytes = static_cast<size_t>(s.hbm_budget_bytes);
  if (!(s.host_device.link_gbytes_per_s >= 0))
    return InvalidArgumentError(
        fmt::format("strata.host_device.link_gbytes_per_s: {} is negative (0 = unmodelled)",
                    s.host_device.link_gbytes_per_s));
  if (!(s.host_device.link_latency_us >= 0))
    return InvalidArgumentError(fmt::format("strata.host_device.link_latency_us: {} is negative",
                                            s.host_device.link_latency_us));
  o.link_gbytes_per_s = s.host_device.link_gbytes_per_s;
  o.link_latency_us = s.host_device.link_latency_us;
  return o;
}

StatusOr<std::unique_ptr<Device>> CreateDevice(const DeviceOptions& options) {
  switch (options.kind) {
    case DeviceKind::kHost:
      return CreateHostDevice(options);
    case DeviceKind::kCuda:
      return CreateCudaDevice(options);
    case DeviceKind::kAuto: {
      auto cuda = CreateCudaDevice(options);
      if (cuda.ok()) return cuda;
      // Only "no device here" falls back; a device that exists but fails
      // (budget larger than its memory, driver error) is reported.
      const StatusCode c = cuda.status().code();
      if (c != StatusCode::kNotSupported && c != StatusCode::kUnavailable) return cuda.status();
      STRATA_INFO_ONCE("gpu.auto_host",
                       "strata.device=auto: no usable CUDA device ({}); using the host device",
                       cuda.status().message());
      return CreateHostDevice(options);
    }
  }
  return InvalidArgumentError("strata.device: unknown device kind");
}

MemlockLimit ReadMemlockLimit() {
  MemlockLimit m;
  struct rlimit rl {};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return m;
  m.soft_unlimited = rl.rlim_cur == RLIM_INFINITY;
  m.hard_unlimited = rl.rlim_max == RLIM_INFINITY;
  m.soft_bytes = m.soft_unlimited ? 0 : rl.rlim_cur;
  m.hard_bytes = m.hard_unlimited ? 0 : rl.rlim_max;
  return m;
}

}  // namespace strata::gpu
