// The POSIX engine: a pool of threads doing one pread/pwrite per op. Used
// where io_uring is refused (kernel.io_uring_disabled, seccomp, old kernels)
// or when forced with strata.io_engine = "posix". queue_depth × threads
// workers keep as many ops in flight as the io_uring engine would.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <system_error>
#include <thread>
#include <vector>

#include "src/common/status_util.h"
#include "src/common/thread_annotations.h"
#include "src/nvme/nvme.h"

namespace strata::nvme {
namespace {

class PosixEngine final : public IoEngine {
 public:
  explicit PosixEngine(const IoOptions& o) : options_(o) {}
  ~PosixEngine() override { Shutdown(); }

  // Starts the workers. A thread that cannot be created (RLIMIT_NPROC,
  // RLIMIT_AS for its stack) is ResourceExhausted naming how many were asked
  // and started; the ones started are stopped again by the destructor.
  Status Start() {
    const int workers = std::clamp(options_.queue_depth * options_.threads, 1, 256);
    for (int i = 0; i < workers; ++i) {
      try {
        workers_.emplace_back([this] { Work(); });
      } catch (const std::system_error& e) {
        return ResourceExhaustedError(
            fmt::format("POSIX I/O engine: cannot start worker thread {} of {} "
                        "(aio.queue_depth {} x aio.intra_op_parallelism {}): {}",
                        i + 1, workers, options_.queue_depth, options_.threads, e.what()));
      }
    }
    return Status::Ok();
  }

  EngineKind kind() const override { return EngineKind::kPosix; }
  int parallelism() const override { return options_.threads; }
  Status RegisterBuffers(std::span<const MemoryRegion>) override { return Status::Ok(); }
  Status RegisterFile(int) override { return Status::Ok(); }
  void UnregisterFile(int) override {}

  Status Submit(std::span<IoOp* const> ops) override EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      if (stopping_) return FailedPreconditionError("POSIX I/O engine is shut down");
      for (IoOp* op : ops) queue_.push_back(op);
      ops_ += ops.size();
      ++submits_;
    }
    if (ops.size() == 1)
      cv_.NotifyOne();
    else
      cv_.NotifyAll();
    return Status::Ok();
  }

  void Shutdown() override EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      if (stopping_ && workers_.empty()) return;
      stopping_ = true;  // workers finish the queue, then exit
    }
    cv_.NotifyAll();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  IoEngineStats stats() const override EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    IoEngineStats s;
    s.ops = ops_;
    s.submit_calls = submits_;
    return s;
  }

 private:
  void Work() EXCLUDES(mu_) {
    for (;;) {
      IoOp* op = nullptr;
      {
        MutexLock lock(&mu_);
        while (!stopping_ && queue_.empty()) cv_.Wait(&mu_);
        if (queue_.empty()) return;  // stopping and drained
        op = queue_.front();
        queue_.pop_front();
      }
      ssize_t r;
      do {
        r = op->kind == IoOpKind::kRead
                ? pread(op->fd, op->buf, op->len, static_cast<off_t>(op->offset))
                : pwrite(op->fd, op->buf, op->len, static_cast<off_t>(op->offset));
      } while (r < 0 && errno == EINTR);
      op->done(op, r < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(r));
    }
  }

  IoOptions options_;
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<IoOp*> queue_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  uint64_t ops_ GUARDED_BY(mu_) = 0;
  uint64_t submits_ GUARDED_BY(mu_) = 0;
  std::vector<std::thread> workers_;  // started by Start, joined by Shutdown (one caller)
};

}  // namespace

StatusOr<std::unique_ptr<IoEngine>> NewPosixEngine(const IoOptions& options) {
  RETURN_IF_ERROR(ValidateIoOptions(options));
  auto engine = std::make_unique<PosixEngine>(options);
  RETURN_IF_ERROR(engine->Start());
  return std::unique_ptr<IoEngine>(std::move(engine));
}

}  // namespace strata::nvme
