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
// The arena is an mmap(MAP_NORESERVE) reservation of the budget: untouched
// pages cost nothing. With a link model, each direction is a virtual pipe: a
// copy occupies it for latency + bytes / bandwidth (after the memcpy the
// stream thread sleeps until the copy's modelled end).
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <set>
#include <thread>

#include "src/common/aligned_buffer.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/gpu/arena.h"
#include "src/gpu/device.h"
#include "src/gpu/host_kernels.h"

namespace strata::gpu {
namespace {

// An event's state, shared with the stream ops that reference it so that an
// event may be destroyed while a Record or Wait on it is still queued (CUDA
// allows that too).
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;       // GUARDED_BY(mu) the latest record (0 = never)
  std::set<uint64_t> pending;  // GUARDED_BY(mu) records not yet completed

  // Called by Stream::Record on the enqueueing thread.
  uint64_t BeginRecord() {
    std::lock_guard<std::mutex> lock(mu);
    pending.insert(++recorded);
    return recorded;
  }
  uint64_t Latest() {
    std::lock_guard<std::mutex> lock(mu);
    return recorded;
  }
  // Called on the stream thread when the recorded work is done.
  void Complete(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu);
    pending.erase(seq);
    cv.notify_all();
  }
  // Blocks until record `seq` has completed (records on different streams
  // may complete out of order, hence a set rather than a counter).
  void WaitFor(uint64_t seq) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return pending.count(seq) == 0; });
  }
};

class HostEvent final : public Event {
 public:
  const std::shared_ptr<EventState>& state() const { return state_; }

  StatusOr<bool> Query() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->pending.count(state_->recorded) == 0;
  }
  Status Synchronize() override {
    state_->WaitFor(state_->Latest());
    return Status::Ok();
  }

 private:
  std::shared_ptr<EventState> state_ = std::make_shared<EventState>();
};

class HostDevice;

class HostStream final : public Stream {
 public:
  HostStream(HostDevice* device, std::string name);
  ~HostStream() override;

  const std::string& name() const override { return name_; }
  void* native_handle() const override { return nullptr; }

  // Appends `op` to the queue; it runs on this stream's thread.
  void Enqueue(std::function<void()> op) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(op));
      ++enqueued_;
    }
    cv_.notify_all();
  }

  Status Record(Event& event) override {
    auto* e = dynamic_cast<HostEvent*>(&event);
    if (e == nullptr)
      return InvalidArgumentError("Stream::Record: event is not a HostDevice event");
    std::shared_ptr<EventState> st = e->state();
    const uint64_t seq = st->BeginRecord();
    Enqueue([st, seq] { st->Complete(seq); });
    return Status::Ok();
  }
  Status Wait(Event& event) override {
    auto* e = dynamic_cast<HostEvent*>(&event);
    if (e == nullptr) return InvalidArgumentError("Stream::Wait: event is not a HostDevice event");
    std::shared_ptr<EventState> st = e->state();
    const uint64_t seq = st->Latest();
    if (seq == 0) return Status::Ok();  // never recorded: nothing to wait for
    Enqueue([st, seq] { st->WaitFor(seq); });
    return Status::Ok();
  }
  Status EnqueueHostCallback(std::function<void()> fn) override {
    if (!fn) return InvalidArgumentError("Stream::EnqueueHostCallback: empty function");
    Enqueue(std::move(fn));
    return Status::Ok();
  }
  Status Synchronize() override {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = enqueued_;
    done_cv_.wait(lock, [&] { return completed_ >= target; });
    return Status::Ok();
  }
  StatusOr<bool> Query() override {
    std::lock_guard<std::mutex> lock(mu_);
    return completed_ >= enqueued_;
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      op();
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++completed_;
      }
      done_cv_.notify_all();
    }
  }

  HostDevice* device_;
  const std::string name_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::function<void()>> queue_;  // GUARDED_BY(mu_)
  uint64_t enqueued_ = 0, completed_ = 0;    // GUARDED_BY(mu_)
  bool stop_ = false;                        // GUARDED_BY(mu_)
  std::thread thread_;                       // started last, in the constructor
};

class HostDevice final : public Device {
 public:
  HostDevice(std::unique_ptr<Arena> arena, const DeviceOptions& o)
      : Device(/*is_host=*/true, std::move(arena)),
        link_bytes_per_ns_(o.link_gbytes_per_s > 0 ? o.link_gbytes_per_s : 0.0),
        link_latency_ns_(static_cast<int64_t>(o.link_latency_us * 1e3)) {}

  void Init() {
    compute_ = std::make_unique<HostStream>(this, "compute");
    h2d_ = std::make_unique<HostStream>(this, "h2d");
    d2h_ = std::make_unique<HostStream>(this, "d2h");
  }
  ~HostDevice() override {
    // Drain and join the device's own streams before the arena goes.
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
    return std::unique_ptr<Stream>(std::make_unique<HostStream>(this, name));
  }
  StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::unique_ptr<Event>(std::make_unique<HostEvent>());
  }
  Status Synchronize() override {
    std::vector<HostStream*> streams;
    {
      std::lock_guard<std::mutex> lock(streams_mu_);
      streams.assign(streams_.begin(), streams_.end());
    }
    // A stream destroyed meanwhile drained its work in its destructor; the
    // registry lock is not held while waiting so destruction cannot deadlock,
    // hence re-check membership under the lock per stream.
    for (HostStream* s : streams) {
      std::lock_guard<std::mutex> lock(streams_mu_);
      if (streams_.count(s)) RETURN_IF_ERROR(s->Synchronize());
    }
    return Status::Ok();
  }

  Status CopyH2D(void* dev, const void* host, size_t bytes, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(dev, bytes, "CopyH2D destination"));
    RETURN_IF_ERROR(CheckHost(host, bytes, "CopyH2D source"));
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "CopyH2D"));
    s->Enqueue(
        [this, dev, host, bytes, t = NowNanos()] { LinkCopy(dev, host, bytes, Dir::kH2D, t); });
    return Status::Ok();
  }
  Status CopyD2H(void* host, const void* dev, size_t bytes, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(dev, bytes, "CopyD2H source"));
    RETURN_IF_ERROR(CheckHost(host, bytes, "CopyD2H destination"));
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "CopyD2H"));
    s->Enqueue(
        [this, host, dev, bytes, t = NowNanos()] { LinkCopy(host, dev, bytes, Dir::kD2H, t); });
    return Status::Ok();
  }
  Status CopyD2D(void* dst, const void* src, size_t bytes, Stream& stream) override {
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
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "Cast"));
    s->Enqueue([=] { host::Cast(src, st, dst, dt, n); });
    return Status::Ok();
  }
  Status UnscaleAndCheck(void* x, DType t, size_t n, float inv_scale, int32_t* found_inf,
                         Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(x, n, t, "UnscaleAndCheck input"));
    RETURN_IF_ERROR(
        CheckDev(found_inf, sizeof(int32_t), "UnscaleAndCheck found_inf", alignof(int32_t)));
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "UnscaleAndCheck"));
    s->Enqueue([=] {
      if (host::UnscaleAndCheck(x, t, n, inv_scale)) *found_inf = 1;
    });
    return Status::Ok();
  }
  Status SumSquares(const void* x, DType t, size_t n, double* sum, Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(x, n, t, "SumSquares input"));
    RETURN_IF_ERROR(CheckDev(sum, sizeof(double), "SumSquares sum", alignof(double)));
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "SumSquares"));
    s->Enqueue([=] { *sum += host::SumSquares(x, t, n); });
    return Status::Ok();
  }
  Status Fill(void* x, DType t, size_t n, float value, Stream& stream) override {
    RETURN_IF_ERROR(CheckElems(x, n, t, "Fill"));
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "Fill"));
    s->Enqueue([=] { host::Fill(x, t, n, value); });
    return Status::Ok();
  }
  Status FillInt32(int32_t* x, size_t n, int32_t value, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(x, n > SIZE_MAX / 4 ? SIZE_MAX : n * sizeof(int32_t), "FillInt32",
                             alignof(int32_t)));
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "FillInt32"));
    s->Enqueue([=] { std::fill(x, x + n, value); });
    return Status::Ok();
  }
  Status FillDouble(double* x, size_t n, double value, Stream& stream) override {
    RETURN_IF_ERROR(CheckDev(x, n > SIZE_MAX / 8 ? SIZE_MAX : n * sizeof(double), "FillDouble",
                             alignof(double)));
    ASSIGN_OR_RETURN(HostStream * s, AsHost(stream, "FillDouble"));
    s->Enqueue([=] { std::fill(x, x + n, value); });
    return Status::Ok();
  }

  Status PinHostMemory(void* p, size_t bytes) override {
    RETURN_IF_ERROR(CheckHost(p, bytes, "PinHostMemory"));
    if (mlock(p, bytes) != 0) {
      const int err = errno;
      const MemlockLimit lim = ReadMemlockLimit();
      return ErrnoError(fmt::format("mlock of {} (RLIMIT_MEMLOCK soft {})", FormatBytes(bytes),
                                    lim.soft_unlimited ? "unlimited" : FormatBytes(lim.soft_bytes)),
                        err);
    }
    return Status::Ok();
  }
  Status UnpinHostMemory(void* p, size_t bytes) override {
    if (munlock(p, bytes) != 0) return ErrnoError(fmt::format("munlock of {} bytes", bytes), errno);
    return Status::Ok();
  }

  void Register(HostStream* s) {
    std::lock_guard<std::mutex> lock(streams_mu_);
    streams_.insert(s);
  }
  void Unregister(HostStream* s) {
    std::lock_guard<std::mutex> lock(streams_mu_);
    streams_.erase(s);
  }

 private:
  StatusOr<HostStream*> AsHost(Stream& stream, const char* what) {
    auto* s = dynamic_cast<HostStream*>(&stream);
    if (s == nullptr)
      return InvalidArgumentError(std::string(what) + ": stream does not belong to a HostDevice");
    return s;
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
  // is one virtual pipe per direction: a copy starts when it was enqueued or
  // when the previous copy in that direction finished on the link, whichever
  // is later, so back-to-back copies run at the modelled rate even when a
  // sleep overshoots (the overshoot is absorbed, not accumulated).
  enum class Dir { kH2D, kD2H };
  void LinkCopy(void* dst, const void* src, size_t bytes, Dir dir, int64_t enqueued_ns) {
    std::memcpy(dst, src, bytes);
    if (link_bytes_per_ns_ <= 0 && link_latency_ns_ <= 0) return;
    int64_t need = link_latency_ns_;
    if (link_bytes_per_ns_ > 0) need += static_cast<int64_t>(bytes / link_bytes_per_ns_);
    int64_t end;
    {
      std::lock_guard<std::mutex> lock(link_mu_);
      int64_t& free_at = dir == Dir::kH2D ? h2d_free_ns_ : d2h_free_ns_;
      end = std::max(free_at, enqueued_ns) + need;
      free_at = end;
    }
    const int64_t left = end - NowNanos();
    if (left > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(left));
  }

  const double link_bytes_per_ns_;  // GB/s == bytes per ns
  const int64_t link_latency_ns_;
  std::mutex link_mu_;
  int64_t h2d_free_ns_ = 0, d2h_free_ns_ = 0;  // GUARDED_BY(link_mu_) link busy until
  std::mutex streams_mu_;
  std::set<HostStream*> streams_;  // GUARDED_BY(streams_mu_)
};

HostStream::HostStream(HostDevice* device, std::string name)
    : device_(device), name_(std::move(name)) {
  device_->Register(this);
  thread_ = std::thread([this] { Run(); });
}

HostStream::~HostStream() {
  device_->Unregister(this);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();  // runs what is still queued first, like cudaStreamDestroy
}

}  // namespace

StatusOr<std::unique_ptr<Device>> CreateHostDevice(const DeviceOptions& options) {
  if (options.link_gbytes_per_s < 0 || options.link_latency_us < 0)
    return InvalidArgumentError(fmt::format(
        "host device: link model must be non-negative (link_gbytes_per_s {}, link_latency_us {})",
        options.link_gbytes_per_s, options.link_latency_us));
  const size_t budget = AlignUp(
      options.hbm_budget_bytes == 0 ? kDefaultHostHbmBudget : options.hbm_budget_bytes, 4096);
  void* base = mmap(nullptr, budget, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED)
    return ErrnoError(fmt::format("host device: reserving an arena of {}", FormatBytes(budget)),
                      errno);
  auto arena = std::make_unique<Arena>(base, budget, "HBM arena (host device)",
                                       [base, budget] { munmap(base, budget); });
  auto device = std::make_unique<HostDevice>(std::move(arena), options);
  device->Init();
  return std::unique_ptr<Device>(std::move(device));
}

}  // namespace strata::gpu
