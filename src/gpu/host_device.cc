// HostDevice: the Device interface on host memory (see device.h).
//
// Each stream is an ordered queue served by one thread of its own, so the H2D
// and D2H copy streams and the compute stream really run concurrently, like a
// GPU's copy engines and SMs. An event numbers its records: Record takes the
// next number, marks it pending and enqueues an op that clears it; a Wait
// enqueues an op that blocks its stream's thread until the record that was
// the latest when Wait was called is no longer pending. Waits only ever refer to
// records issued earlier, so no cycle (and no deadlock) can form — the same
// argument as for CUDA.
//
// Host functions do not run on the stream threads: a stream thread hands its
// host function to the device's one callback thread (CallbackThread) and
// waits for it, as a CUDA stream waits for the driver's callback thread. All
// blocking calls wait through CallbackThread::Await, which reports a wait
// that cannot end because a host function is stuck (see device.h).
//
// The arena is an mmap(MAP_NORESERVE) reservation of the budget: untouched
// pages cost nothing. With a link model, each direction is a virtual pipe: a
// copy occupies it for latency + bytes / bandwidth (after the memcpy the
// stream thread sleeps until the copy's modelled end).
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <system_error>
#include <thread>

#include "src/common/aligned_buffer.h"
#include "src/common/host_memory.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/thread_annotations.h"
#include "src/common/timer.h"
#include "src/gpu/arena.h"
#include "src/gpu/comm_internal.h"
#include "src/gpu/device.h"
#include "src/gpu/host_kernels.h"

namespace strata::gpu {
namespace {

// The running host function's flag on the callback thread (null elsewhere):
// internal::HostFunctionWaitsOnPeers sets it.
thread_local std::atomic<bool>* t_waits_on_peers = nullptr;

// The device's one host-function thread. Stream threads hand it their host
// functions (Run) in the order they reach them; it runs them one at a time.
// Blocking calls wait through Await, which knows whether a host function is
// stuck and so can tell a deadlock from a long wait.
class CallbackThread {
 public:
  explicit CallbackThread(double deadlock_timeout_s)
      : deadlock_ns_(static_cast<int64_t>(deadlock_timeout_s * 1e9)), thread_([this] { Loop(); }) {}
  ~CallbackThread() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    thread_.join();
  }

  // Runs `fn` on the callback thread after the host functions handed over
  // before it; returns when it has returned. Called on a stream thread.
  void Run(std::function<void()>& fn, const std::string& stream) EXCLUDES(mu_) {
    Job job{&fn, &stream};
    MutexLock lock(&mu_);
    queue_.push_back(&job);
    cv_.NotifyAll();
    while (!job.done) done_cv_.Wait(&mu_);
  }

  // FailedPrecondition when called from a host function (CUDA forbids
  // runtime calls there: cudaErrorNotPermitted, or a hang).
  Status CheckNotInHostFunction(std::string_view what) const {
    if (std::this_thread::get_id() != thread_.get_id()) [[likely]]
      return Status::Ok();
    return FailedPreconditionError(
        fmt::format("{}: called from a host function; CUDA forbids device calls in host "
                    "functions (cudaErrorNotPermitted)",
                    what));
  }

  // Waits on `cv` (with *mu held, as for CondVar::Wait) until `done()`. A
  // wait that has lasted the deadlock timeout while a host function has been
  // running at least as long returns FailedPrecondition naming the deadlock;
  // any other wait goes on until done. `done` runs with *mu held: callers
  // annotate it REQUIRES(*mu), and the analysis checks its body there (it
  // cannot follow a callable's contract into this template, hence
  // NO_THREAD_SAFETY_ANALYSIS here).
  template <typename Pred>
  Status Await(Mutex* mu, CondVar& cv, Pred done, std::string_view what) REQUIRES(mu)
      EXCLUDES(mu_) NO_THREAD_SAFETY_ANALYSIS {
    if (deadlock_ns_ <= 0) {
      while (!done()) cv.Wait(mu);
      return Status::Ok();
    }
    const int64_t start = NowNanos();
    const auto poll = std::chrono::nanoseconds(std::min<int64_t>(deadlock_ns_ / 4, 50'000'000));
    while (!done()) {
      cv.WaitFor(mu, poll);
      if (done()) break;
      const int64_t waited = NowNanos() - start;
      if (waited < deadlock_ns_) continue;
      std::string stream;
      const int64_t stuck = StuckFor(&stream);
      if (stuck >= deadlock_ns_)
        return FailedPreconditionError(fmt::format(
            "deadlock: {} has waited {:.1f} s while a host function on stream '{}' has been "
            "running for {:.1f} s. The device's host functions run one at a time on one thread "
            "(as CUDA's driver thread may run them), and the work waited for is queued behind "
            "it; a host function that waits for this thread never returns, and on a GPU this "
            "call would hang",
            what, waited / 1e9, stream, stuck / 1e9));
    }
    return Status::Ok();
  }

 private:
  struct Job {
    std::function<void()>* fn;
    const std::string* stream;
    bool done = false;  // guarded by CallbackThread::mu_
    // Set by the host function itself (HostFunctionWaitsOnPeers).
    std::atomic<bool> waits_on_peers{false};
  };

  // How long the running host function has been running (0: none, or one
  // that waits on other processes: internal::HostFunctionWaitsOnPeers), and
  // on which stream.
  int64_t StuckFor(std::string* stream) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (running_ == nullptr || running_->waits_on_peers.load(std::memory_order_relaxed)) return 0;
    *stream = *running_->stream;
    return NowNanos() - running_since_ns_;
  }

  void Loop() EXCLUDES(mu_) {
    for (;;) {
      Job* job;
      {
        MutexLock lock(&mu_);
        while (!stop_ && queue_.empty()) cv_.Wait(&mu_);
        if (queue_.empty()) return;  // stop_ and drained
        job = queue_.front();
        queue_.pop_front();
        running_ = job;
        running_since_ns_ = NowNanos();
      }
      t_waits_on_peers = &job->waits_on_peers;
      (*job->fn)();
      t_waits_on_peers = nullptr;
      MutexLock lock(&mu_);
      job->done = true;
      running_ = nullptr;
      done_cv_.NotifyAll();
    }
  }

  const int64_t deadlock_ns_;
  Mutex mu_;
  CondVar cv_, done_cv_;
  std::deque<Job*> queue_ GUARDED_BY(mu_);
  Job* running_ GUARDED_BY(mu_) = nullptr;
  int64_t running_since_ns_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started in the constructor
};

// An event's state, shared with the stream ops that reference it so that an
// event may be destroyed while a Record or Wait on it is still queued (CUDA
// allows that too).
struct EventState {
  Mutex mu;
  CondVar cv;
  uint64_t recorded GUARDED_BY(mu) = 0;       // the latest record (0 = never)
  std::set<uint64_t> pending GUARDED_BY(mu);  // records not yet completed
  int64_t latest_done_ns GUARDED_BY(mu) = 0;  // when the latest record completed

  // Called by Stream::Record on the enqueueing thread.
  uint64_t BeginRecord() EXCLUDES(mu) {
    MutexLock lock(&mu);
    pending.insert(++recorded);
    return recorded;
  }
  uint64_t Latest() EXCLUDES(mu) {
    MutexLock lock(&mu);
    return recorded;
  }
  // Called on the stream thread when the recorded work is done.
  void Complete(uint64_t seq) EXCLUDES(mu) {
    const int64_t now = NowNanos();
    MutexLock lock(&mu);
    pending.erase(seq);
    if (seq == recorded) latest_done_ns = now;
    cv.NotifyAll();
  }
  // Blocks until record `seq` has completed (records on different streams
  // may complete out of order, hence a set rather than a counter). Only for
  // stream threads; callers' threads use Await.
  void WaitFor(uint64_t seq) EXCLUDES(mu) {
    MutexLock lock(&mu);
    while (pending.count(seq) != 0) cv.Wait(&mu);
  }
};

class HostEvent final : public Event {
 public:
  HostEvent(CallbackThread* callbacks, bool timing) : callbacks_(callbacks), timing_(timing) {}
  const std::shared_ptr<EventState>& state() const { return state_; }
  bool timing() const override { return timing_; }

  StatusOr<bool> Query() override {
    MutexLock lock(&state_->mu);
    return state_->pending.count(state_->recorded) == 0;
  }
  Status Synchronize() override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("Event::Synchronize"));
    EventState* st = state_.get();
    MutexLock lock(&st->mu);
    const uint64_t seq = st->recorded;
    return callbacks_->Await(
        &st->mu, st->cv, [&]() REQUIRES(st->mu) { return st->pending.count(seq) == 0; },
        "Event::Synchronize");
  }
  // The completion time of the latest record, or the reason there is none.
  StatusOr<int64_t> CompletedAt(const char* which) {
    MutexLock lock(&state_->mu);
    if (!timing_)
      return FailedPreconditionError(fmt::format(
          "ElapsedSeconds: the {} event was created without timing (EventOptions::timing)", which));
    if (state_->recorded == 0)
      return FailedPreconditionError(
          fmt::format("ElapsedSeconds: the {} event was never recorded", which));
    if (state_->pending.count(state_->recorded))
      return UnavailableError(
          fmt::format("ElapsedSeconds: the {} event's latest record has not completed", which));
    return state_->latest_done_ns;
  }

 private:
  CallbackThread* const callbacks_;
  const bool timing_;
  std::shared_ptr<EventState> state_ = std::make_shared<EventState>();
};

class HostDevice;

class HostStream final : public Stream {
 public:
  HostStream(HostDevice* device, CallbackThread* callbacks, std::string name);
  ~HostStream() override;

  const std::string& name() const override { return name_; }
  void* native_handle() const override { return nullptr; }

  // Appends `op` to the queue; it runs on this stream's thread.
  void Enqueue(std::function<void()> op) EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      queue_.push_back(std::move(op));
      ++enqueued_;
    }
    cv_.NotifyAll();
  }

  // Enqueues `op` and waits until it has run (a pageable copy): the caller
  // is blocked by the stream's earlier work, as on CUDA. If the wait is a
  // deadlock (see CallbackThread::Await), `op` is withdrawn — it will not run
  // after this returns — and the deadlock is returned.
  Status EnqueueAndWait(std::function<void()> op, std::string_view what) {
    struct Sync {
      Mutex mu;
      CondVar cv;
      bool cancelled GUARDED_BY(mu) = false;
      bool running GUARDED_BY(mu) = false;
      bool done GUARDED_BY(mu) = false;
    };
    auto sync = std::make_shared<Sync>();
    Enqueue([sync, op = std::move(op)] {
      {
        MutexLock lock(&sync->mu);
        if (sync->cancelled) return;
        sync->running = true;
      }
      op();
      MutexLock lock(&sync->mu);
      sync->done = true;
      sync->cv.NotifyAll();
    });
    Sync* y = sync.get();
    MutexLock lock(&y->mu);
    Status s = callbacks_->Await(
        &y->mu, y->cv, [&]() REQUIRES(y->mu) { return y->done; }, what);
    if (s.ok()) return s;
    if (!y->running) {
      y->cancelled = true;
      return s;
    }
    while (!y->done) y->cv.Wait(&y->mu);  // it started meanwhile: finish it
    return Status::Ok();
  }

  Status Record(Event& event) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("Stream::Record"));
    auto* e = dynamic_cast<HostEvent*>(&event);
    if (e == nullptr)
      return InvalidArgumentError("Stream::Record: event is not a HostDevice event");
    std::shared_ptr<EventState> st = e->state();
    const uint64_t seq = st->BeginRecord();
    Enqueue([st, seq] { st->Complete(seq); });
    return Status::Ok();
  }
  Status Wait(Event& event) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("Stream::Wait"));
    auto* e = dynamic_cast<HostEvent*>(&event);
    if (e == nullptr) return InvalidArgumentError("Stream::Wait: event is not a HostDevice event");
    std::shared_ptr<EventState> st = e->state();
    const uint64_t seq = st->Latest();
    if (seq == 0) return Status::Ok();  // never recorded: nothing to wait for
    Enqueue([this, st, seq] {
      st->WaitFor(seq);
      held_until_ns_ = NowNanos();
    });
    return Status::Ok();
  }
  Status EnqueueHostCallback(std::function<void()> fn) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("Stream::EnqueueHostCallback"));
    if (!fn) return InvalidArgumentError("Stream::EnqueueHostCallback: empty function");
    // The stream waits here until the callback thread has run `fn`.
    Enqueue([this, fn = std::move(fn)]() mutable {
      callbacks_->Run(fn, name_);
      held_until_ns_ = NowNanos();
    });
    return Status::Ok();
  }
  Status Synchronize() override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("Stream::Synchronize"));
    MutexLock lock(&mu_);
    const uint64_t target = enqueued_;
    return callbacks_->Await(
        &mu_, done_cv_, [&]() REQUIRES(mu_) { return completed_ >= target; },
        fmt::format("Stream::Synchronize({})", name_));
  }
  StatusOr<bool> Query() override {
    MutexLock lock(&mu_);
    return completed_ >= enqueued_;
  }

  // When the stream was last released from a hold (an event wait or a host
  // function): work after it cannot have started earlier. The stream's
  // thread only (its ops).
  int64_t held_until_ns() const { return held_until_ns_; }

 private:
  void Run() EXCLUDES(mu_) {
    for (;;) {
      std::function<void()> op;
      {
        MutexLock lock(&mu_);
        while (!stop_ && queue_.empty()) cv_.Wait(&mu_);
        if (queue_.empty()) return;  // stop_ and drained
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      op();
      {
        MutexLock lock(&mu_);
        ++completed_;
      }
      done_cv_.NotifyAll();
    }
  }

  HostDevice* device_;
  CallbackThread* const callbacks_;
  const std::string name_;
  Mutex mu_;
  CondVar cv_, done_cv_;
  std::deque<std::function<void()>> queue_ GUARDED_BY(mu_);
  uint64_t enqueued_ GUARDED_BY(mu_) = 0;
  uint64_t completed_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  int64_t held_until_ns_ = 0;  // the stream's thread only
  std::thread thread_;         // started last, in the constructor
};

class HostDevice final : public Device {
 public:
  HostDevice(std::unique_ptr<Arena> arena, const DeviceOptions& o)
      : Device(/*is_host=*/true, std::move(arena)),
        link_bytes_per_ns_(o.link_gbytes_per_s > 0 ? o.link_gbytes_per_s : 0.0),
        link_latency_ns_(static_cast<int64_t>(o.link_latency_us * 1e3)),
        callbacks_(std::make_unique<CallbackThread>(o.host_deadlock_timeout_s)) {
    // CudaDevice loads its kernels at creation; the lazy model is for tests.
    for (auto& k : loaded_) k.store(!o.host_lazy_kernel_loading);
  }

  void Init() {
    compute_ = std::make_unique<HostStream>(this, callbacks_.get(), "compute");
    h2d_ = std::make_unique<HostStream>(this, callbacks_.get(), "h2d");
    d2h_ = std::make_unique<HostStream>(this, callbacks_.get(), "d2h");
  }
  ~HostDevice() override {
    // Drain and join the device's own streams before the arena and the
    // callback thread go.
    compute_.reset();
    h2d_.reset();
    d2h_.reset();
  }

  int ordinal() const override { return -1; }
  std::string Describe() const override {
    if (link_bytes_per_ns_ > 0 || link_latency_ns_ > 0)
      return fmt::format("host (link model {:.1f} GB/s, {:.1f} us)", link_bytes_per_ns_,
                         link_latency_ns_ / 1e3);
    return "host";
  }

  StatusOr<std::unique_ptr<Stream>> CreateStream(const std::string& name) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("CreateStream"));
    try {
      return std::unique_ptr<Stream>(std::make_unique<HostStream>(this, callbacks_.get(), name));
    } catch (const std::system_error& e) {  // its thread could not start
      return ResourceExhaustedError(
          fmt::format("host device: cannot start the thread of stream '{}': {}", name, e.what()));
    }
  }
  StatusOr<std::unique_ptr<Event>> CreateEvent(EventOptions options) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("CreateEvent"));
    return std::unique_ptr<Event>(std::make_unique<HostEvent>(callbacks_.get(), options.timing));
  }
  StatusOr<double> ElapsedSeconds(Event& start, Event& end) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("ElapsedSeconds"));
    auto* s = dynamic_cast<HostEvent*>(&start);
    auto* e = dynamic_cast<HostEvent*>(&end);
    if (s == nullptr || e == nullptr)
      return InvalidArgumentError("ElapsedSeconds: event is not a HostDevice event");
    ASSIGN_OR_RETURN(const int64_t t0, s->CompletedAt("start"));
    ASSIGN_OR_RETURN(const int64_t t1, e->CompletedAt("end"));
    return static_cast<double>(t1 - t0) * 1e-9;
  }
  Status Synchronize() override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("Device::Synchronize"));
    std::vector<HostStream*> streams;
    {
      MutexLock lock(&streams_mu_);
      streams.assign(streams_.begin(), streams_.end());
    }
    // A stream destroyed meanwhile drained its work in its destructor; the
    // registry lock is not held while waiting so destruction cannot deadlock,
    // hence re-check membership under the lock per stream.
    for (HostStream* s : streams) {
      MutexLock lock(&streams_mu_);
      if (streams_.count(s)) RETURN_IF_ERROR(s->Synchronize());
    }
    return Status::Ok();
  }

  Status CopyH2D(void* dev, const void* host, size_t bytes, Stream& stream) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("CopyH2D"));
    RETURN_IF_ERROR(CheckDev(dev, bytes, "CopyH2D destination"));
    RETURN_IF_ERROR(CheckHost(host, bytes, "CopyH2D source"));
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "CopyH2D"));
    if (bytes == 0) return Status::Ok();
    auto op = [this, s, dev, host, bytes, t = NowNanos()] {
      LinkCopy(dev, host, bytes, Dir::kH2D, std::max(t, s->held_until_ns()));
    };
    if (IsPinned(host, bytes)) {
      s->Enqueue(op);
      return Status::Ok();
    }
    return s->EnqueueAndWait(
        op, fmt::format("CopyH2D from pageable memory ({} bytes on stream {})", bytes, s->name()));
  }
  Status CopyD2H(void* host, const void* dev, size_t bytes, Stream& stream) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("CopyD2H"));
    RETURN_IF_ERROR(CheckDev(dev, bytes, "CopyD2H source"));
    RETURN_IF_ERROR(CheckHost(host, bytes, "CopyD2H destination"));
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "CopyD2H"));
    if (bytes == 0) return Status::Ok();
    auto op = [this, s, host, dev, bytes, t = NowNanos()] {
      LinkCopy(host, dev, bytes, Dir::kD2H, std::max(t, s->held_until_ns()));
    };
    if (IsPinned(host, bytes)) {
      s->Enqueue(op);
      return Status::Ok();
    }
    return s->EnqueueAndWait(
        op, fmt::format("CopyD2H to pageable memory ({} bytes on stream {})", bytes, s->name()));
  }
  Status CopyD2D(void* dst, const void* src, size_t bytes, Stream& stream) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("CopyD2D"));
    RETURN_IF_ERROR(CheckDev(dst, bytes, "CopyD2D destination"));
    RETURN_IF_ERROR(CheckDev(src, bytes, "CopyD2D source"));
    RETURN_IF_ERROR(CheckNoPartialOverlap(dst, src, bytes));
    if (dst == src) return Status::Ok();
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "CopyD2D"));
    s->Enqueue([dst, src, bytes] { std::memmove(dst, src, bytes); });
    return Status::Ok();
  }

  Status Cast(const void* src, DType st, void* dst, DType dt, size_t n, Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(src, n, st, "Cast source"));
    RETURN_IF_ERROR(CheckElems(dst, n, dt, "Cast destination"));
    RETURN_IF_ERROR(CheckCastOverlap(src, st, dst, dt, n));
    if (st == dt) {  // CudaDevice copies instead of launching a kernel
      if (src == dst || n == 0) return Status::Ok();
      ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "Cast"));
      RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("Cast"));
      s->Enqueue([=] { std::memmove(dst, src, n * DTypeSize(st)); });
      return Status::Ok();
    }
    ASSIGN_OR_RETURN(HostStream * s, Launch(stream, Kernel::kCast, "Cast"));
    s->Enqueue([=] { host::Cast(src, st, dst, dt, n); });
    return Status::Ok();
  }
  Status UnscaleAndCheck(void* x, DType t, size_t n, float inv_scale, int32_t* found_inf,
                         Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(x, n, t, "UnscaleAndCheck input"));
    RETURN_IF_ERROR(
        CheckDev(found_inf, sizeof(int32_t), "UnscaleAndCheck found_inf", alignof(int32_t)));
    ASSIGN_OR_RETURN(HostStream * s, Launch(stream, Kernel::kUnscale, "UnscaleAndCheck"));
    s->Enqueue([=] {
      if (host::UnscaleAndCheck(x, t, n, inv_scale)) *found_inf = 1;
    });
    return Status::Ok();
  }
  Status SumSquares(const void* x, DType t, size_t n, double* sum, Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(x, n, t, "SumSquares input"));
    RETURN_IF_ERROR(CheckDev(sum, sizeof(double), "SumSquares sum", alignof(double)));
    ASSIGN_OR_RETURN(HostStream * s, Launch(stream, Kernel::kSumSquares, "SumSquares"));
    s->Enqueue([=] { *sum += host::SumSquares(x, t, n); });
    return Status::Ok();
  }
  Status Fill(void* x, DType t, size_t n, float value, Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(x, n, t, "Fill"));
    ASSIGN_OR_RETURN(HostStream * s, Launch(stream, Kernel::kFill, "Fill"));
    s->Enqueue([=] { host::Fill(x, t, n, value); });
    return Status::Ok();
  }
  Status FillInt32(int32_t* x, size_t n, int32_t value, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(x, n > SIZE_MAX / 4 ? SIZE_MAX : n * sizeof(int32_t), "FillInt32",
                             alignof(int32_t)));
    ASSIGN_OR_RETURN(HostStream * s, Launch(stream, Kernel::kFillInt32, "FillInt32"));
    s->Enqueue([=] { std::fill(x, x + n, value); });
    return Status::Ok();
  }
  Status AddToFp32(float* acc, const void* x, DType t, size_t n, Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(acc, n, DType::kFp32, "AddToFp32 accumulator"));
    RETURN_IF_ERROR(CheckElems(x, n, t, "AddToFp32 input"));
    ASSIGN_OR_RETURN(HostStream * s, Launch(stream, Kernel::kAddToFp32, "AddToFp32"));
    s->Enqueue([=] {
      for (size_t i = 0; i < n; ++i) acc[i] += LoadAsFloat(x, t, i);
    });
    return Status::Ok();
  }
  Status FillDouble(double* x, size_t n, double value, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(x, n > SIZE_MAX / 8 ? SIZE_MAX : n * sizeof(double), "FillDouble",
                             alignof(double)));
    ASSIGN_OR_RETURN(HostStream * s, Launch(stream, Kernel::kFillDouble, "FillDouble"));
    s->Enqueue([=] { std::fill(x, x + n, value); });
    return Status::Ok();
  }
  Status AdamStep(std::span<const AdamShard> shards, const AdamHyperParams& hp,
                  const int32_t* skip_if_set, Stream& stream) override {
    RETURN_IF_ERROR(CheckAdam(shards, hp, skip_if_set));
    ASSIGN_OR_RETURN(HostStream * s, Launch(stream, Kernel::kAdam, "AdamStep"));
    std::vector<AdamShard> copy;
    for (const AdamShard& sh : shards)
      if (sh.count > 0) copy.push_back(sh);
    if (copy.empty()) return Status::Ok();
    const auto vec = static_cast<uint64_t>(std::count_if(
        copy.begin(), copy.end(), [](const AdamShard& sh) { return AdamShardVectorizable(sh); }));
    CountAdamPaths(vec, copy.size() - vec);
    s->Enqueue([copy = std::move(copy), c = host::MakeAdamCoeffs(hp), skip_if_set] {
      if (skip_if_set != nullptr && *skip_if_set != 0) return;
      for (const AdamShard& sh : copy) host::AdamStep(sh, c);
    });
    return Status::Ok();
  }

  Status PinHostMemory(void* p, size_t bytes) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("PinHostMemory"));
    RETURN_IF_ERROR(CheckHost(p, bytes, "PinHostMemory"));
    if (mlock(p, bytes) != 0) {
      const int err = errno;
      const MemlockLimit lim = ReadMemlockLimit();
      return ErrnoError(fmt::format("mlock of {} (RLIMIT_MEMLOCK soft {})", FormatBytes(bytes),
                                    lim.soft_unlimited ? "unlimited" : FormatBytes(lim.soft_bytes)),
                        err);
    }
    MutexLock lock(&pinned_mu_);
    pinned_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return Status::Ok();
  }
  Status UnpinHostMemory(void* p, size_t bytes) override {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction("UnpinHostMemory"));
    {
      MutexLock lock(&pinned_mu_);
      pinned_.erase(reinterpret_cast<uintptr_t>(p));
    }
    if (munlock(p, bytes) != 0) return ErrnoError(fmt::format("munlock of {} bytes", bytes), errno);
    return Status::Ok();
  }

  void Register(HostStream* s) {
    MutexLock lock(&streams_mu_);
    streams_.insert(s);
  }
  void Unregister(HostStream* s) {
    MutexLock lock(&streams_mu_);
    streams_.erase(s);
  }

 private:
  // The kernels whose loading is modelled (host_lazy_kernel_loading).
  enum class Kernel {
    kCast,
    kUnscale,
    kSumSquares,
    kFill,
    kFillInt32,
    kFillDouble,
    kAdam,
    kAddToFp32,
    kCount
  };

  StatusOr<HostStream*> AsHost(Stream& stream, const char* what) {
    auto* s = dynamic_cast<HostStream*>(&stream);
    if (s == nullptr)
      return InvalidArgumentError(std::string(what) + ": stream does not belong to a HostDevice");
    return s;
  }
  // The checks every kernel launch makes, and the lazy-loading model: the
  // first launch of a kernel synchronizes the device, as loading a module
  // may on CUDA.
  StatusOr<HostStream*> Launch(Stream& stream, Kernel k, const char* what) {
    RETURN_IF_ERROR(callbacks_->CheckNotInHostFunction(what));
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, what));
    std::atomic<bool>& loaded = loaded_[static_cast<int>(k)];
    if (!loaded.load(std::memory_order_acquire)) {
      Status st = Synchronize();
      if (!st.ok())
        return Status(st.code(), fmt::format("{}: loading the kernel (first launch; lazy loading "
                                             "synchronizes the device): {}",
                                             what, st.message()));
      loaded.store(true, std::memory_order_release);
    }
    return s;
  }
  // True if [p, p+bytes) lies inside one range registered with PinHostMemory.
  bool IsPinned(const void* p, size_t bytes) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    MutexLock lock(&pinned_mu_);
    auto it = pinned_.upper_bound(a);
    if (it == pinned_.begin()) return false;
    --it;
    return a - it->first <= it->second && bytes <= it->second - (a - it->first);
  }
  static Status CheckCastOverlap(const void* src, DType st, void* dst, DType dt, size_t n) {
    const char* s = static_cast<const char*>(src);
    const char* d = static_cast<const char*>(dst);
    const size_t sb = n * DTypeSize(st), db = n * DTypeSize(dt);
    const bool overlap = s < d + db && d < s + sb;
    if (overlap && !(s == d && DTypeSize(st) == DTypeSize(dt)))
      return InvalidArgumentError(
          fmt::format("Cast: source and destination overlap ({} {} elements at {} → {} at {})", n,
                      DTypeName(st), src, DTypeName(dt), dst));
    return Status::Ok();
  }

  // memcpy, then sleep out what the modelled link would still need. The link
  // is one virtual pipe per direction: a copy starts when it is ready (it was
  // enqueued, and its stream was released from any event wait or host
  // function before it, as a GPU copy engine would start it) or when the
  // previous copy in that direction finished on the link, whichever is
  // later, so back-to-back copies run at the modelled rate even when a sleep
  // overshoots (the overshoot is absorbed, not accumulated), and a copy held
  // up on its stream still takes the modelled time once it runs.
  enum class Dir { kH2D, kD2H };
  void LinkCopy(void* dst, const void* src, size_t bytes, Dir dir, int64_t ready_ns) {
    std::memcpy(dst, src, bytes);
    if (link_bytes_per_ns_ <= 0 && link_latency_ns_ <= 0) return;
    int64_t need = link_latency_ns_;
    if (link_bytes_per_ns_ > 0) need += static_cast<int64_t>(bytes / link_bytes_per_ns_);
    int64_t end;
    {
      MutexLock lock(&link_mu_);
      int64_t& free_at = dir == Dir::kH2D ? h2d_free_ns_ : d2h_free_ns_;
      end = std::max(free_at, ready_ns) + need;
      free_at = end;
    }
    const int64_t left = end - NowNanos();
    if (left > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(left));
  }

  const double link_bytes_per_ns_;  // GB/s == bytes per ns
  const int64_t link_latency_ns_;
  Mutex link_mu_;
  int64_t h2d_free_ns_ GUARDED_BY(link_mu_) = 0;  // the link is busy until
  int64_t d2h_free_ns_ GUARDED_BY(link_mu_) = 0;
  Mutex streams_mu_;
  std::set<HostStream*> streams_ GUARDED_BY(streams_mu_);
  Mutex pinned_mu_;
  std::map<uintptr_t, size_t> pinned_ GUARDED_BY(pinned_mu_);  // PinHostMemory ranges
  std::atomic<bool> loaded_[static_cast<int>(Kernel::kCount)];
  // Outlives the streams (they hand it their host functions): the
  // destructor's body joins the streams before members are destroyed.
  std::unique_ptr<CallbackThread> callbacks_;
};

HostStream::HostStream(HostDevice* device, CallbackThread* callbacks, std::string name)
    : device_(device), callbacks_(callbacks), name_(std::move(name)) {
  device_->Register(this);
  try {
    thread_ = std::thread([this] { Run(); });
  } catch (...) {  // no destructor runs: undo the registration
    device_->Unregister(this);
    throw;
  }
}

HostStream::~HostStream() {
  device_->Unregister(this);
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  thread_.join();  // runs what is still queued first, like cudaStreamDestroy
}

}  // namespace

namespace internal {

void HostFunctionWaitsOnPeers() {
  if (t_waits_on_peers != nullptr) t_waits_on_peers->store(true, std::memory_order_relaxed);
}

}  // namespace internal

StatusOr<std::unique_ptr<Device>> CreateHostDevice(const DeviceOptions& options) {
  if (options.link_gbytes_per_s < 0 || options.link_latency_us < 0)
    return InvalidArgumentError(fmt::format(
        "host device: link model must be non-negative (link_gbytes_per_s {}, link_latency_us {})",
        options.link_gbytes_per_s, options.link_latency_us));
  if (!(options.host_deadlock_timeout_s >= 0))
    return InvalidArgumentError(
        fmt::format("host device: host_deadlock_timeout_s must be >= 0 (0 = never), got {}",
                    options.host_deadlock_timeout_s));
  // The same budget rule as CudaDevice (ArenaBudgetBytes), so both lay out
  // the same arena; the mapping itself is whole pages.
  const size_t budget = ArenaBudgetBytes(options.hbm_budget_bytes == 0 ? kDefaultHostHbmBudget
                                                                       : options.hbm_budget_bytes);
  if (budget == 0)
    return ResourceExhaustedError(
        fmt::format("host device: an HBM budget of {} bytes is less than one {}-byte block",
                    options.hbm_budget_bytes, kDeviceAlignment));
  const size_t mapped = AlignUp(budget, 4096);
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED)
    return ErrnoError(fmt::format("host device: reserving an arena of {}", FormatBytes(budget)),
                      errno);
  auto arena = std::make_unique<Arena>(base, budget, "HBM arena (host device)",
                                       [base, mapped] { munmap(base, mapped); });
  // The callback thread and the three stream threads start here; a refused
  // thread (RLIMIT_NPROC, RLIMIT_AS) is a Status, the started ones joined.
  try {
    auto device = std::make_unique<HostDevice>(std::move(arena), options);
    device->Init();
    return std::unique_ptr<Device>(std::move(device));
  } catch (const std::system_error& e) {
    const std::string limits = ThreadStartLimits();
    return ResourceExhaustedError(fmt::format(
        "host device: cannot start its 4 threads (host functions, compute, h2d, d2h): {}{}{}",
        e.what(), limits.empty() ? "" : "; ", limits));
  }
}

}  // namespace strata::gpu
