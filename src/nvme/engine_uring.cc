// The io_uring engine (liburing): one or more rings, each with a reaper
// thread; fixed buffers and registered files; batched submission; SQPOLL as
// an option. Negative liburing returns (-errno) become Status here only.
//
// A failed io_uring_submit never takes the process down: the SQEs the kernel
// did not consume are taken back out of the SQ and their ops fail with the
// -errno (see Submit and ReclaimLocked).
#include <fmt/format.h>
#include <liburing.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
// The kernel carries an op from submitter to reaper; tell TSAN about that edge.
#define STRATA_TSAN_RELEASE(p) __tsan_release(p)
#define STRATA_TSAN_ACQUIRE(p) __tsan_acquire(p)
#else
#define STRATA_TSAN_RELEASE(p) ((void)0)
#define STRATA_TSAN_ACQUIRE(p) ((void)0)
#endif

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/thread_annotations.h"
#include "src/nvme/internal.h"
#include "src/nvme/nvme.h"

namespace strata::nvme {
namespace {

constexpr unsigned kFileSlots = 256;
constexpr uint64_t kExitTag = 0;         // user_data of the NOP that stops a reaper
constexpr int kSubmitAttempts = 100000;  // io_uring_submit tries per call on EAGAIN/EBUSY/EINTR

unsigned RoundUpPow2(unsigned v) {
  unsigned p = 1;
  while (p < v) p <<= 1;
  return p;
}

// RAII ring: io_uring_queue_exit on destruction.
struct Ring {
  io_uring ring{};
  bool live = false;
  Mutex sq_mu;  // guards the submission queue of `ring` (the reaper owns its CQ)
  std::thread reaper;
  // Set when the exit NOP could not be submitted: the reaper stops at its next
  // timed wake-up instead.
  std::atomic<bool> stop{false};
  ~Ring() {
    if (live) io_uring_queue_exit(&ring);
  }
};

class UringEngine final : public IoEngine {
 public:
  explicit UringEngine(const IoOptions& o) : options_(o) {}
  ~UringEngine() override { Shutdown(); }

  Status Init() {
    // The IoService keeps at most queue_depth × threads ops in flight over all
    // rings; sizing every SQ for that (and the CQ, 2× by default, above it)
    // means a ring's CQ never overflows even if round-robin piles ops on it.
    unsigned entries =
        RoundUpPow2(static_cast<unsigned>(std::max(options_.queue_depth * options_.threads, 8)));
    entries = std::min(entries, 4096u);
    for (int i = 0; i < options_.threads; ++i) {
      auto r = std::make_unique<Ring>();
      io_uring_params p;
      std::memset(&p, 0, sizeof(p));
      if (options_.sqpoll) {
        p.flags |= IORING_SETUP_SQPOLL;
        p.sq_thread_idle = 100;  // ms before the poller sleeps
      }
      int ret = io_uring_queue_init_params(entries, &r->ring, &p);
      if (ret < 0 && options_.sqpoll) {
        STRATA_WARN_ONCE("nvme.sqpoll_refused",
                         "nvme: io_uring SQPOLL refused ({}); using interrupt-driven submission",
                         std::strerror(-ret));
        std::memset(&p, 0, sizeof(p));
        ret = io_uring_queue_init_params(entries, &r->ring, &p);
      }
      if (ret < 0) return ErrnoError(fmt::format("io_uring_queue_init({} entries)", entries), -ret);
      r->live = true;
      features_ = p.features;
      sqpoll_ = (p.flags & IORING_SETUP_SQPOLL) != 0;
      rings_.push_back(std::move(r));
    }
    // Sparse file table so files can be added and removed as they open/close.
    files_ok_ = true;
    for (auto& r : rings_) {
      int ret = io_uring_register_files_sparse(&r->ring, kFileSlots);
      if (ret < 0) {
        files_ok_ = false;
        STRATA_INFO_ONCE("nvme.no_registered_files",
                         "nvme: io_uring registered files unavailable ({}); using plain fds",
                         std::strerror(-ret));
        break;
      }
    }
    {
      WriterMutexLock lock(&table_mu_);
      for (unsigned s = kFileSlots; s-- > 0;) free_slots_.push_back(static_cast<int>(s));
    }
    for (size_t i = 0; i < rings_.size(); ++i) {
      Ring* r = rings_[i].get();
      try {
        r->reaper = std::thread([this, r] { Reap(r); });
      } catch (const std::system_error& e) {
        // Shutdown (from the destructor) stops the reapers started so far.
        return ResourceExhaustedError(fmt::format(
            "io_uring engine: cannot start reaper thread {} of {} (aio.intra_op_parallelism): {}",
            i + 1, rings_.size(), e.what()));
      }
    }
    return Status::Ok();
  }

  EngineKind kind() const override { return EngineKind::kUring; }
  int parallelism() const override { return static_cast<int>(rings_.size()); }

  Status RegisterBuffers(std::span<const MemoryRegion> regions) override EXCLUDES(table_mu_) {
    WriterMutexLock lock(&table_mu_);
    if (inflight_.load() != 0) return FailedPreconditionError("RegisterBuffers: ops are in flight");
    for (auto& r : rings_) {
      if (!regions_.empty()) io_uring_unregister_buffers(&r->ring);
    }
    regions_.clear();
    if (regions.empty()) return Status::Ok();
    // io_uring caps one fixed buffer at 1 GiB: split larger regions.
    std::vector<iovec> iov;
    std::vector<Region> table;
    constexpr size_t kMax = size_t{1} << 30;
    for (const auto& m : regions) {
      if (m.data == nullptr || m.size == 0)
        return InvalidArgumentError("RegisterBuffers: empty region");
      for (size_t off = 0; off < m.size; off += kMax) {
        size_t n = std::min(kMax, m.size - off);
        char* p = static_cast<char*>(m.data) + off;
        iov.push_back({p, n});
        table.push_back({p, n});
      }
    }
    for (size_t i = 0; i < rings_.size(); ++i) {
      int ret = io_uring_register_buffers(&rings_[i]->ring, iov.data(),
                                          static_cast<unsigned>(iov.size()));
      if (ret < 0) {
        for (size_t j = 0; j < i; ++j) io_uring_unregister_buffers(&rings_[j]->ring);
        STRATA_WARN_ONCE("nvme.fixed_buffers_refused",
                         "nvme: io_uring refused {} fixed buffer(s) ({}; RLIMIT_MEMLOCK?); using "
                         "plain reads/writes",
                         iov.size(), std::strerror(-ret));
        return Status::Ok();
      }
    }
    regions_ = std::move(table);
    return Status::Ok();
  }

  Status RegisterFile(int fd) override EXCLUDES(table_mu_) {
    if (!files_ok_ || fd < 0) return Status::Ok();
    WriterMutexLock lock(&table_mu_);
    if (slot_of_.count(fd)) return Status::Ok();
    if (free_slots_.empty()) return Status::Ok();  // plain fd: still correct
    int slot = free_slots_.back();
    for (auto& r : rings_) {
      int ret = io_uring_register_files_update(&r->ring, static_cast<unsigned>(slot), &fd, 1);
      if (ret < 0) {
        int minus = -1;
        for (auto& q : rings_) {
          if (q.get() == r.get()) break;
          io_uring_register_files_update(&q->ring, static_cast<unsigned>(slot), &minus, 1);
        }
        STRATA_INFO_ONCE("nvme.file_register_failed", "nvme: registering a file failed ({})",
                         std::strerror(-ret));
        return Status::Ok();
      }
    }
    free_slots_.pop_back();
    slot_of_[fd] = slot;
    return Status::Ok();
  }

  void UnregisterFile(int fd) override EXCLUDES(table_mu_) {
    WriterMutexLock lock(&table_mu_);
    auto it = slot_of_.find(fd);
    if (it == slot_of_.end()) return;
    int minus = -1;
    for (auto& r : rings_)
      io_uring_register_files_update(&r->ring, static_cast<unsigned>(it->second), &minus, 1);
    free_slots_.push_back(it->second);
    slot_of_.erase(it);
  }

  // A batch goes to one ring under its SQ mutex. When io_uring_submit fails
  // (past the retries of SubmitLocked), the ops whose SQEs the kernel did not
  // take are failed: if none of this batch had started, the call returns the
  // error (the caller fails the batch, as for any refused Submit); otherwise
  // each such op completes with the -errno, on this thread, once the locks
  // are released.
  Status Submit(std::span<IoOp* const> ops) override EXCLUDES(table_mu_, idle_mu_) {
    if (ops.empty()) return Status::Ok();
    if (shutdown_.load()) return FailedPreconditionError("io_uring engine is shut down");
    Ring* r = rings_[next_ring_.fetch_add(1, std::memory_order_relaxed) % rings_.size()].get();
    std::vector<IoOp*> failed;  // completed with `err` once the locks are released
    int err = 0;
    bool started = true;
    {
      ReaderMutexLock tables(&table_mu_);
      MutexLock lock(&r->sq_mu);
      inflight_.fetch_add(static_cast<int64_t>(ops.size()));
      const unsigned base = r->ring.sq.sqe_tail;  // SQ position of ops[0]
      size_t queued = 0;
      for (IoOp* op : ops) {
        io_uring_sqe* sqe;
        while ((sqe = io_uring_get_sqe(&r->ring)) == nullptr) {
          // SQ full: hand what we have to the kernel.
          if ((err = SubmitLocked(r)) != 0) break;
        }
        if (err != 0) break;
        PrepareLocked(sqe, op);
        ++queued;
        if (options_.single_submit && (err = SubmitLocked(r)) != 0) break;
      }
      if (err == 0 && !options_.single_submit) err = SubmitLocked(r);
      if (err != 0) {
        std::vector<std::pair<unsigned, IoOp*>> back = ReclaimLocked(r, err);
        size_t mine = 0;  // reclaimed ops of this batch
        for (const auto& [pos, op] : back) {
          if (static_cast<int>(pos - base) >= 0) ++mine;
        }
        started = mine < queued;
        for (const auto& [pos, op] : back) {
          if (started || static_cast<int>(pos - base) < 0) failed.push_back(op);
        }
        if (started) failed.insert(failed.end(), ops.begin() + queued, ops.end());
        STRATA_LOG_ERROR(
            "nvme: io_uring_submit failed: {} (errno {}); failing {} op(s) that were not submitted",
            std::strerror(-err), -err, (started ? 0 : ops.size()) + failed.size());
      }
    }
    if (err == 0) return Status::Ok();
    FailOps(failed, err);
    if (started) return Status::Ok();
    // Nothing of this batch reached the kernel: the caller fails it.
    if (inflight_.fetch_sub(static_cast<int64_t>(ops.size())) == static_cast<int64_t>(ops.size())) {
      MutexLock lock(&idle_mu_);
      idle_cv_.NotifyAll();
    }
    return ErrnoError("io_uring_submit", -err);
  }

  void Shutdown() override EXCLUDES(shutdown_mu_, idle_mu_) {
    MutexLock once(&shutdown_mu_);
    if (stopped_) return;
    shutdown_.store(true);
    {
      MutexLock lock(&idle_mu_);
      while (inflight_.load() != 0) idle_cv_.Wait(&idle_mu_);
    }
    for (auto& r : rings_) {
      if (!r->reaper.joinable()) continue;
      int err = 0;
      {
        MutexLock lock(&r->sq_mu);
        io_uring_sqe* sqe;
        while ((sqe = io_uring_get_sqe(&r->ring)) == nullptr) {
          if ((err = SubmitLocked(r.get())) != 0) break;
        }
        if (err == 0) {
          io_uring_prep_nop(sqe);
          io_uring_sqe_set_data64(sqe, kExitTag);
          err = SubmitLocked(r.get());
        }
        // No op is in flight any more: at most the NOP comes back.
        if (err != 0) ReclaimLocked(r.get(), err);
      }
      if (err != 0) {
        STRATA_LOG_ERROR("nvme: io_uring_submit of the exit NOP failed: {} (errno {})",
                         std::strerror(-err), -err);
        r->stop.store(true);
      }
    }
    for (auto& r : rings_) {
      if (!r->reaper.joinable()) continue;
      if (!r->stop.load() || TimedReap(r.get())) {
        r->reaper.join();
      } else {
        // The reaper sleeps in the kernel for good: leave it and its ring be.
        r->reaper.detach();
        (void)r.release();
      }
    }
    rings_.clear();
    stopped_ = true;
  }

  IoEngineStats stats() const override {
    IoEngineStats s;
    s.ops = stats_ops_.load();
    s.fixed_buffer_ops = stats_fixed_buf_.load();
    s.fixed_file_ops = stats_fixed_file_.load();
    s.submit_calls = stats_submits_.load();
    return s;
  }

 private:
  struct Region {
    char* p;
    size_t n;
  };

  int FindRegion(const void* buf, size_t len) const REQUIRES_SHARED(table_mu_) {
    auto p = static_cast<const char*>(buf);
    for (size_t i = 0; i < regions_.size(); ++i) {
      if (p >= regions_[i].p && p + len <= regions_[i].p + regions_[i].n)
        return static_cast<int>(i);
    }
    return -1;
  }

  // The SQE setup of one op; `sqe` is from the SQ of a ring whose sq_mu the
  // caller holds.
  void PrepareLocked(io_uring_sqe* sqe, IoOp* op) REQUIRES_SHARED(table_mu_) {
    int fd = op->fd;
    bool fixed_file = false;
    if (auto it = slot_of_.find(op->fd); it != slot_of_.end()) {
      fd = it->second;
      fixed_file = true;
    }
    int buf_index = FindRegion(op->buf, op->len);
    if (op->kind == IoOpKind::kRead) {
      if (buf_index >= 0)
        io_uring_prep_read_fixed(sqe, fd, op->buf, op->len, op->offset, buf_index);
      else
        io_uring_prep_read(sqe, fd, op->buf, op->len, op->offset);
    } else {
      if (buf_index >= 0)
        io_uring_prep_write_fixed(sqe, fd, op->buf, op->len, op->offset, buf_index);
      else
        io_uring_prep_write(sqe, fd, op->buf, op->len, op->offset);
    }
    if (fixed_file) io_uring_sqe_set_flags(sqe, IOSQE_FIXED_FILE);
    io_uring_sqe_set_data(sqe, op);
    STRATA_TSAN_RELEASE(op);
    stats_ops_.fetch_add(1, std::memory_order_relaxed);
    if (buf_index >= 0) stats_fixed_buf_.fetch_add(1, std::memory_order_relaxed);
    if (fixed_file) stats_fixed_file_.fetch_add(1, std::memory_order_relaxed);
  }

  // Hands every queued SQE to the kernel. Transient
  // refusals (EAGAIN/EBUSY: the CQ is full until the reaper catches up; EINTR)
  // and partial submissions (the kernel took fewer SQEs than queued) are
  // retried. Returns 0, or the -errno of a failure that left SQEs in the SQ
  // (the caller then takes them back with ReclaimLocked).
  int SubmitLocked(Ring* r) REQUIRES(r->sq_mu) {
    for (int attempt = 0;; ++attempt) {
      int ret = internal::UringSubmitFaultForTest();
      if (ret == 0) {
        ret = io_uring_submit(&r->ring);
      } else {
        PublishLocked(r);  // as io_uring_submit does before it enters the kernel
      }
      stats_submits_.fetch_add(1, std::memory_order_relaxed);
      // With SQPOLL the poller takes what is left; without it nobody would.
      if (ret >= 0 && (sqpoll_ || io_uring_sq_ready(&r->ring) == 0)) return 0;
      if (ret >= 0) ret = -EAGAIN;
      if ((ret == -EAGAIN || ret == -EBUSY || ret == -EINTR) && attempt < kSubmitAttempts) {
        std::this_thread::yield();
        continue;
      }
      return ret;
    }
  }

  // Publishes the queued SQEs to the kernel the way liburing's
  // io_uring_submit does first (for the test seam).
  static void PublishLocked(Ring* r) REQUIRES(r->sq_mu) {
    io_uring_sq* sq = &r->ring.sq;
    if (sq->sqe_head == sq->sqe_tail) return;
    sq->sqe_head = sq->sqe_tail;
    __atomic_store_n(sq->ktail, sq->sqe_tail, __ATOMIC_RELEASE);
  }

  // REQUIRES: the last submission failed with `err`. Takes
  // every SQE the kernel has not consumed back out of the SQ and returns the
  // ops with their SQ positions, oldest first (the exit NOP is dropped).
  // Without SQPOLL the kernel reads the SQ only inside io_uring_enter(to_submit
  // > 0), which only SubmitLocked calls, under sq_mu: nothing races with this.
  // With SQPOLL the kernel thread may consume published SQEs at any moment, so
  // they are left to it unless it is gone (EOWNERDEAD).
  std::vector<std::pair<unsigned, IoOp*>> ReclaimLocked(Ring* r, int err) REQUIRES(r->sq_mu) {
    std::vector<std::pair<unsigned, IoOp*>> out;
    if (sqpoll_ && err != -EOWNERDEAD) return out;
    io_uring_sq* sq = &r->ring.sq;
    const unsigned head = __atomic_load_n(sq->khead, __ATOMIC_ACQUIRE);
    for (unsigned pos = head; pos != sq->sqe_tail; ++pos) {
      const uint64_t tag = sq->sqes[pos & sq->ring_mask].user_data;
      if (tag != kExitTag) out.emplace_back(pos, reinterpret_cast<IoOp*>(tag));
    }
    sq->sqe_head = sq->sqe_tail = head;
    __atomic_store_n(sq->ktail, head, __ATOMIC_RELEASE);
    return out;
  }

  // Completes ops that never reached the kernel with `err` (< 0), as the
  // reaper completes the others. REQUIRES: no engine lock held (done() may
  // submit more).
  void FailOps(std::span<IoOp* const> ops, int err) EXCLUDES(table_mu_, idle_mu_) {
    for (IoOp* op : ops) {
      op->done(op, err);
      if (inflight_.fetch_sub(1) == 1) {
        MutexLock lock(&idle_mu_);
        idle_cv_.NotifyAll();
      }
    }
  }

  // Whether the reaper waits with a timeout (and so notices Ring::stop).
  // io_uring_wait_cqe_timeout needs IORING_FEAT_EXT_ARG: without it liburing
  // would queue a timeout SQE from the reaper thread, outside sq_mu.
  static bool TimedReap(Ring* r) { return (r->ring.features & IORING_FEAT_EXT_ARG) != 0; }

  void Reap(Ring* r) EXCLUDES(idle_mu_) {
    const bool timed = TimedReap(r);
    bool exit = false;
    while (!exit) {
      io_uring_cqe* cqe = nullptr;
      __kernel_timespec wake{1, 0};  // only matters once Ring::stop is set
      int ret = timed ? io_uring_wait_cqe_timeout(&r->ring, &cqe, &wake)
                      : io_uring_wait_cqe(&r->ring, &cqe);
      if (ret < 0 && r->stop.load()) return;
      if (ret == -ETIME || ret == -EINTR || ret == -EAGAIN) continue;
      if (ret < 0) {
        STRATA_LOG_ERROR("nvme: io_uring_wait_cqe failed: {}", std::strerror(-ret));
        continue;
      }
      unsigned head;
      unsigned seen = 0;
      io_uring_for_each_cqe(&r->ring, head, cqe) {
        ++seen;
        uint64_t tag = io_uring_cqe_get_data64(cqe);
        if (tag == kExitTag) {
          exit = true;
          continue;
        }
        auto* op = reinterpret_cast<IoOp*>(tag);
        STRATA_TSAN_ACQUIRE(op);
        int64_t res = cqe->res;
        op->done(op, res);  // may submit more (takes sq_mu, never this thread's)
        if (inflight_.fetch_sub(1) == 1) {
          MutexLock lock(&idle_mu_);
          idle_cv_.NotifyAll();
        }
      }
      io_uring_cq_advance(&r->ring, seen);
    }
  }

  IoOptions options_;
  std::vector<std::unique_ptr<Ring>> rings_;
  std::atomic<uint64_t> next_ring_{0};
  uint32_t features_ = 0;
  bool sqpoll_ = false;

  SharedMutex table_mu_;
  std::vector<Region> regions_ GUARDED_BY(table_mu_);
  bool files_ok_ = false;  // set by Init
  std::unordered_map<int, int> slot_of_ GUARDED_BY(table_mu_);
  std::vector<int> free_slots_ GUARDED_BY(table_mu_);

  std::atomic<int64_t> inflight_{0};
  Mutex idle_mu_;  // for idle_cv_: Shutdown waits for inflight_ to reach 0
  CondVar idle_cv_;
  std::atomic<bool> shutdown_{false};
  Mutex shutdown_mu_;  // one Shutdown at a time
  bool stopped_ GUARDED_BY(shutdown_mu_) = false;

  std::atomic<uint64_t> stats_ops_{0}, stats_fixed_buf_{0}, stats_fixed_file_{0}, stats_submits_{0};
};

}  // namespace

namespace internal {
namespace {
std::atomic<bool> g_submit_fault_armed{false};
Mutex g_submit_fault_mu;
int g_submit_fault_err GUARDED_BY(g_submit_fault_mu) = 0;
int g_submit_fault_skip GUARDED_BY(g_submit_fault_mu) = 0;
int g_submit_fault_count GUARDED_BY(g_submit_fault_mu) = 0;
}  // namespace

void SetUringSubmitFaultForTest(int err, int skip, int count) {
  MutexLock lock(&g_submit_fault_mu);
  g_submit_fault_err = std::abs(err);
  g_submit_fault_skip = std::max(skip, 0);
  g_submit_fault_count = std::max(count, 0);
  g_submit_fault_armed.store(g_submit_fault_err != 0 && g_submit_fault_count > 0);
}

int UringSubmitFaultForTest() {
  if (!g_submit_fault_armed.load(std::memory_order_relaxed)) return 0;
  MutexLock lock(&g_submit_fault_mu);
  if (g_submit_fault_err == 0 || g_submit_fault_count == 0) return 0;
  if (g_submit_fault_skip > 0) {
    --g_submit_fault_skip;
    return 0;
  }
  if (--g_submit_fault_count == 0) g_submit_fault_armed.store(false);
  return -g_submit_fault_err;
}
}  // namespace internal

UringProbe ProbeUring() {
  UringProbe probe;
  io_uring ring;
  io_uring_params p;
  std::memset(&p, 0, sizeof(p));
  int ret = io_uring_queue_init_params(4, &ring, &p);
  if (ret < 0) {
    probe.error = ErrnoError("io_uring_queue_init", -ret);
    return probe;
  }
  probe.features = p.features;
  io_uring_sqe* sqe = io_uring_get_sqe(&ring);
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data64(sqe, 42);
  ret = io_uring_submit(&ring);
  if (ret < 0) {
    probe.error = ErrnoError("io_uring_submit(NOP)", -ret);
  } else {
    io_uring_cqe* cqe = nullptr;
    do {
      ret = io_uring_wait_cqe(&ring, &cqe);
    } while (ret == -EINTR);
    if (ret < 0) {
      probe.error = ErrnoError("io_uring_wait_cqe(NOP)", -ret);
    } else if (cqe->res < 0 || io_uring_cqe_get_data64(cqe) != 42) {
      probe.error = cqe->res < 0 ? ErrnoError("io_uring NOP", -cqe->res)
                                 : InternalError("io_uring NOP came back with the wrong tag");
      io_uring_cqe_seen(&ring, cqe);
    } else {
      io_uring_cqe_seen(&ring, cqe);
      probe.available = true;
    }
  }
  io_uring_queue_exit(&ring);
  return probe;
}

StatusOr<std::unique_ptr<IoEngine>> NewUringEngine(const IoOptions& options) {
  RETURN_IF_ERROR(ValidateIoOptions(options));
  auto engine = std::make_unique<UringEngine>(options);
  RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<IoEngine>(std::move(engine));
}

}  // namespace strata::nvme
