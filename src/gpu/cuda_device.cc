// CudaDevice: the Device interface on the CUDA runtime (see device.h).
//
// The arena is one cudaMalloc of the budget, sub-allocated by Arena (no
// cudaMalloc/cudaFree — which synchronize the device — on the hot path).
// compute, h2d and d2h are separate non-blocking streams, so both copy
// directions and kernels can run at once on GPUs with two copy engines.
// Events are created with cudaEventDisableTiming (cheapest to record/wait)
// unless EventOptions::timing asks for timestamps (ElapsedSeconds).
// Host waits block instead of spinning a core: every event is created with
// cudaEventBlockingSync, and Stream::Synchronize records a per-stream
// blocking event and waits on it. The gradient worker and the engine thread
// wait on events and streams while CPU Adam wants every core; with CUDA's
// default schedule (cudaDeviceScheduleAuto spins when there are fewer
// contexts than cores) each of those waits would keep a core busy. The
// process-wide alternative, cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync),
// is not used: it applies to the primary context that the framework (PyTorch)
// shares with Strata and usually creates first, so it would change how the
// framework's own synchronizations wait too — a policy a library should not
// set for its host. Device::Synchronize (cudaDeviceSynchronize, off the step
// path: checkpoints, parameter writes) keeps the context's schedule.
// cudaStreamWaitEvent and cudaEventQuery are unaffected by the flag.
// Every kernel is loaded at creation (cuda::LoadKernels): with CUDA's default
// lazy loading, the first launch of a kernel may synchronize the context, so
// a first launch while a stream is held by a host function that waits for
// the launching thread never returns (StreamsRunConcurrently and
// EventMayBeDestroyedWhileRecordAndWaitAreQueued hung on an H100 that way:
// they launched FillInt32 for the first time in exactly that state).
// Every CUDA error becomes a Status naming the call (CudaStatus below).
//
// This file is compiled only when the build has CUDA (STRATA_HAVE_CUDA);
// cuda_stub.cc provides the factories otherwise.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <type_traits>

#include "src/common/aligned_buffer.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/gpu/arena.h"
#include "src/gpu/cuda_kernels.h"
#include "src/gpu/cuda_status.h"
#include "src/gpu/device.h"
#include "src/gpu/host_kernels.h"

namespace strata::gpu {
namespace {

// The one place cudaError_t becomes a Status. REQUIRES: err != cudaSuccess.
// It also clears the calling thread's last-error state (cudaGetLastError):
// the runtime keeps a failed call's error there until read, and every kernel
// launcher returns cudaGetLastError() after its launch, so an error that was
// converted here — a cudaHostRegister that failed and was tolerated (pinned
// pool fallback, unpinned host arrays) — would otherwise come back as the
// next launch's failure. Sticky errors (a corrupted context) are not cleared
// by it and keep failing every call, as they must.
Status CudaError(cudaError_t err, std::string_view call) {
  std::string msg =
      fmt::format("{}: {} ({})", call, cudaGetErrorString(err), cudaGetErrorName(err));
  (void)cudaGetLastError();
  switch (err) {
    case cudaErrorMemoryAllocation:
      return ResourceExhaustedError(std::move(msg));
    case cudaErrorNoDevice:
      return UnavailableError(std::move(msg));
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return FailedPreconditionError(std::move(msg));
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
      return InvalidArgumentError(std::move(msg));
    case cudaErrorNotSupported:
      return NotSupportedError(std::move(msg));
    case cudaErrorHostMemoryAlreadyRegistered:
    case cudaErrorHostMemoryNotRegistered:
      return FailedPreconditionError(std::move(msg));
    default:
      return IOError(std::move(msg));
  }
}

// OK for cudaSuccess; otherwise CudaError naming the call. `call` is a string
// or a callable returning one, evaluated only on error (the hot path builds
// no strings).
template <typename Call>
Status CudaStatus(cudaError_t err, Call&& call) {
  if (err == cudaSuccess) [[likely]]
    return Status::Ok();
  if constexpr (std::is_invocable_v<Call>) {
    return CudaError(err, call());
  } else {
    return CudaError(err, std::string_view(call));
  }
}

#define CUDA_RETURN_IF_ERROR(call) RETURN_IF_ERROR(CudaStatus((call), #call))

class CudaEvent final : public Event {
 public:
  CudaEvent(int device, cudaEvent_t e, bool timing) : device_(device), event_(e), timing_(timing) {}
  ~CudaEvent() override {
    cudaSetDevice(device_);
    cudaEventDestroy(event_);
  }
  cudaEvent_t get() const { return event_; }
  bool timing() const override { return timing_; }
  bool recorded() const { return recorded_.load(std::memory_order_acquire); }
  void set_recorded() { recorded_.store(true, std::memory_order_release); }

  StatusOr<bool> Query() override {
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    return CudaStatus(err, "cudaEventQuery");
  }
  Status Synchronize() override {
    return CudaStatus(cudaEventSynchronize(event_), "cudaEventSynchronize");
  }

 private:
  const int device_;
  cudaEvent_t event_;
  const bool timing_;
  std::atomic<bool> recorded_{false};
};

void HostFuncTrampoline(void* arg) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
  (*fn)();
}

class CudaStream final : public Stream {
 public:
  CudaStream(int device, cudaStream_t s, cudaEvent_t drained, std::string name)
      : device_(device), stream_(s), drained_(drained), name_(std::move(name)) {}
  ~CudaStream() override {
    cudaSetDevice(device_);
    cudaEventDestroy(drained_);
    cudaStreamDestroy(stream_);  // queued work still completes
  }
  cudaStream_t get() const { return stream_; }
  const std::string& name() const override { return name_; }
  void* native_handle() const override { return stream_; }

  Status Record(Event& event) override {
    auto* e = dynamic_cast<CudaEvent*>(&event);
    if (e == nullptr) return InvalidArgumentError("Stream::Record: event is not a CUDA event");
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(e->get(), stream_),
                               [&] { return "cudaEventRecord on stream " + name_; }));
    e->set_recorded();
    return Status::Ok();
  }
  Status Wait(Event& event) override {
    auto* e = dynamic_cast<CudaEvent*>(&event);
    if (e == nullptr) return InvalidArgumentError("Stream::Wait: event is not a CUDA event");
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return CudaStatus(cudaStreamWaitEvent(stream_, e->get(), 0),
                      [&] { return "cudaStreamWaitEvent on stream " + name_; });
  }
  Status EnqueueHostCallback(std::function<void()> fn) override {
    if (!fn) return InvalidArgumentError("Stream::EnqueueHostCallback: empty function");
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    auto* heap = new std::function<void()>(std::move(fn));
    const cudaError_t err = cudaLaunchHostFunc(stream_, HostFuncTrampoline, heap);
    if (err != cudaSuccess) delete heap;  // never runs: free it here
    return CudaStatus(err, [&] { return "cudaLaunchHostFunc on stream " + name_; });
  }
  // Blocks (does not spin) until the work enqueued before the call is done:
  // records drained_ (cudaEventBlockingSync) and waits on it. Concurrent
  // callers may re-record it; each then waits for a later record, which
  // completes after its own work.
  Status Synchronize() override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(drained_, stream_),
                               [&] { return "cudaEventRecord(drain) on stream " + name_; }));
    return CudaStatus(cudaEventSynchronize(drained_),
                      [&] { return "Synchronize(" + name_ + "): cudaEventSynchronize"; });
  }
  StatusOr<bool> Query() override {
    const cudaError_t err = cudaStreamQuery(stream_);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    return CudaStatus(err, [&] { return "cudaStreamQuery(" + name_ + ")"; });
  }

 private:
  const int device_;
  cudaStream_t stream_;
  cudaEvent_t drained_;  // blocking-sync event of Synchronize
  const std::string name_;
};

// Every event: host waits on it block (see the file comment).
constexpr unsigned kEventFlags = cudaEventBlockingSync;

StatusOr<std::unique_ptr<CudaStream>> NewStream(int device, const std::string& name) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaEvent_t e = nullptr;
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, kEventFlags | cudaEventDisableTiming));
  cudaStream_t s = nullptr;
  if (Status st = CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                             "cudaStreamCreateWithFlags");
      !st.ok()) {
    cudaEventDestroy(e);
    return st;
  }
  return std::make_unique<CudaStream>(device, s, e, name);
}

class CudaDevice final : public Device {
 public:
  CudaDevice(std::unique_ptr<Arena> arena, int id, std::string name, int sms)
      : Device(/*is_host=*/false, std::move(arena)), id_(id), name_(std::move(name)), sms_(sms) {}
  ~CudaDevice() override {
    Synchronize().IgnoreError();  // let queued work that uses the arena finish
    compute_.reset();
    h2d_.reset();
    d2h_.reset();
  }
  Status Init() {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(id_));
    RETURN_IF_ERROR(CudaStatus(cuda::LoadKernels(), "loading the device layer's kernels"));
    ASSIGN_OR_RETURN(compute_, NewStream(id_, "compute"));
    ASSIGN_OR_RETURN(h2d_, NewStream(id_, "h2d"));
    ASSIGN_OR_RETURN(d2h_, NewStream(id_, "d2h"));
    return Status::Ok();
  }

  int ordinal() const override { return id_; }
  std::string Describe() const override { return fmt::format("cuda:{} ({})", id_, name_); }

  StatusOr<std::unique_ptr<Stream>> CreateStream(const std::string& name) override {
    ASSIGN_OR_RETURN(auto s, NewStream(id_, name));
    return std::unique_ptr<Stream>(std::move(s));
  }
  StatusOr<std::unique_ptr<Event>> CreateEvent(EventOptions options) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(id_));
    cudaEvent_t e = nullptr;
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(
        &e, kEventFlags | (options.timing ? cudaEventDefault : cudaEventDisableTiming)));
    return std::unique_ptr<Event>(std::make_unique<CudaEvent>(id_, e, options.timing));
  }
  StatusOr<double> ElapsedSeconds(Event& start, Event& end) override {
    auto* s = dynamic_cast<CudaEvent*>(&start);
    auto* e = dynamic_cast<CudaEvent*>(&end);
    if (s == nullptr || e == nullptr)
      return InvalidArgumentError("ElapsedSeconds: event is not a CUDA event");
    for (auto [ev, which] : {std::pair{s, "start"}, std::pair{e, "end"}}) {
      if (!ev->timing())
        return FailedPreconditionError(fmt::format(
            "ElapsedSeconds: the {} event was created without timing (EventOptions::timing)",
            which));
      if (!ev->recorded())
        return FailedPreconditionError(
            fmt::format("ElapsedSeconds: the {} event was never recorded", which));
    }
    float ms = 0;
    const cudaError_t err = cudaEventElapsedTime(&ms, s->get(), e->get());
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not a failure: clear it (see CudaError)
      return UnavailableError("ElapsedSeconds: an event's latest record has not completed");
    }
    RETURN_IF_ERROR(CudaStatus(err, "cudaEventElapsedTime"));
    return static_cast<double>(ms) * 1e-3;
  }
  Status Synchronize() override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(id_));
    return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }

  Status CopyH2D(void* dev, const void* host, size_t bytes, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(dev, bytes, "CopyH2D destination"));
    RETURN_IF_ERROR(CheckHost(host, bytes, "CopyH2D source"));
    return Memcpy(dev, host, bytes, cudaMemcpyHostToDevice, stream, "CopyH2D");
  }
  Status CopyD2H(void* host, const void* dev, size_t bytes, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(dev, bytes, "CopyD2H source"));
    RETURN_IF_ERROR(CheckHost(host, bytes, "CopyD2H destination"));
    return Memcpy(host, dev, bytes, cudaMemcpyDeviceToHost, stream, "CopyD2H");
  }
  Status CopyD2D(void* dst, const void* src, size_t bytes, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(dst, bytes, "CopyD2D destination"));
    RETURN_IF_ERROR(CheckDev(src, bytes, "CopyD2D source"));
    RETURN_IF_ERROR(CheckNoPartialOverlap(dst, src, bytes));
    if (dst == src) return Status::Ok();
    return Memcpy(dst, src, bytes, cudaMemcpyDeviceToDevice, stream, "CopyD2D");
  }

  Status Cast(const void* src, DType st, void* dst, DType dt, size_t n, Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(src, n, st, "Cast source"));
    RETURN_IF_ERROR(CheckElems(dst, n, dt, "Cast destination"));
    const char* s = static_cast<const char*>(src);
    const char* d = static_cast<const char*>(dst);
    const bool overlap = s < d + n * DTypeSize(dt) && d < s + n * DTypeSize(st);
    if (overlap && !(s == d && DTypeSize(st) == DTypeSize(dt)))
      return InvalidArgumentError(
          fmt::format("Cast: source and destination overlap ({} elements)", n));
    if (st == dt) {
      if (src == dst || n == 0) return Status::Ok();
      return Memcpy(dst, src, n * DTypeSize(st), cudaMemcpyDeviceToDevice, stream, "Cast (copy)");
    }
    ASSIGN_OR_RETURN(cudaStream_t cs, Prepare(stream, "Cast"));
    return CudaStatus(cuda::LaunchCast(src, st, dst, dt, n, MaxBlocks(), cs), [&] {
      return fmt::format("Cast {}→{} kernel launch ({} elements)", DTypeName(st), DTypeName(dt), n);
    });
  }
  Status UnscaleAndCheck(void* x, DType t, size_t n, float inv_scale, int32_t* found_inf,
                         Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(x, n, t, "UnscaleAndCheck input"));
    RETURN_IF_ERROR(
        CheckDev(found_inf, sizeof(int32_t), "UnscaleAndCheck found_inf", alignof(int32_t)));
    ASSIGN_OR_RETURN(cudaStream_t cs, Prepare(stream, "UnscaleAndCheck"));
    return CudaStatus(
        cuda::LaunchUnscaleAndCheck(x, t, n, inv_scale, found_inf, MaxBlocks(), cs), [&] {
          return fmt::format("UnscaleAndCheck {} kernel launch ({} elements)", DTypeName(t), n);
        });
  }
  Status SumSquares(const void* x, DType t, size_t n, double* sum, Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(x, n, t, "SumSquares input"));
    RETURN_IF_ERROR(CheckDev(sum, sizeof(double), "SumSquares sum", alignof(double)));
    ASSIGN_OR_RETURN(cudaStream_t cs, Prepare(stream, "SumSquares"));
    return CudaStatus(cuda::LaunchSumSquares(x, t, n, sum, MaxBlocks(), cs), [&] {
      return fmt::format("SumSquares {} kernel launch ({} elements)", DTypeName(t), n);
    });
  }
  Status Fill(void* x, DType t, size_t n, float value, Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(x, n, t, "Fill"));
    ASSIGN_OR_RETURN(cudaStream_t cs, Prepare(stream, "Fill"));
    return CudaStatus(cuda::LaunchFill(x, t, n, value, MaxBlocks(), cs), "Fill kernel launch");
  }
  Status FillInt32(int32_t* x, size_t n, int32_t value, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(x, n > SIZE_MAX / 4 ? SIZE_MAX : n * sizeof(int32_t), "FillInt32",
                             alignof(int32_t)));
    ASSIGN_OR_RETURN(cudaStream_t cs, Prepare(stream, "FillInt32"));
    return CudaStatus(cuda::LaunchFillInt32(x, n, value, MaxBlocks(), cs),
                      "FillInt32 kernel launch");
  }
  Status AddToFp32(float* acc, const void* x, DType t, size_t n, Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(acc, n, DType::kFp32, "AddToFp32 accumulator"));
    RETURN_IF_ERROR(CheckElems(x, n, t, "AddToFp32 input"));
    ASSIGN_OR_RETURN(cudaStream_t cs, Prepare(stream, "AddToFp32"));
    return CudaStatus(cuda::LaunchAddToFp32(acc, x, t, n, MaxBlocks(), cs), [&] {
      return fmt::format("AddToFp32 {} kernel launch ({} elements)", DTypeName(t), n);
    });
  }
  Status FillDouble(double* x, size_t n, double value, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(x, n > SIZE_MAX / 8 ? SIZE_MAX : n * sizeof(double), "FillDouble",
                             alignof(double)));
    ASSIGN_OR_RETURN(cudaStream_t cs, Prepare(stream, "FillDouble"));
    return CudaStatus(cuda::LaunchFillDouble(x, n, value, MaxBlocks(), cs),
                      "FillDouble kernel launch");
  }

  Status AdamStep(std::span<const AdamShard> shards, const AdamHyperParams& hp,
                  const int32_t* skip_if_set, Stream& stream) override {
    RETURN_IF_ERROR(CheckAdam(shards, hp, skip_if_set));
    ASSIGN_OR_RETURN(cudaStream_t cs, Prepare(stream, "AdamStep"));
    const host::AdamCoeffs c = host::MakeAdamCoeffs(hp);
    // One multi-tensor launch per (grad dtype, copy-out dtype, state format)
    // group, in the order the groups first appear (groups touch disjoint
    // shards).
    struct Group {
      DType grad;
      bool copy;
      DType copy_dtype;
      AdamStates states;
      std::vector<cuda::AdamTensor> tensors;
      std::vector<cuda::AdamCompactTensor> compact;
    };
    std::vector<Group> groups;
    for (const AdamShard& sh : shards) {
      if (sh.count == 0) continue;
      const bool copy = sh.copy_out != nullptr;
      const DType cd = copy ? sh.copy_dtype : DType::kFp32;
      const AdamStates f = AdamShardStates(sh);
      auto g = std::find_if(groups.begin(), groups.end(), [&](const Group& x) {
        return x.grad == sh.grad_dtype && x.copy == copy && x.copy_dtype == cd && x.states == f;
      });
      if (g == groups.end())
        g = groups.insert(groups.end(), Group{sh.grad_dtype, copy, cd, f, {}, {}});
      switch (f) {
        case AdamStates::kFp32:
          g->tensors.push_back(
              {sh.param, sh.grad, sh.exp_avg, sh.exp_avg_sq, sh.copy_out, sh.count});
          break;
        case AdamStates::kBf16:
          g->tensors.push_back(
              {sh.param, sh.grad, sh.exp_avg_bf16, sh.exp_avg_sq_bf16, sh.copy_out, sh.count});
          break;
        case AdamStates::kBf16Master:
          g->compact.push_back({sh.param_bf16, sh.grad, sh.exp_avg_bf16, sh.exp_avg_sq_bf16,
                                nullptr, nullptr, sh.copy_out, sh.count, sh.index0});
          break;
        case AdamStates::kInt8:
          g->compact.push_back({sh.param, sh.grad, sh.exp_avg_q8, sh.exp_avg_sq_q8,
                                sh.exp_avg_scale, sh.exp_avg_sq_scale, sh.copy_out, sh.count,
                                sh.index0});
          break;
      }
    }
    static constexpr const char* kStates[] = {"fp32", "bf16", "bf16-master", "int8"};
    size_t vec = 0, total = 0;
    for (const Group& g : groups) {
      const bool compact = g.states == AdamStates::kBf16Master || g.states == AdamStates::kInt8;
      const size_t n = compact ? g.compact.size() : g.tensors.size();
      total += n;
      const cudaError_t err =
          compact ? cuda::LaunchAdamCompact(g.compact.data(), n, g.states == AdamStates::kInt8,
                                            g.grad, g.copy, g.copy_dtype, c, skip_if_set, cs)
                  : cuda::LaunchAdam(g.tensors.data(), n, g.grad, g.copy, g.copy_dtype,
                                     g.states == AdamStates::kBf16, c, skip_if_set, cs, &vec);
      RETURN_IF_ERROR(CudaStatus(err, [&] {
        return fmt::format("AdamStep kernel launch ({} tensors, grad {}, copy {}, states {})", n,
                           DTypeName(g.grad), g.copy ? DTypeName(g.copy_dtype) : "none",
                           kStates[static_cast<int>(g.states)]);
      }));
    }
    CountAdamPaths(vec, total - vec);
    return Status::Ok();
  }

  Status PinHostMemory(void* p, size_t bytes) override {
    RETURN_IF_ERROR(CheckHost(p, bytes, "PinHostMemory"));
    CUDA_RETURN_IF_ERROR(cudaSetDevice(id_));
    return CudaStatus(cudaHostRegister(p, bytes, cudaHostRegisterPortable),
                      [&] { return fmt::format("cudaHostRegister({})", FormatBytes(bytes)); });
  }
  Status UnpinHostMemory(void* p, size_t bytes) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(id_));
    return CudaStatus(cudaHostUnregister(p), "cudaHostUnregister");
  }

 private:
  // Sets this device current on the calling thread and unwraps the stream.
  StatusOr<cudaStream_t> Prepare(Stream& stream, const char* what) {
    auto* s = dynamic_cast<CudaStream*>(&stream);
    if (s == nullptr)
      return InvalidArgumentError(std::string(what) + ": stream does not belong to a CUDA device");
    CUDA_RETURN_IF_ERROR(cudaSetDevice(id_));
    return s->get();
  }
  Status Memcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, Stream& stream,
                const char* what) {
    if (bytes == 0) return Status::Ok();
    ASSIGN_OR_RETURN(cudaStream_t cs, Prepare(stream, what));
    return CudaStatus(cudaMemcpyAsync(dst, src, bytes, kind, cs), [&] {
      return fmt::format("{}: cudaMemcpyAsync({}) on stream {}", what, FormatBytes(bytes),
                         stream.name());
    });
  }
  int MaxBlocks() const { return sms_ * 16; }  // a few waves of 256-thread blocks

  const int id_;
  const std::string name_;
  const int sms_;
};

// "16.0 GT/s PCIe" → 4.
int PcieGenFromSpeed(const std::string& s) {
  const double gts = std::atof(s.c_str());
  if (gts >= 60) return 6;
  if (gts >= 30) return 5;
  if (gts >= 15) return 4;
  if (gts >= 7.5) return 3;
  if (gts >= 4.5) return 2;
  if (gts >= 2) return 1;
  return 0;
}

std::string ReadSysfs(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

}  // namespace

namespace internal {
Status CudaErrorToStatus(int err, std::string_view call) {
  return CudaStatus(static_cast<cudaError_t>(err), call);
}

CudaPresence ClassifyCudaPresence(int err, int count, int driver_version) {
  if (err == cudaSuccess) return count > 0 ? CudaPresence::kPresent : CudaPresence::kNoDevice;
  if (err == cudaErrorNoDevice) return CudaPresence::kNoDevice;
  if (err == cudaErrorInsufficientDriver && driver_version == 0) return CudaPresence::kNoDevice;
  return CudaPresence::kUnusable;
}
}  // namespace internal

namespace {
// "13.0" from 13000; "none" for 0 (no driver library).
std::string CudaVersionString(int v) {
  return v == 0 ? std::string("none") : fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

// The driver and runtime versions, for errors about a GPU that is there but
// cannot be used.
std::string CudaVersions() {
  int driver = 0, runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  (void)cudaGetLastError();
  if (driver == 0)
    return fmt::format("no NVIDIA driver is installed, the runtime is CUDA {}",
                       CudaVersionString(runtime));
  return fmt::format("the driver supports CUDA {}, the runtime is CUDA {}",
                     CudaVersionString(driver), CudaVersionString(runtime));
}

StatusOr<std::unique_ptr<Device>> CreatePresentCudaDevice(const DeviceOptions& options, int count);
}  // namespace

StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const DeviceOptions& options) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  (void)cudaGetLastError();  // a failed probe must not fail a later launch
  switch (internal::ClassifyCudaPresence(err, count, driver)) {
    case internal::CudaPresence::kNoDevice:
      // Unavailable: the one answer device=auto falls back on.
      return UnavailableError(err == cudaSuccess
                                  ? std::string("no CUDA device: cudaGetDeviceCount returned 0")
                                  : fmt::format("no CUDA device: cudaGetDeviceCount: {} ({}); {}",
                                                cudaGetErrorString(err), cudaGetErrorName(err),
                                                CudaVersions()));
    case internal::CudaPresence::kUnusable:
      return FailedPreconditionError(fmt::format(
          "a CUDA GPU or driver is present but unusable: cudaGetDeviceCount: {} ({}); {}. "
          "Install a driver that supports this runtime (or the CUDA forward-compatibility "
          "package), or set strata.device to \"host\" to run on the CPU on purpose",
          cudaGetErrorString(err), cudaGetErrorName(err), CudaVersions()));
    case internal::CudaPresence::kPresent:
      break;
  }
  auto d = CreatePresentCudaDevice(options, count);
  // A device exists: no failure from here on may read as "no device" (which
  // would let device=auto fall back to the host).
  if (!d.ok() && d.status().code() == StatusCode::kUnavailable)
    return FailedPreconditionError(fmt::format("{}; {}", d.status().message(), CudaVersions()));
  return d;
}

namespace {
StatusOr<std::unique_ptr<Device>> CreatePresentCudaDevice(const DeviceOptions& options, int count) {
  if (options.device_id < 0 || options.device_id >= count)
    return InvalidArgumentError(
        fmt::format("strata.device_id: {} but this machine has {} CUDA "
                    "device(s) (0..{})",
                    options.device_id, count, count - 1));
  const int id = options.device_id;
  CUDA_RETURN_IF_ERROR(cudaSetDevice(id));
  cudaDeviceProp prop{};
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, id));
  size_t free_b = 0, total_b = 0;
  CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
  size_t budget = options.hbm_budget_bytes;
  if (budget == 0) {
    // All free memory less a headroom for the context, cuBLAS workspaces and
    // the framework's own allocations.
    const size_t headroom = std::min<size_t>(size_t{1} << 30, free_b / 20);
    budget = free_b > headroom ? free_b - headroom : 0;
    budget = AlignDown(budget, size_t{2} << 20);
  } else if (budget > free_b) {
    return ResourceExhaustedError(
        fmt::format("strata.hbm_budget_bytes is {} but cuda:{} has {} free (of {})",
                    FormatBytes(budget), id, FormatBytes(free_b), FormatBytes(total_b)));
  }
  // An explicit budget follows the rule the host device uses too, so a plan
  // lays out (and fragments) the same arena on both backends.
  budget = ArenaBudgetBytes(budget);
  if (budget == 0)
    return ResourceExhaustedError(fmt::format(
        "cuda:{}: no device memory left for the arena ({} free)", id, FormatBytes(free_b)));
  void* base = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&base, budget),
                             fmt::format("cudaMalloc of the HBM arena ({})", FormatBytes(budget))));
  auto arena =
      std::make_unique<Arena>(base, budget, fmt::format("HBM arena (cuda:{})", id), [id, base] {
        cudaSetDevice(id);
        cudaFree(base);
      });
  auto device = std::make_unique<CudaDevice>(std::move(arena), id, prop.name,
                                             std::max(1, prop.multiProcessorCount));
  RETURN_IF_ERROR(device->Init());
  STRATA_LOG_INFO("device {}: arena {} of {} free", device->Describe(), FormatBytes(budget),
                  FormatBytes(free_b));
  return std::unique_ptr<Device>(std::move(device));
}
}  // namespace

CudaDeviceList ListCudaDevices() {
  CudaDeviceList list;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    list.reason =
        fmt::format("{} ({}); {}", cudaGetErrorString(err), cudaGetErrorName(err), CudaVersions());
    return list;
  }
  if (count == 0) list.reason = "no CUDA device";
  int previous = 0;
  cudaGetDevice(&previous);
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    CudaDeviceInfo info;
    info.ordinal = i;
    info.name = prop.name;
    info.total_bytes = prop.totalGlobalMem;
    info.cc_major = prop.major;
    info.cc_minor = prop.minor;
    info.multiprocessors = prop.multiProcessorCount;
    info.pci_bus_id =
        fmt::format("{:04x}:{:02x}:{:02x}.0", prop.pciDomainID, prop.pciBusID, prop.pciDeviceID);
    const std::string sys = "/sys/bus/pci/devices/" + info.pci_bus_id + "/";
    info.pcie_gen = PcieGenFromSpeed(ReadSysfs(sys + "current_link_speed"));
    info.pcie_width = std::atoi(ReadSysfs(sys + "current_link_width").c_str());
    if (const std::string n = ReadSysfs(sys + "numa_node"); !n.empty())
      info.numa_node = std::atoi(n.c_str());
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
      info.free_bytes = free_b;
    list.devices.push_back(std::move(info));
  }
  cudaSetDevice(previous);
  return list;
}

}  // namespace strata::gpu
