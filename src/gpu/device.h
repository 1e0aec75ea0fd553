// src/gpu/device.h — the device layer's contract (the one interface header of
// src/gpu). Everything the scheduler needs from an accelerator:
//
//   * an HBM arena with a hard byte budget and high-water statistics,
//   * streams (ordered queues of work) and events (cross-stream dependencies),
//   * asynchronous copies host→device, device→host and device→device,
//   * the few kernels the engine needs: cast fp32↔fp16/bf16 (round to nearest
//     even), fused gradient unscale + inf/nan detection, sum of squares for the
//     global gradient norm, fill,
//   * a pinned host-memory pool handed out in fixed size classes whose regions
//     the NVMe engine registers as io_uring fixed buffers,
//   * a communicator (NCCL on CUDA; on the host backend a one-rank local one,
//     or Gloo over TCP for several ranks).
//
// Two backends behind the same interface (LevelDB Env style):
//   CudaDevice  — the CUDA runtime: one cudaMalloc'd arena sub-allocated here,
//                 separate non-blocking streams for compute, H2D and D2H.
//   HostDevice  — host memory: every stream is an ordered queue served by its
//                 own thread (copies run on the copy streams' threads, kernels
//                 on the compute stream's thread), events are completion
//                 flags. Same ordering semantics as CUDA, so the scheduler and
//                 its tests run without a GPU. Optionally models a link
//                 (bandwidth + latency) so that overlap is observable.
//                 It is as strict as CUDA is allowed to be, so that code which
//                 would hang or race on a GPU fails here too:
//                   - host functions of all streams run on ONE callback thread
//                     per device, in the order they become ready (CUDA's driver
//                     thread may serialize them the same way);
//                   - a blocking call (Stream/Event/Device Synchronize, a
//                     pageable copy) that has waited host_deadlock_timeout_s
//                     while a host function has been running that long returns
//                     FailedPrecondition "deadlock: ..." (on CUDA it would hang);
//                   - any Device/Stream/Event call from inside a host function
//                     is FailedPrecondition (CUDA: cudaErrorNotPermitted);
//                   - copies from/to pageable host memory (not registered with
//                     PinHostMemory) are synchronous for the caller (stricter
//                     than CUDA for H2D, see Memory below);
//                   - the arena has CUDA's budget rounding and alignment.
// Choose with CreateDevice(DeviceOptions) — strata.device: auto|cuda|host.
//
// Ordering (both backends, CUDA semantics):
//   * Work enqueued on one stream runs in enqueue order.
//   * Work on different streams is unordered unless joined by an event:
//     e.Record(a); b.Wait(e) makes everything enqueued on b after the Wait
//     start only after everything enqueued on a before the Record finished.
//     A Wait refers to the latest Record issued before it; waiting on an event
//     never recorded is a no-op.
//   * Enqueue calls return at once; the buffers they name must stay valid and
//     must not be modified (sources) or read (destinations) by the host until
//     the work is known complete (stream/event Synchronize, Query, a host
//     callback).
//   * Argument errors (null pointers, ranges outside the arena, bad dtypes)
//     are returned synchronously by the enqueue call and nothing is enqueued.
//     Failures of the enqueued work itself (CUDA only) are reported by the
//     next Synchronize on that stream.
//
// Memory:
//   * "Device pointers" are pointers into the device's arena (from Allocate);
//     kernels and copies check that [ptr, ptr+bytes) lies inside the arena and
//     return InvalidArgument otherwise (this catches host/device mix-ups on
//     HostDevice, where both are ordinary addresses).
//   * Freeing a DeviceBuffer whose memory is still used by enqueued work is a
//     caller bug: synchronize (or wait on an event) first. Event::Query is the
//     cheap, non-blocking way to find out that work is done (poll it, then
//     release the buffers the work used).
//   * Host memory is "pinned" when it lies inside a range registered with
//     PinHostMemory (PinnedPool regions are). Copies to/from pinned memory are
//     asynchronous. Copies to/from pageable memory block the caller, with
//     this much guaranteed on both backends (CUDA's rules):
//       - D2H into pageable memory returns after the stream's earlier work
//         and the copy are done: the host may read the data at once;
//       - H2D from pageable memory returns once the source has been read
//         (staged): the host may modify or free the source at once, but the
//         device-side write may still be in flight. Work on the same stream
//         is ordered after it as usual; work on another stream needs an
//         event, as for any copy. (HostDevice finishes the copy before
//         returning, which is allowed.)
//     Never make one while the stream (or the device's host-function thread)
//     waits for the calling thread.
//
// Host functions (Stream::EnqueueHostCallback): CUDA runs them on a driver
// thread that may serialize the host functions of all streams of the device,
// and a stream waits at its host function until it has returned. So a host
// function must be short, must not block on anything another thread holds
// while that thread waits for the device, and must not call the Device.
// Prefer events (Record, then Query/ElapsedSeconds from the engine's thread)
// for timestamps and for releasing buffers.
//
// Kernels are loaded when the device is created (CUDA loads kernels lazily by
// default, and loading one may synchronize the whole device: a first launch
// while a stream waits for the caller would hang).
//
// Thread-safety: Device, Stream and Event methods may be called from any
// thread concurrently; enqueue calls on one stream from several threads are
// ordered by whichever call returns first. Destroy streams/events only when no
// other thread uses them; the Device must outlive its streams, events,
// buffers, pinned pools and communicators.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "src/common/dtype.h"
#include "src/common/thread_annotations.h"
#include "strata/config.h"
#include "strata/rendezvous.h"
#include "strata/status.h"

namespace strata::gpu {

class Device;

// ---- Selection ---------------------------------------------------------------

// HostDevice's HBM budget when hbm_budget_bytes is 0: 1 GiB. The arena is an
// mmap(MAP_NORESERVE) reservation, so untouched budget costs no memory.
inline constexpr size_t kDefaultHostHbmBudget = size_t{1} << 30;

struct DeviceOptions {
  // strata::DeviceKind (config.h); auto = CUDA if a device is present, else host.
  DeviceKind kind = DeviceKind::kAuto;
  int device_id = 0;  // CUDA device ordinal
  // The arena's hard budget. 0 = CUDA: all free device memory less a headroom
  // (5%, at most 1 GiB) for the CUDA context and libraries; host: 1 GiB.
  size_t hbm_budget_bytes = 0;
  // HostDevice's link model, per direction (full duplex like PCIe):
  // a copy of n bytes takes at least latency + n / bandwidth. 0 = unmodelled.
  double link_gbytes_per_s = 0.0;
  double link_latency_us = 0.0;
  // HostDevice: a blocking call that has waited this long while a host
  // function has been running at least this long is reported as a deadlock
  // (FailedPrecondition) instead of hanging. 0 = wait forever, like CUDA.
  // A collective waiting for other ranks is not counted: it has a timeout
  // of its own (CommOptions::timeout_s).
  double host_deadlock_timeout_s = 10.0;
  // HostDevice, tests only: model CUDA's lazy kernel loading instead of
  // loading every kernel at creation — the first launch of each kernel then
  // synchronizes the device (a blocking call, subject to the deadlock check).
  bool host_lazy_kernel_loading = false;
};

// The arena's byte budget for a requested hbm_budget_bytes (> 0): rounded
// down to the arena alignment. One rule for both backends, so that the same
// plan lays out (and fragments) the same arena on CUDA and on the host.
size_t ArenaBudgetBytes(size_t requested);
// Alignment of every arena block (and the rounding of its size): CUDA's
// cudaMalloc alignment. Both backends use it.
inline constexpr size_t kDeviceAlignment = 256;

// Fills options from strata.device, strata.device_id, strata.hbm_budget_bytes
// and strata.host_device.{link_gbytes_per_s, link_latency_us}. Negative values
// are InvalidArgument naming the key.
StatusOr<DeviceOptions> DeviceOptionsFromConfig(const Config& config);

// Creates the device. kCuda on a machine without a GPU (no NVIDIA driver, no
// device) is Unavailable, in a CPU-only build NotSupported, with the reason;
// kAuto then falls back to HostDevice and logs that once. A GPU that is
// present but unusable (e.g. a driver older than the CUDA runtime) is
// FailedPrecondition naming the driver's and the runtime's CUDA versions, for
// kAuto too: it never falls back to the host then.
StatusOr<std::unique_ptr<Device>> CreateDevice(const DeviceOptions& options);
// Direct factories (CreateDevice calls these).
StatusOr<std::unique_ptr<Device>> CreateHostDevice(const DeviceOptions& options);
StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const DeviceOptions& options);

// ---- Machine facts for `strata info` ------------------------------------------

struct CudaDeviceInfo {
  int ordinal = 0;
  std::string name;
  size_t total_bytes = 0;  // HBM
  size_t free_bytes = 0;
  int cc_major = 0, cc_minor = 0;  // compute capability
  int multiprocessors = 0;
  std::string pci_bus_id;  // "0000:3b:00.0"
  // From sysfs for pci_bus_id (the CUDA runtime does not report the link);
  // 0 when unknown.
  int pcie_gen = 0;
  int pcie_width = 0;
  int numa_node = -1;  // the kernel's NUMA node nearest it (sysfs), -1 when unknown
};

struct CudaDeviceList {
  std::vector<CudaDeviceInfo> devices;
  std::string reason;  // why the list is empty ("no CUDA driver", "built without CUDA")
};
CudaDeviceList ListCudaDevices();

// RLIMIT_MEMLOCK of this process, in bytes (what mlock/cudaHostRegister of
// pageable memory may lock without CAP_IPC_LOCK).
struct MemlockLimit {
  bool soft_unlimited = false, hard_unlimited = false;
  uint64_t soft_bytes = 0, hard_bytes = 0;
};
MemlockLimit ReadMemlockLimit();

// ---- Statistics ----------------------------------------------------------------

struct ArenaStats {
  size_t budget_bytes = 0;        // hard limit
  size_t in_use_bytes = 0;        // allocated now (after alignment rounding)
  size_t high_water_bytes = 0;    // max in_use since creation or ResetHighWater
  size_t largest_free_bytes = 0;  // the biggest allocation that would succeed now
  uint64_t allocations = 0;       // live allocations
  uint64_t total_allocations = 0;
  uint64_t failed_allocations = 0;
};

// ---- Streams and events ----------------------------------------------------

struct EventOptions {
  // Record a completion timestamp (CUDA: no cudaEventDisableTiming), so that
  // Device::ElapsedSeconds can time the work between two records. Slightly
  // more expensive to record; leave off for pure dependencies.
  bool timing = false;
};

class Event {
 public:
  virtual ~Event() = default;
  // True when all work captured by the latest Record has finished (or when
  // never recorded). Never blocks and never waits for a host function: safe
  // to poll from any thread, e.g. to release the buffers a copy used once
  // its event is complete. Errors: a failed CUDA query.
  virtual StatusOr<bool> Query() = 0;
  // Blocks the calling thread until the latest Record has completed.
  virtual Status Synchronize() = 0;
  virtual bool timing() const = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual const std::string& name() const = 0;
  // Captures the work enqueued on this stream so far in `event`.
  virtual Status Record(Event& event) = 0;
  // Work enqueued on this stream after this call waits for `event`'s latest
  // Record (issued before this call). Does not block the host.
  virtual Status Wait(Event& event) = 0;
  // Runs `fn` on a host thread after all work enqueued before it; later work
  // on the stream waits for `fn` to return. `fn` must not call into this
  // Device (CUDA forbids runtime calls in host functions) and must not block
  // for long. An enqueue failure means `fn` will never run.
  virtual Status EnqueueHostCallback(std::function<void()> fn) = 0;
  // Blocks until all work enqueued so far has finished; returns the first
  // error of that work, if any.
  virtual Status Synchronize() = 0;
  // True when all work enqueued so far has finished.
  virtual StatusOr<bool> Query() = 0;
  // The backend's handle (cudaStream_t on CUDA, nullptr on the host backend).
  virtual void* native_handle() const = 0;
};

// ---- Optimizer arguments -------------------------------------------------------

// Hyper-parameters of Device::AdamStep: the meaning of cpu_adam::HyperParams
// for kAdam/kAdamW (src/gpu may not include src/cpu_adam; the scheduler
// copies the fields across).
struct AdamHyperParams {
  bool decoupled_weight_decay = true;  // true: AdamW (torch.optim.AdamW); false: Adam (L2)
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  int64_t step = 1;         // the step being taken, 1-based (≥ 1)
  double grad_scale = 1.0;  // every gradient is multiplied by this first (1/loss_scale × clip)
  uint64_t seed = 0;        // a bf16 master's stochastic rounding (AdamShard::param_bf16)
};

// One tensor (or shard) of optimizer state for Device::AdamStep; device
// pointers, not owned.
struct AdamShard {
  float* param = nullptr;      // fp32 master, count elements, updated in place
  const void* grad = nullptr;  // count elements of grad_dtype
  DType grad_dtype = DType::kFp32;
  float* exp_avg = nullptr;     // fp32 first moment
  float* exp_avg_sq = nullptr;  // fp32 second moment
  void* copy_out = nullptr;     // optional: count elements of copy_dtype ← updated param
  DType copy_dtype = DType::kBf16;
  size_t count = 0;  // 0 is valid (nothing happens)
  // bf16 moments instead of exp_avg / exp_avg_sq (strata.optimizer_states
  // "bf16"): those null, these set; each moment is read as bf16, updated in
  // fp32 as above and stored rounded to nearest even (src/cpu_adam's bf16
  // format, bit for bit).
  uint16_t* exp_avg_bf16 = nullptr;
  uint16_t* exp_avg_sq_bf16 = nullptr;
  // A bf16 master (strata.optimizer_states "bf16-master", with bf16 moments):
  // param null, this set; read as bf16, updated in fp32 and stored with
  // stochastic rounding keyed by (hp.seed, hp.step, index0 + i) — so the
  // bits do not depend on how the elements are cut into shards. The copy is
  // of the stored (rounded) master.
  uint16_t* param_bf16 = nullptr;
  // int8 moments (strata.optimizer_states "int8", with the fp32 master):
  // exp_avg, exp_avg_sq and their bf16 pointers null, these set: one 8-bit
  // code per element and one fp32 scale per block of 256 elements of each
  // moment, ceil(count / 256) of them, block b covering elements
  // [256 b, 256 b + 256) of the shard; each block's new scale is its new
  // absmax over the code's range (src/common/state_codes.h).
  uint8_t* exp_avg_q8 = nullptr;
  uint8_t* exp_avg_sq_q8 = nullptr;
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  // The global index of element 0 (bf16 master: the rounding stream; int8:
  // a multiple of 256, blocks being aligned to the global index).
  uint64_t index0 = 0;
};

// Elements per int8 block (src/common/state_codes.h's kQuantBlock).
inline constexpr size_t kAdamQuantBlock = 256;

// The state format of a shard, from which of its pointers are set
// (strata::StateFormat, as the config and the CPU optimizer name it).
using AdamStates = ::strata::StateFormat;
AdamStates AdamShardStates(const AdamShard& s);

// The CUDA kernel's 16-byte vector path needs param, grad, the moments and
// copy_out (when present) all 16-byte aligned; any other
// shard runs element by element (same results, a fraction of the bandwidth).
bool AdamShardVectorizable(const AdamShard& s);

// Shards (count > 0) AdamStep enqueued, by path: on CUDA the launcher's
// decision, which its kernel follows; on the host device the same rule
// (AdamShardVectorizable), so that layouts can be checked without a GPU.
struct AdamPathCounts {
  uint64_t vector_shards = 0;
  uint64_t scalar_shards = 0;
};

// Bytes AdamStep moves per element (reads + writes): param, exp_avg,
// exp_avg_sq read and written (24; 16 with bf16 moments), the gradient
// read, the copy written.
size_t AdamBytesPerElement(DType grad_dtype, bool copy_out, DType copy_dtype,
                           bool bf16_moments = false);
// The same for any state format: param 8 (bf16 master 4), moments 16 (bf16
// 8, int8 4 plus 16 bytes of scales per 256 elements), as a fraction.
double AdamBytesPerElement(AdamStates states, DType grad_dtype, bool copy_out, DType copy_dtype);

// ---- Device memory ---------------------------------------------------------

// A block of the HBM arena; returns it to the arena on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t size() const { return size_; }
  explicit operator bool() const { return ptr_ != nullptr; }
  // Returns the memory to the arena now. REQUIRES: no pending work uses it.
  void Reset();

 private:
  friend class Device;
  DeviceBuffer(Device* d, void* p, size_t n) : device_(d), ptr_(p), size_(n) {}
  Device* device_ = nullptr;
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

// ---- The device ---------------------------------------------------------------

class Arena;  // src/gpu/arena.h

class Device {
 public:
  virtual ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // "cuda:0 (NVIDIA H100 80GB HBM3)" or "host".
  virtual std::string Describe() const = 0;
  bool is_host() const { return is_host_; }
  // CUDA device ordinal; -1 for the host backend.
  virtual int ordinal() const = 0;

  // ---- Arena (thread-safe) ----
  // A block of `bytes` (rounded up to kDeviceAlignment) aligned to it. Past the
  // budget: ResourceExhausted naming the bytes asked, in use, the budget and
  // the largest free block. Zero bytes: InvalidArgument.
  StatusOr<DeviceBuffer> Allocate(size_t bytes);
  ArenaStats Stats() const;
  void ResetHighWater();
  // True if [p, p+bytes) lies inside the arena.
  bool Contains(const void* p, size_t bytes) const;

  // ---- Streams and events ----
  // The three streams the scheduler uses; owned by the device.
  Stream& compute() { return *compute_; }
  Stream& h2d() { return *h2d_; }
  Stream& d2h() { return *d2h_; }
  // Orders the framework's compute after the work `event` marks: on CUDA the
  // compute stream waits for it; on the host device, where the framework
  // computes on the calling thread, the caller does.
  Status OrderComputeAfter(Event& event) {
    return is_host_ ? event.Synchronize() : compute_->Wait(event);
  }
  virtual StatusOr<std::unique_ptr<Stream>> CreateStream(const std::string& name) = 0;
  virtual StatusOr<std::unique_ptr<Event>> CreateEvent(EventOptions options) = 0;
  StatusOr<std::unique_ptr<Event>> CreateEvent() { return CreateEvent(EventOptions{}); }
  // Seconds between the completion of `start`'s and `end`'s latest Records
  // (cudaEventElapsedTime; on the host device, the times at which the stream
  // threads reached the two records). Records on one stream bracket exactly
  // the work enqueued between them; on two streams, the difference of their
  // completion times. Negative if end completed first. Never blocks.
  // Errors: FailedPrecondition if an event was created without timing or was
  // never recorded; Unavailable while either record has not completed (poll
  // Query, or Synchronize, first). Thread-safe; events from this device only.
  virtual StatusOr<double> ElapsedSeconds(Event& start, Event& end) = 0;
  // Blocks until all work on this device has finished (CUDA:
  // cudaDeviceSynchronize, which includes work other libraries enqueued).
  virtual Status Synchronize() = 0;

  // ---- Copies (async, ordered on `stream`) ----
  // `host` may be pinned or pageable (pageable is slower on CUDA and blocks
  // the caller: an H2D until the source is staged, a D2H until the data is
  // in `host`; see Memory above). `dev` must be in the arena.
  virtual Status CopyH2D(void* dev, const void* host, size_t bytes, Stream& stream) = 0;
  virtual Status CopyD2H(void* host, const void* dev, size_t bytes, Stream& stream) = 0;
  // dst == src is a no-op; partially overlapping ranges are InvalidArgument.
  virtual Status CopyD2D(void* dst, const void* src, size_t bytes, Stream& stream) = 0;

  // ---- Kernels (async, ordered on `stream`; all pointers in the arena and
  // aligned to their element size, else InvalidArgument) ----
  // dst[i] = convert(src[i]) for i < n; any pair of dtypes (fp16/bf16 are
  // uint16_t bit patterns). Float→half rounds to nearest even, overflow → inf,
  // NaN stays NaN (payload not preserved). src and dst must not overlap
  // unless they are equal and the dtypes have the same size.
  virtual Status Cast(const void* src, DType src_type, void* dst, DType dst_type, size_t n,
                      Stream& stream) = 0;
  // In place: x[i] = x[i] * inv_scale (rounded back to x's dtype). If any x[i]
  // is inf/nan before or after scaling, sets *found_inf = 1; never clears it
  // (fill it with 0 first; several tensors can share one flag). found_inf is
  // an int32 in the arena.
  virtual Status UnscaleAndCheck(void* x, DType type, size_t n, float inv_scale, int32_t* found_inf,
                                 Stream& stream) = 0;
  // *sum += Σ x[i]² accumulated in double (fp16/bf16 widened exactly). `sum`
  // is a double in the arena; fill it with 0 first. Summation order differs
  // between backends (results agree to ~1e-12 relative, not bitwise).
  virtual Status SumSquares(const void* x, DType type, size_t n, double* sum, Stream& stream) = 0;
  // x[i] = value rounded to x's dtype.
  virtual Status Fill(void* x, DType type, size_t n, float value, Stream& stream) = 0;
  // Fills an int32 array (flags, counters).
  virtual Status FillInt32(int32_t* x, size_t n, int32_t value, Stream& stream) = 0;
  // Fills a double array (norm accumulators).
  virtual Status FillDouble(double* x, size_t n, double value, Stream& stream) = 0;
  // acc[i] += float(x[i]) for i < n: x (fp32/fp16/bf16) widened exactly, one
  // fp32 add per element (the same bits as the CPU's accumulation); the
  // gradient accumulator of offload_optimizer none. acc and x must not overlap.
  virtual Status AddToFp32(float* acc, const void* x, DType type, size_t n, Stream& stream) = 0;

  // ---- Optimizer (async, ordered on `stream`) ----
  // One fused pass of Adam/AdamW over every shard: reads the fp32 master
  // param (or a bf16 master: AdamShard::param_bf16), the gradient
  // (fp32/fp16/bf16) and the moments (fp32, bf16: AdamShard::exp_avg_bf16,
  // or int8 codes with block scales: AdamShard::exp_avg_q8), writes param
  // and moments and, when copy_out is set, the updated param converted to
  // copy_dtype (round to nearest even) — the same arithmetic, in the same
  // order of float operations, as src/cpu_adam (HyperParams, kernel_scalar.cc):
  //   g = grad * grad_scale;  Adam: g += weight_decay * p
  //   m = (1-b1) * (g - m) + m;  v = (1-b2) * g² + b2 * v
  //   AdamW: p *= 1 - lr * weight_decay
  //   p += -lr/(1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps)
  // (coefficients computed in double and rounded to float once, as there).
  // The compact formats give src/cpu_adam's bits for the same format too
  // (its scalar kernels' ShardStep with element_offset = index0, seed =
  // hp.seed): the codes are src/common/state_codes.h's.
  // CUDA: one multi-tensor launch per (grad dtype, copy dtype, format) group in the
  // list (up to a few hundred shards per launch), no host round trip.
  // If `skip_if_set` (an int32 in the arena, e.g. UnscaleAndCheck's
  // found_inf) is non-zero when the work runs, nothing is written: the
  // overflow-skipped step; the caller then does not advance hp.step.
  // REQUIRES: every array in the arena, aligned to its element size, the
  // arrays of a shard pairwise disjoint, shards disjoint. Argument errors
  // (InvalidArgument naming the shard and field; NotSupported for another
  // algorithm) are returned before anything is enqueued.
  virtual Status AdamStep(std::span<const AdamShard> shards, const AdamHyperParams& hp,
                          const int32_t* skip_if_set, Stream& stream) = 0;
  // The shards AdamStep enqueued since creation, by path. Thread-safe.
  AdamPathCounts adam_path_counts() const {
    return {adam_vector_.load(std::memory_order_relaxed),
            adam_scalar_.load(std::memory_order_relaxed)};
  }

  // ---- Host memory pinning (used by PinnedPool) ----
  // Page-locks [p, p+bytes) for fast DMA (cudaHostRegister on CUDA, mlock on
  // the host backend). Errors name the bytes and RLIMIT_MEMLOCK.
  virtual Status PinHostMemory(void* p, size_t bytes) = 0;
  virtual Status UnpinHostMemory(void* p, size_t bytes) = 0;

 protected:
  Device(bool is_host, std::unique_ptr<Arena> arena);
  // Argument checks shared by the backends.
  // [p, p+bytes) inside the arena and p aligned to `align`.
  Status CheckDev(const void* p, size_t bytes, const char* what, size_t align = 1) const;
  // n elements of t at p: in the arena, aligned to the element size.
  Status CheckElems(const void* p, size_t n, DType t, const char* what) const {
    return CheckDev(p, ElemBytes(n, t), what, DTypeSize(t));
  }
  // n elements of t in bytes, saturating (an absurd n then fails CheckDev).
  static size_t ElemBytes(size_t n, DType t) {
    return n > SIZE_MAX / DTypeSize(t) ? SIZE_MAX : n * DTypeSize(t);
  }
  static Status CheckHost(const void* p, size_t bytes, const char* what);
  // For CopyD2D: distinct ranges, or the same one.
  static Status CheckNoPartialOverlap(const void* dst, const void* src, size_t bytes);
  // AdamStep's argument checks (hyper-parameters, every shard's arrays).
  Status CheckAdam(std::span<const AdamShard> shards, const AdamHyperParams& hp,
                   const int32_t* skip_if_set) const;
  // Backends set these three in their factory.
  std::unique_ptr<Stream> compute_, h2d_, d2h_;
  // AdamStep's backends report the paths of the shards they enqueued.
  void CountAdamPaths(uint64_t vector_shards, uint64_t scalar_shards) {
    adam_vector_.fetch_add(vector_shards, std::memory_order_relaxed);
    adam_scalar_.fetch_add(scalar_shards, std::memory_order_relaxed);
  }

 private:
  friend class DeviceBuffer;
  void Release(void* p);
  bool is_host_;
  std::unique_ptr<Arena> arena_;
  std::atomic<uint64_t> adam_vector_{0}, adam_scalar_{0};
};

// ---- Pinned host-memory pool ----------------------------------------------------

class PinnedPool;

// One buffer of a size class; goes back to the pool on destruction. Move-only.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { Reset(); }

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t size() const { return size_; }  // the class size (≥ bytes asked)
  int region() const { return class_; }  // index into PinnedPool::Regions()
  explicit operator bool() const { return ptr_ != nullptr; }
  void Reset();

 private:
  friend class PinnedPool;
  PinnedPool* pool_ = nullptr;
  void* ptr_ = nullptr;
  size_t size_ = 0;
  int class_ = -1;
};

struct PinnedSizeClass {
  size_t buffer_bytes = 0;  // multiple of 4096
  size_t count = 0;
};

struct PinnedPoolOptions {
  std::vector<PinnedSizeClass> classes;
  // Hard limit on the planned total (Σ buffer_bytes × count); exceeding it is
  // ResourceExhausted before anything is allocated. 0 = no limit.
  size_t budget_bytes = 0;
  // When pinning is refused (RLIMIT_MEMLOCK, driver): true = keep the memory
  // pageable and warn once with how to raise the limit; false = fail.
  bool allow_pageable_fallback = true;
};

// A simple plan: as many buffers of `buffer_bytes` as fit in `budget_bytes`
// (strata.pinned_budget_bytes), at least one. buffer_bytes is rounded up to
// 4096.
PinnedPoolOptions PlanPinnedPool(size_t budget_bytes, size_t buffer_bytes);

// Page-locked host buffers, allocated and pinned once at creation (one
// 4096-aligned region per size class), then handed out without allocating.
// Regions() lists the memory for io_uring fixed-buffer registration. Acquire
// and buffer release are thread-safe; the pool must outlive its buffers.
class PinnedPool {
 public:
  struct Region {
    void* data;
    size_t bytes;
  };
  struct Stats {
    size_t total_bytes = 0;
    bool pinned = false;  // false: pageable fallback
    std::vector<size_t> free_per_class;
    uint64_t acquired = 0, exhausted = 0;
  };

  // Pins through `device` (nullptr: mlock directly). Errors: bad options
  // (InvalidArgument), plan over budget (ResourceExhausted with the numbers),
  // allocation failure, pinning refused without fallback.
  static StatusOr<std::unique_ptr<PinnedPool>> Create(const PinnedPoolOptions& options,
                                                      Device* device);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A free buffer of the smallest class with buffer_bytes ≥ bytes, or
  // ResourceExhausted naming the class and how many are in use (the hot path
  // never allocates; callers wait for a buffer to come back and retry).
  StatusOr<PinnedBuffer> Acquire(size_t bytes) EXCLUDES(mu_);
  const std::vector<Region>& Regions() const { return regions_; }
  bool pinned() const { return pinned_; }
  size_t total_bytes() const { return total_bytes_; }
  Stats GetStats() const EXCLUDES(mu_);

 private:
  friend class PinnedBuffer;
  PinnedPool() = default;
  void Return(int cls, void* p) EXCLUDES(mu_);
  struct Class {
    size_t buffer_bytes;
    std::vector<void*> free;  // the free buffers (guarded by classes_'s mutex)
    size_t count;
  };
  Device* device_ = nullptr;
  bool pinned_ = false;
  size_t total_bytes_ = 0;
  std::vector<Region> regions_;
  mutable Mutex mu_;
  std::vector<Class> classes_ GUARDED_BY(mu_);
  uint64_t acquired_ GUARDED_BY(mu_) = 0;
  uint64_t exhausted_ GUARDED_BY(mu_) = 0;
};

// ---- Collectives -------------------------------------------------------------------

enum class ReduceOp { kSum, kMax, kMin, kAvg };

struct CommOptions {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;  // ranks on this machine (LOCAL_WORLD_SIZE, else WORLD_SIZE)
  // Where rank 0 writes the NCCL unique id and the others read it (a shared
  // filesystem for multi-node). Empty: "/tmp/strata-nccl-<MASTER_ADDR>-
  // <MASTER_PORT>.id"; STRATA_NCCL_ID_FILE overrides (a shared filesystem
  // for several machines). Alternatively STRATA_NCCL_UNIQUE_ID (256 hex
  // digits) in every rank's environment.
  std::string unique_id_file;
  // NCCL: how long non-zero ranks wait for the id. Gloo (host device, several
  // ranks): how long the rendezvous and each collective may wait for the
  // peers before it fails (Unavailable) instead of hanging. Gloo collectives
  // are host functions whose wait for the peers the host device's deadlock
  // check does not count: timeout_s alone bounds it.
  double timeout_s = 300;
  // How long start-up may wait for the peers (Gloo's rendezvous; NCCL: the
  // non-zero ranks' wait for the id); 0: timeout_s. Ranks started minutes
  // apart (one loading a model first) need a long one, while timeout_s can
  // stay short to catch a hung peer in a collective.
  double connect_timeout_s = 0;
  // Gloo: the directory through which the ranks exchange their addresses
  // (Gloo's FileStore; on a filesystem every rank sees). Empty:
  // "/tmp/strata-gloo-<MASTER_ADDR>-<MASTER_PORT>"; STRATA_GLOO_DIR overrides.
  // Each rank removes its own entries once all ranks have connected.
  std::string rendezvous_dir;
  // A store every rank reaches (strata/rendezvous.h): when set, the ranks
  // meet through it (Gloo's addresses, NCCL's unique id) and neither
  // rendezvous_dir nor unique_id_file is used. The Python frontend passes
  // torch.distributed's TCPStore at MASTER_ADDR:MASTER_PORT.
  std::shared_ptr<RendezvousStore> store;
  // Gloo: the host name or address this rank listens on for its peers.
  // Empty: 127.0.0.1 when MASTER_ADDR is unset or a loopback address (one
  // machine); else the address of listen_iface when set; else this
  // machine's address on the route to MASTER_ADDR (the one its peers reach,
  // never what the host name resolves to). STRATA_GLOO_HOST overrides.
  std::string listen_host;
  // Gloo: the network interface to listen on (its first address), as users
  // set it for torch and NCCL: STRATA_GLOO_IFNAME, else GLOO_SOCKET_IFNAME,
  // else NCCL_SOCKET_IFNAME when it names one interface exactly.
  std::string listen_iface;
};

// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (as torchrun sets them), MASTER_ADDR and
// MASTER_PORT (for the default id file and rendezvous directory),
// STRATA_NCCL_ID_FILE, STRATA_GLOO_DIR, STRATA_GLOO_HOST, STRATA_GLOO_IFNAME
// (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), STRATA_COMM_TIMEOUT_S
// and STRATA_COMM_CONNECT_TIMEOUT_S (seconds, > 0).
// Unset → a single rank. Junk or an inconsistent rank → InvalidArgument
// naming the variable.
StatusOr<CommOptions> CommOptionsFromEnv();

// Collectives on a device stream, ordered with the stream's other work.
// Buffers are device pointers (arena). NCCL's ordering rule applies: every
// rank must issue the same collectives in the same order.
//
// Failures: argument errors are returned by the call. A failure of the
// enqueued work (Gloo: a peer died, the timeout passed) is sticky: it is
// returned by AsyncError() once the stream has reached the collective, and by
// every later call on the communicator.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // recv[rank*count .. +count) = send[0..count) gathered from every rank.
  virtual Status AllGather(const void* send, void* recv, size_t count, DType type,
                           Stream& stream) = 0;
  // recv[0..count) = reduce over ranks of send[rank*count .. +count).
  virtual Status ReduceScatter(const void* send, void* recv, size_t count, DType type, ReduceOp op,
                               Stream& stream) = 0;
  virtual Status AllReduce(const void* send, void* recv, size_t count, DType type, ReduceOp op,
                           Stream& stream) = 0;
  // recv[0..count) on `root` = reduce over ranks of send[0..count); recv is
  // not read or written on the other ranks (they may pass send).
  virtual Status Reduce(const void* send, void* recv, size_t count, DType type, ReduceOp op,
                        int root, Stream& stream) = 0;
  virtual Status Broadcast(const void* send, void* recv, size_t count, DType type, int root,
                           Stream& stream) = 0;
  // Blocks the calling thread until every rank has called Barrier (not a
  // stream operation). One rank: returns at once. Backends without one
  // (NCCL here) return NotSupported for several ranks.
  virtual Status Barrier() {
    if (world_size() == 1) return Status::Ok();
    return NotSupportedError("Communicator::Barrier: not supported by this backend");
  }
  // The first failure of enqueued collective work so far (Ok if none). Only
  // work the streams have already run is covered: synchronize the stream
  // first. Backends whose failures are all synchronous return Ok.
  virtual Status AsyncError() { return Status::Ok(); }
};

// CUDA device + NCCL build: an NCCL communicator (rank 0 creates the unique
// id). libnccl.so.2 is opened (dlopen) at the first one; when it cannot be
// (missing, or no room under RLIMIT_AS: logged once), one rank gets the local
// communicator and several ranks fail with Unavailable or ResourceExhausted
// naming the library and dlerror(). Host device: one rank → a local
// communicator whose collectives are copies on the stream; several ranks →
// Gloo over TCP (gloo_comm.cc). Otherwise NotSupported.
StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(Device& device,
                                                           const CommOptions& options);

// ---- PCIe benchmark (strata bench pcie, bench/bench_pcie.cc) -------------------------

struct PcieBenchOptions {
  std::vector<size_t> sizes;               // bytes per transfer; empty = 64 KiB..1 GiB ×4
  int repetitions = 5;                     // interleaved; medians reported
  size_t chunk_bytes = 4 << 20;            // the engine path's pinned-pool buffer size
  size_t pool_chunks = 8;                  // how many such buffers the engine path cycles through
  size_t min_bytes_per_sample = 64 << 20;  // small sizes repeat until this many bytes moved
};

struct PciePoint {
  size_t bytes = 0;
  // Medians, GB/s (1e9 bytes/s).
  double h2d_pinned = 0, d2h_pinned = 0, h2d_pageable = 0, d2h_pageable = 0;
  double bidir = 0;                       // H2D and D2H of `bytes` each at once: aggregate
  double h2d_engine = 0, d2h_engine = 0;  // chunked through the pinned pool
};

struct PcieBenchReport {
  std::string device;        // Describe()
  bool host_pinned = false;  // false: page-locking was refused (pageable fallback)
  std::vector<PciePoint> points;
  double h2d_pinned_peak = 0, d2h_pinned_peak = 0, bidir_peak = 0, h2d_pageable_peak = 0;
  // min over sizes ≥ 64 MiB (or the largest size if none) of engine/raw, per
  // direction and overall.
  double engine_vs_raw_h2d = 0, engine_vs_raw_d2h = 0, engine_path_vs_raw = 0;
};

// Needs 2 × max(sizes) of arena and 4 × max(sizes) of host memory.
StatusOr<PcieBenchReport> RunPcieBench(Device& device, const PcieBenchOptions& options);
// Default sweep: 64 KiB, 256 KiB, ..., 1 GiB.
std::vector<size_t> DefaultPcieSizes();

}  // namespace strata::gpu
