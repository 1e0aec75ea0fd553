// Device base class, buffer handles, backend selection and machine facts.
#include "src/gpu/device.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <cmath>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/log.h"
#include "src/common/state_codes.h"
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

size_t ArenaBudgetBytes(size_t requested) { return AlignDown(requested, kDeviceAlignment); }

size_t AdamBytesPerElement(DType grad_dtype, bool copy_out, DType copy_dtype, bool bf16_moments) {
  return (bf16_moments ? 16 : 24) + DTypeSize(grad_dtype) + (copy_out ? DTypeSize(copy_dtype) : 0);
}

static_assert(kAdamQuantBlock == codes::kQuantBlock);

AdamStates AdamShardStates(const AdamShard& s) {
  if (s.param_bf16 != nullptr) return AdamStates::kBf16Master;
  if (s.exp_avg_q8 != nullptr) return AdamStates::kInt8;
  if (s.exp_avg_bf16 != nullptr) return AdamStates::kBf16;
  return AdamStates::kFp32;
}

double AdamBytesPerElement(AdamStates states, DType grad_dtype, bool copy_out, DType copy_dtype) {
  const double param = states == AdamStates::kBf16Master ? 4 : 8;
  const double moments = states == AdamStates::kFp32   ? 16
                         : states == AdamStates::kInt8 ? 4 + 16.0 / kAdamQuantBlock
                                                       : 8;
  return param + moments + static_cast<double>(DTypeSize(grad_dtype)) +
         (copy_out ? static_cast<double>(DTypeSize(copy_dtype)) : 0);
}

bool AdamShardVectorizable(const AdamShard& s) {
  // The compact kernels of a bf16 master or int8 moments move one element
  // per thread.
  if (AdamShardStates(s) == AdamStates::kBf16Master || AdamShardStates(s) == AdamStates::kInt8)
    return false;
  auto a16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool bf16 = s.exp_avg_bf16 != nullptr;
  return a16(s.param) && a16(s.grad) &&
         a16(bf16 ? static_cast<const void*>(s.exp_avg_bf16) : s.exp_avg) &&
         a16(bf16 ? static_cast<const void*>(s.exp_avg_sq_bf16) : s.exp_avg_sq) &&
         (s.copy_out == nullptr || a16(s.copy_out));
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

namespace {
bool IsFloatDType(DType t) { return t == DType::kFp32 || t == DType::kFp16 || t == DType::kBf16; }
}  // namespace

Status Device::CheckAdam(std::span<const AdamShard> shards, const AdamHyperParams& hp,
                         const int32_t* skip_if_set) const {
  auto bad = [](const std::string& what) { return InvalidArgumentError("AdamStep: " + what); };
  if (!(hp.lr >= 0) || !std::isfinite(hp.lr))
    return bad(fmt::format("lr must be finite and >= 0, got {}", hp.lr));
  if (!(hp.beta1 >= 0 && hp.beta1 < 1))
    return bad(fmt::format("beta1 must be in [0, 1), got {}", hp.beta1));
  if (!(hp.beta2 >= 0 && hp.beta2 < 1))
    return bad(fmt::format("beta2 must be in [0, 1), got {}", hp.beta2));
  if (!(hp.eps >= 0) || !std::isfinite(hp.eps))
    return bad(fmt::format("eps must be finite and >= 0, got {}", hp.eps));
  if (!(hp.weight_decay >= 0) || !std::isfinite(hp.weight_decay))
    return bad(fmt::format("weight_decay must be finite and >= 0, got {}", hp.weight_decay));
  if (!std::isfinite(hp.grad_scale))
    return bad(fmt::format("grad_scale must be finite, got {}", hp.grad_scale));
  if (hp.step < 1)
    return bad(fmt::format("step must be >= 1 (the step being taken, 1-based), got {}", hp.step));
  if (skip_if_set != nullptr)
    RETURN_IF_ERROR(
        CheckDev(skip_if_set, sizeof(int32_t), "AdamStep skip_if_set", alignof(int32_t)));
  for (size_t i = 0; i < shards.size(); ++i) {
    const AdamShard& s = shards[i];
    if (s.count == 0) continue;
    const std::string name = fmt::format("AdamStep shard {}", i);
    if (!IsFloatDType(s.grad_dtype)) return bad(fmt::format("shard {}: bad grad dtype", i));
    if (s.copy_out != nullptr && !IsFloatDType(s.copy_dtype))
      return bad(fmt::format("shard {}: bad copy dtype", i));
    struct Arr {
      const void* p;
      size_t bytes;
      const char* field;
      size_t align;
    };
    const size_t f32 = ElemBytes(s.count, DType::kFp32);
    // One state format per shard: its pointers set, the others null.
    const bool bf16 = s.exp_avg_bf16 != nullptr || s.exp_avg_sq_bf16 != nullptr;
    const bool q8 = s.exp_avg_q8 != nullptr || s.exp_avg_sq_q8 != nullptr ||
                    s.exp_avg_scale != nullptr || s.exp_avg_sq_scale != nullptr;
    const bool master16 = s.param_bf16 != nullptr;
    if (bf16 && (s.exp_avg != nullptr || s.exp_avg_sq != nullptr || s.exp_avg_bf16 == nullptr ||
                 s.exp_avg_sq_bf16 == nullptr || q8))
      return bad(
          fmt::format("shard {}: the moments are both fp32 (exp_avg, exp_avg_sq), both bf16 "
                      "(exp_avg_bf16, exp_avg_sq_bf16) or both int8 (exp_avg_q8, exp_avg_sq_q8 "
                      "and their scales)",
                      i));
    if (q8 &&
        (s.exp_avg != nullptr || s.exp_avg_sq != nullptr || s.exp_avg_q8 == nullptr ||
         s.exp_avg_sq_q8 == nullptr || s.exp_avg_scale == nullptr || s.exp_avg_sq_scale == nullptr))
      return bad(
          fmt::format("shard {}: int8 moments need exp_avg_q8, exp_avg_sq_q8, exp_avg_scale and "
                      "exp_avg_sq_scale, and no fp32 moments",
                      i));
    if (q8 && s.index0 % kAdamQuantBlock != 0)
      return bad(fmt::format("shard {}: int8 moments: index0 {} is not a multiple of {}", i,
                             s.index0, kAdamQuantBlock));
    if (master16 && (s.param != nullptr || !bf16))
      return bad(fmt::format(
          "shard {}: a bf16 master (param_bf16) goes with bf16 moments and no fp32 param", i));
    if (!master16 && s.param == nullptr) return bad(fmt::format("shard {}: param is null", i));
    const size_t mom = bf16 ? ElemBytes(s.count, DType::kBf16) : q8 ? s.count : f32;
    const size_t mom_align = bf16 ? 2 : q8 ? 1 : 4;
    const size_t nscales = (s.count + kAdamQuantBlock - 1) / kAdamQuantBlock;
    const void* m = bf16 ? static_cast<const void*>(s.exp_avg_bf16)
                    : q8 ? static_cast<const void*>(s.exp_avg_q8)
                         : s.exp_avg;
    const void* v = bf16 ? static_cast<const void*>(s.exp_avg_sq_bf16)
                    : q8 ? static_cast<const void*>(s.exp_avg_sq_q8)
                         : s.exp_avg_sq;
    std::vector<Arr> arrs = {
        {master16 ? static_cast<const void*>(s.param_bf16) : s.param,
         master16 ? ElemBytes(s.count, DType::kBf16) : f32, master16 ? "param_bf16" : "param",
         master16 ? 2u : 4u},
        {s.grad, ElemBytes(s.count, s.grad_dtype), "grad", DTypeSize(s.grad_dtype)},
        {m, mom,
         bf16 ? "exp_avg_bf16"
         : q8 ? "exp_avg_q8"
              : "exp_avg",
         mom_align},
        {v, mom,
         bf16 ? "exp_avg_sq_bf16"
         : q8 ? "exp_avg_sq_q8"
              : "exp_avg_sq",
         mom_align}};
    if (q8) {
      arrs.push_back({s.exp_avg_scale, ElemBytes(nscales, DType::kFp32), "exp_avg_scale", 4});
      arrs.push_back({s.exp_avg_sq_scale, ElemBytes(nscales, DType::kFp32), "exp_avg_sq_scale", 4});
    }
    if (s.copy_out != nullptr)
      arrs.push_back(
          {s.copy_out, ElemBytes(s.count, s.copy_dtype), "copy_out", DTypeSize(s.copy_dtype)});
    const int n_arrs = static_cast<int>(arrs.size());
    for (int a = 0; a < n_arrs; ++a)
      RETURN_IF_ERROR(CheckDev(arrs[a].p, arrs[a].bytes,
                               fmt::format("{} {}", name, arrs[a].field).c_str(), arrs[a].align));
    for (int a = 0; a < n_arrs; ++a)
      for (int b = a + 1; b < n_arrs; ++b) {
        const char* pa = static_cast<const char*>(arrs[a].p);
        const char* pb = static_cast<const char*>(arrs[b].p);
        if (pa < pb + arrs[b].bytes && pb < pa + arrs[a].bytes)
          return bad(fmt::format("shard {}: {} and {} overlap", i, arrs[a].field, arrs[b].field));
      }
  }
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
      // Only "no GPU here" falls back: a CPU-only build (NotSupported) or no
      // device at all (Unavailable, CreateCudaDevice's answer for nothing
      // else). A GPU that exists but cannot be used (a driver older than the
      // runtime, a budget larger than its memory) is reported: a run that
      // meant to use it must not quietly measure the host instead.
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
