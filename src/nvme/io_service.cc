// IoService: requests → block_size pieces kept queue_depth × parallelism deep
// on an IoEngine; short transfers resubmitted for the remainder; EAGAIN
// retried a bounded number of times; every failure named (file, offset,
// length, errno) at the request it belongs to; cancellation and drain.
//
// Locking: one mutex (Impl::mu) guards the queues, the in-flight count and
// every RequestState's bookkeeping; engine Submit is called without it.
// RequestState::done is published under RequestState::mu for waiters.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>

#include <fmt/format.h>

#include "src/common/aligned_buffer.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/nvme/internal.h"
#include "src/nvme/nvme.h"

namespace strata::nvme {

struct RequestState {
  IoOpKind kind = IoOpKind::kRead;
  // The request's bytes in `lanes` contiguous parts (DeepSpeed's
  // intra_op_parallelism): pieces are cut from the lanes in turn, so with T
  // rings T sequential streams are in flight, as with fio's numjobs.
  struct Lane {
    std::vector<IoSegment> segs;
    size_t seg = 0;  // cursor of the next piece (guarded by Impl::mu)
    uint64_t pos = 0;
    bool done() const { return seg >= segs.size(); }
  };
  std::vector<Lane> lanes;
  size_t next_lane = 0;
  uint64_t total = 0;
  int64_t outstanding = 0;  // pieces issued and not finished
  bool failed = false;
  bool cancelled = false;
  bool finished = false;  // completion published (guarded by Impl::mu)
  Status error;           // first error

  // Completion, for waiters.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status final_status;

  bool exhausted() const {
    for (const auto& l : lanes)
      if (!l.done()) return false;
    return true;
  }
};

namespace {
std::shared_ptr<RequestState> CompletedRequest(Status s) {
  auto r = std::make_shared<RequestState>();
  r->finished = true;
  r->done = true;
  r->final_status = std::move(s);
  return r;
}
}  // namespace

bool IoHandle::Poll() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

Status IoHandle::Wait() const {
  if (!state_) return InvalidArgumentError("Wait on an invalid IoHandle");
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->final_status;
}

Status IoHandle::status() const {
  if (!state_) return InvalidArgumentError("status of an invalid IoHandle");
  std::lock_guard lock(state_->mu);
  if (!state_->done) return FailedPreconditionError("IoHandle::status before completion");
  return state_->final_status;
}

IoHandle IoHandle::Completed(Status status) { return IoHandle(CompletedRequest(std::move(status))); }

uint64_t IoHandle::bytes() const { return state_ ? state_->total : 0; }

Status WaitAll(std::span<const IoHandle> handles) {
  Status first;
  for (const auto& h : handles) {
    Status s = h.Wait();
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  return first;
}


struct IoService::Impl {
  struct Piece {
    IoOp op;
    Impl* impl;
    std::shared_ptr<RequestState> req;
    IoFile* file;
    char* buf;
    uint64_t len;
    uint64_t off;
    int eagain = 0;
  };

  IoService* self;
  IoEngine* engine;
  IoOptions opts;
  int64_t limit;

  std::mutex mu;
  std::condition_variable idle_cv;
  std::deque<std::shared_ptr<RequestState>> queue;  // requests with pieces to issue
  std::deque<Piece*> retry;                         // remainders and EAGAIN retries
  int64_t inflight = 0;
  int64_t active_requests = 0;
  bool shutdown = false;
  IoServiceStats stats;

  // REQUIRES: mu. Publishes the result once nothing of the request is left.
  void MaybeFinish(const std::shared_ptr<RequestState>& r) {
    if (r->finished || r->outstanding > 0) return;
    if (!r->failed && !r->cancelled && !r->exhausted()) return;
    r->finished = true;
    Status s = r->failed ? r->error
               : r->cancelled ? CancelledError(fmt::format(
                                    "{} of {} bytes cancelled", r->kind == IoOpKind::kRead ? "read" : "write",
                                    r->total))
                              : Status::Ok();
    {
      std::lock_guard lock(r->mu);
      r->final_status = std::move(s);
      r->done = true;
    }
    r->cv.notify_all();
    --active_requests;
    if (active_requests == 0) idle_cv.notify_all();
  }

  // REQUIRES: mu.
  void Fail(const std::shared_ptr<RequestState>& r, Status s) {
    if (!r->failed) {
      r->failed = true;
      r->error = std::move(s);
    }
  }

  bool DirectOk(const IoFile* f, const char* buf, uint64_t len, uint64_t off) const {
    const uint32_t b = f->block_;
    return f->direct_fd_ >= 0 && IsAligned(buf, b) && off % b == 0 && len % b == 0;
  }

  // REQUIRES: mu. Points the op at the direct or buffered descriptor.
  void Prepare(Piece* p) {
    bool direct = DirectOk(p->file, p->buf, p->len, p->off);
    p->op.kind = p->req->kind;
    p->op.fd = direct ? p->file->direct_fd_ : p->file->buffered_fd_;
    p->op.buf = p->buf;
    p->op.len = static_cast<uint32_t>(p->len);
    p->op.offset = p->off;
    p->op.done = &Impl::OnDone;
    p->op.ctx = p;
    ++stats.pieces;
    if (direct) ++stats.direct_pieces; else ++stats.buffered_pieces;
  }

  // REQUIRES: mu, !r->exhausted(). Cuts the next piece off the request.
  Piece* NextPiece(const std::shared_ptr<RequestState>& r) {
    RequestState::Lane* lane = nullptr;
    for (size_t k = 0; k < r->lanes.size(); ++k) {
      auto& l = r->lanes[(r->next_lane + k) % r->lanes.size()];
      if (!l.done()) {
        lane = &l;
        r->next_lane = (r->next_lane + k + 1) % r->lanes.size();
        break;
      }
    }
    const IoSegment& s = lane->segs[lane->seg];
    IoFile* f = s.file;
    char* buf = static_cast<char*>(s.buf) + lane->pos;
    uint64_t off = s.offset + lane->pos;
    uint64_t len = std::min<uint64_t>(opts.block_size, s.len - lane->pos);
    const uint32_t b = f->block_;
    // An aligned piece with a ragged tail: the aligned body goes direct, the
    // tail becomes the next (buffered) piece.
    if (f->direct_fd_ >= 0 && len % b != 0 && len > b && IsAligned(buf, b) && off % b == 0)
      len = AlignDown(len, b);
    lane->pos += len;
    if (lane->pos == s.len) {
      ++lane->seg;
      lane->pos = 0;
    }
    ++r->outstanding;
    return new Piece{IoOp{}, this, r, f, buf, len, off, 0};
  }

  // Cuts segs into `n` lanes of about equal, block_size-aligned byte counts.
  std::vector<RequestState::Lane> SplitLanes(std::vector<IoSegment> segs, uint64_t total, int n) const {
    std::vector<RequestState::Lane> lanes;
    uint64_t per = AlignUp((total + n - 1) / std::max(n, 1), opts.block_size);
    if (n <= 1 || total <= opts.block_size) per = total;
    RequestState::Lane cur;
    uint64_t in_lane = 0;
    for (IoSegment s : segs) {
      while (s.len > 0) {
        uint64_t take = std::min<uint64_t>(s.len, per - in_lane);
        cur.segs.push_back(IoSegment{s.file, s.buf, take, s.offset});
        s.buf = static_cast<char*>(s.buf) + take;
        s.offset += take;
        s.len -= take;
        in_lane += take;
        if (in_lane == per) {
          lanes.push_back(std::move(cur));
          cur = RequestState::Lane{};
          in_lane = 0;
        }
      }
    }
    if (!cur.segs.empty()) lanes.push_back(std::move(cur));
    return lanes;
  }

  // REQUIRES: mu. Retires a piece that will not be issued (again).
  void Retire(Piece* p) {
    auto r = std::move(p->req);
    delete p;
    --r->outstanding;
    MaybeFinish(r);
  }

  // Issues pieces while there is room. Called from any thread without mu.
  void Pump() {
    std::vector<IoOp*> batch;
    {
      std::lock_guard lock(mu);
      while (inflight < limit) {
        Piece* p = nullptr;
        if (!retry.empty()) {
          p = retry.front();
          retry.pop_front();
          if (p->req->failed || p->req->cancelled) {
            Retire(p);
            continue;
          }
        } else if (!queue.empty()) {
          auto& r = queue.front();
          if (r->failed || r->cancelled || r->exhausted()) {
            auto keep = r;
            queue.pop_front();
            MaybeFinish(keep);
            continue;
          }
          p = NextPiece(r);
          if (r->exhausted()) queue.pop_front();
        } else {
          break;
        }
        Prepare(p);
        ++inflight;
        batch.push_back(&p->op);
      }
    }
    if (batch.empty()) return;
    Status s = engine->Submit(batch);
    if (!s.ok()) {
      std::lock_guard lock(mu);
      for (IoOp* op : batch) {
        auto* p = static_cast<Piece*>(op->ctx);
        Fail(p->req, s.WithContext(PieceContext(p)));
        --inflight;
        Retire(p);
      }
      if (inflight == 0) idle_cv.notify_all();
    }
  }

  std::string PieceContext(const Piece* p) const {
    return fmt::format("{} {} offset {} length {}", p->req->kind == IoOpKind::kRead ? "read" : "write",
                       p->file->path_, p->off, p->len);
  }

  static void OnDone(IoOp* op, int64_t res) {
    auto* p = static_cast<Piece*>(op->ctx);
    Impl* impl = p->impl;
    impl->Complete(p, res);
    impl->Pump();
  }

  void Complete(Piece* p, int64_t res) {
    std::lock_guard lock(mu);
    --inflight;
    auto& r = p->req;
    bool stop = r->failed || r->cancelled;
    if (res < 0) {
      int err = static_cast<int>(-res);
      if (err == EAGAIN && p->eagain < opts.eagain_retries && !stop && !shutdown) {
        ++p->eagain;
        ++stats.eagain_retries;
        retry.push_front(p);
      } else {
        Fail(r, ErrnoError(PieceContext(p), err));
        Retire(p);
      }
    } else if (res == 0 && p->len > 0) {
      if (r->kind == IoOpKind::kRead)
        Fail(r, DataLossError(fmt::format(
                    "{}: unexpected end of file ({} bytes missing; truncated underneath?)",
                    PieceContext(p), p->len)));
      else
        Fail(r, IOError(fmt::format("{}: the write moved 0 bytes", PieceContext(p))));
      Retire(p);
    } else if (static_cast<uint64_t>(res) < p->len) {
      p->buf += res;
      p->off += static_cast<uint64_t>(res);
      p->len -= static_cast<uint64_t>(res);
      ++stats.short_resubmits;
      if (stop || shutdown) {
        if (shutdown && !stop) r->cancelled = true;
        Retire(p);
      } else {
        retry.push_front(p);
      }
    } else {
      Retire(p);
    }
    if (inflight == 0) idle_cv.notify_all();
  }

  IoHandle Start(IoOpKind kind, std::span<const IoSegment> segments) {
    std::vector<IoSegment> segs;
    uint64_t total = 0;
    for (const auto& s : segments) {
      if (s.file == nullptr || (s.buf == nullptr && s.len > 0))
        return IoHandle(CompletedRequest(InvalidArgumentError(
            fmt::format("{}: null file or buffer", kind == IoOpKind::kRead ? "read" : "write"))));
      if (s.file->service_ != self)
        return IoHandle(CompletedRequest(
            InvalidArgumentError(fmt::format("{}: opened by another IoService", s.file->path_))));
      if (s.len == 0) continue;
      segs.push_back(s);
      total += s.len;
    }
    auto r = std::make_shared<RequestState>();
    r->kind = kind;
    r->total = total;
    r->lanes = SplitLanes(std::move(segs), total, engine->parallelism());
    {
      std::lock_guard lock(mu);
      if (shutdown)
        return IoHandle(CompletedRequest(FailedPreconditionError(
            fmt::format("{} of {} bytes after IoService shutdown", kind == IoOpKind::kRead ? "read" : "write",
                        total))));
      ++stats.requests;
      ++active_requests;
      if (r->exhausted()) {
        MaybeFinish(r);  // zero bytes: done at once
        return IoHandle(r);
      }
      queue.push_back(r);
    }
    Pump();
    return IoHandle(r);
  }

  // REQUIRES: mu.
  void CancelLocked(const std::shared_ptr<RequestState>& r) {
    if (r->finished) return;
    r->cancelled = true;
    for (auto it = retry.begin(); it != retry.end();) {
      if ((*it)->req == r) {
        Piece* p = *it;
        it = retry.erase(it);
        Retire(p);
      } else {
        ++it;
      }
    }
    auto qit = std::find(queue.begin(), queue.end(), r);
    if (qit != queue.end()) queue.erase(qit);
    MaybeFinish(r);
  }
};

IoService::IoService(const IoOptions& options, std::unique_ptr<IoEngine> engine)
    : options_(options), engine_(std::move(engine)), impl_(std::make_unique<Impl>()) {
  impl_->self = this;
  impl_->engine = engine_.get();
  impl_->opts = options_;
  impl_->limit = static_cast<int64_t>(options_.queue_depth) * std::max(1, engine_->parallelism());
}

StatusOr<std::unique_ptr<IoService>> IoService::Create(const IoOptions& options) {
  ASSIGN_OR_RETURN(auto engine, NewIoEngine(options));
  return Create(options, std::move(engine));
}

StatusOr<std::unique_ptr<IoService>> IoService::Create(const IoOptions& options,
                                                       std::unique_ptr<IoEngine> engine) {
  RETURN_IF_ERROR(ValidateIoOptions(options));
  if (!engine) return InvalidArgumentError("IoService::Create: null engine");
  if (!options.fixed_buffers.empty()) RETURN_IF_ERROR(engine->RegisterBuffers(options.fixed_buffers));
  STRATA_INFO_ONCE(fmt::format("nvme.engine.{}", EngineKindName(engine->kind())),
                   "nvme: {} engine, block {} bytes, queue depth {}, {} ring(s)/thread group(s)",
                   EngineKindName(engine->kind()), options.block_size, options.queue_depth,
                   engine->parallelism());
  return std::unique_ptr<IoService>(new IoService(options, std::move(engine)));
}

IoService::~IoService() { Shutdown(); }

StatusOr<std::unique_ptr<IoFile>> IoService::Open(const std::string& path, const OpenOptions& o) {
  int flags = O_RDWR | O_CLOEXEC | (o.create ? O_CREAT : 0) | (o.truncate ? O_TRUNC : 0);
  int bfd = open(path.c_str(), flags, 0600);
  if (bfd < 0) return ErrnoError(fmt::format("open {}", path), errno);
  std::unique_ptr<IoFile> f(new IoFile());
  f->service_ = this;
  f->path_ = path;
  f->buffered_fd_ = bfd;
  if (o.preallocate > 0) {
    int ret = fallocate(bfd, 0, 0, static_cast<off_t>(o.preallocate));
    if (ret != 0) {
      int err = errno;
      if (err == EOPNOTSUPP || err == ENOSYS) {
        STRATA_WARN_ONCE(fmt::format("nvme.no_fallocate:{}", internal::DirName(path)),
                         "nvme: fallocate unsupported on {} ({}); the swap file is sparse "
                         "(ftruncate) and may run out of space later",
                         internal::DirName(path), internal::FsTypeName(internal::DirName(path)));
        if (ftruncate(bfd, static_cast<off_t>(o.preallocate)) != 0)
          return ErrnoError(fmt::format("ftruncate {} to {} bytes", path, o.preallocate), errno);
      } else {
        return ErrnoError(fmt::format("fallocate {} bytes for {}", o.preallocate, path), err);
      }
    }
  }
  if (options_.direct) {
    int dfd = internal::OpenDirect(path.c_str(), O_RDWR | O_CLOEXEC | O_DIRECT);
    if (dfd < 0) {
      int err = errno;
      if (err != EINVAL) return ErrnoError(fmt::format("open {} with O_DIRECT", path), err);
      std::string dir = internal::DirName(path);
      STRATA_WARN_ONCE(std::string(kWarnBufferedFallbackPrefix) + dir,
                       "nvme: {} ({}) refuses O_DIRECT; using buffered I/O there (page cache, "
                       "slower and uses DRAM)",
                       dir, internal::FsTypeName(dir));
    } else {
      f->direct_fd_ = dfd;
      f->block_ = internal::LogicalBlockSize(dfd).bytes;
    }
  }
  RETURN_IF_ERROR(engine_->RegisterFile(f->buffered_fd_));
  if (f->direct_fd_ >= 0) RETURN_IF_ERROR(engine_->RegisterFile(f->direct_fd_));
  return f;
}

IoFile::~IoFile() {
  if (service_ != nullptr && service_->engine_) {
    if (direct_fd_ >= 0) service_->engine_->UnregisterFile(direct_fd_);
    if (buffered_fd_ >= 0) service_->engine_->UnregisterFile(buffered_fd_);
  }
  if (direct_fd_ >= 0) close(direct_fd_);
  if (buffered_fd_ >= 0) close(buffered_fd_);
}

StatusOr<uint64_t> IoFile::Size() const {
  struct stat st;
  if (fstat(buffered_fd_, &st) != 0) return ErrnoError(fmt::format("fstat {}", path_), errno);
  return static_cast<uint64_t>(st.st_size);
}

IoHandle IoService::Read(IoFile* file, void* buf, size_t len, uint64_t offset) {
  IoSegment s{file, buf, len, offset};
  return impl_->Start(IoOpKind::kRead, std::span<const IoSegment>(&s, 1));
}

IoHandle IoService::Write(IoFile* file, const void* buf, size_t len, uint64_t offset) {
  IoSegment s{file, const_cast<void*>(buf), len, offset};
  return impl_->Start(IoOpKind::kWrite, std::span<const IoSegment>(&s, 1));
}

IoHandle IoService::Submit(IoOpKind kind, std::span<const IoSegment> segments) {
  return impl_->Start(kind, segments);
}

void IoService::Cancel(const IoHandle& handle) {
  if (!handle.state_) return;
  {
    std::lock_guard lock(impl_->mu);
    impl_->CancelLocked(handle.state_);
  }
  impl_->Pump();
}

void IoService::Drain() {
  std::unique_lock lock(impl_->mu);
  impl_->idle_cv.wait(lock, [&] { return impl_->active_requests == 0 && impl_->inflight == 0; });
}

void IoService::Shutdown() {
  {
    std::unique_lock lock(impl_->mu);
    if (!impl_->shutdown) {
      impl_->shutdown = true;
      auto queued = impl_->queue;
      for (auto& r : queued) impl_->CancelLocked(r);
      auto retries = impl_->retry;
      for (auto* p : retries) impl_->CancelLocked(p->req);
    }
    impl_->idle_cv.wait(lock, [&] { return impl_->inflight == 0; });
  }
  if (engine_) engine_->Shutdown();
}

IoServiceStats IoService::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

}  // namespace strata::nvme
