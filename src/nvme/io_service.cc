// IoService: requests → block_size pieces kept queue_depth × parallelism deep
// on an IoEngine; short transfers resubmitted for the remainder; EAGAIN
// retried a bounded number of times; every failure named (file, offset,
// length, errno) at the request it belongs to; cancellation and drain.
//
// Unaligned pieces of a file opened with O_DIRECT never touch the page cache
// (a buffered partial-page write racing an O_DIRECT write of the same page
// can write stale bytes back): they move whole 4096-byte units through an
// aligned bounce buffer on the O_DIRECT descriptor. A write first reads back
// the unit(s) it covers only in part and holds a per-file range lock over its
// units until its write is done, so two such read-modify-writes of one unit
// never interleave. Aligned pieces own their units outright and take no lock.
//
// Locking: one mutex (Impl::mu) guards the queues, the in-flight count, the
// range locks and every RequestState's bookkeeping; engine Submit is called
// without it, and so are the bounce copies (an in-flight piece belongs to its
// completion). RequestState::done is published under RequestState::mu for
// waiters. The fields of Impl and RequestState::mu's fields carry GUARDED_BY;
// a RequestState's bookkeeping cannot name Impl::mu (another object's mutex),
// so it says so in a comment, and the Impl methods that touch it REQUIRES(mu).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <unordered_map>
#include <utility>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/thread_annotations.h"
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
  Mutex mu;
  CondVar cv;
  bool done GUARDED_BY(mu) = false;
  Status final_status GUARDED_BY(mu);

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
  MutexLock lock(&r->mu);
  r->done = true;
  r->final_status = std::move(s);
  return r;
}
}  // namespace

bool IoHandle::Poll() const {
  if (!state_) return true;
  MutexLock lock(&state_->mu);
  return state_->done;
}

Status IoHandle::Wait() const {
  if (!state_) return InvalidArgumentError("Wait on an invalid IoHandle");
  MutexLock lock(&state_->mu);
  while (!state_->done) state_->cv.Wait(&state_->mu);
  return state_->final_status;
}

Status IoHandle::status() const {
  if (!state_) return InvalidArgumentError("status of an invalid IoHandle");
  MutexLock lock(&state_->mu);
  if (!state_->done) return FailedPreconditionError("IoHandle::status before completion");
  return state_->final_status;
}

IoHandle IoHandle::Completed(Status status) {
  return IoHandle(CompletedRequest(std::move(status)));
}

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
  // How a piece moves its bytes (chosen by Prepare at every (re)issue).
  enum class Path : uint8_t {
    kDirect,    // aligned: the caller's buffer on the O_DIRECT descriptor
    kBuffered,  // the file has no O_DIRECT descriptor
    kBounce,    // unaligned: whole units through `bounce`, O_DIRECT
  };
  // Steps of a bounce piece: a write reads back its partly covered first and
  // last unit (kHead, kTail), then moves the span (kMain); a read only kMain.
  enum class Stage : uint8_t { kHead, kTail, kMain };

  struct Piece {
    IoOp op;
    Impl* impl;
    std::shared_ptr<RequestState> req;
    IoFile* file;
    char* buf;  // the caller's bytes still to move
    uint64_t len;
    uint64_t off;
    int eagain = 0;
    Path path = Path::kDirect;
    // kBounce: the units [span_off, span_off + span_len) covering [off, off + len).
    Stage stage = Stage::kMain;
    uint64_t span_off = 0;
    uint64_t span_len = 0;
    AlignedBuffer bounce;
    bool locked = false;   // holds the file's range lock over the span
    bool copy_in = false;  // kMain of a write whose bytes Pump copies in
    uint64_t moved = 0;    // kMain done: bytes of [off, off + len) it moved
  };

  // Spans of the read-modify-writes in progress on one file, and the pieces
  // waiting for one of them to finish.
  struct RangeLocks {
    std::vector<std::pair<uint64_t, uint64_t>> held;  // [begin, end)
    std::deque<Piece*> waiting;
  };

  IoService* self;
  IoEngine* engine;
  IoOptions opts;
  int64_t limit;

  Mutex mu;
  CondVar idle_cv;
  std::deque<std::shared_ptr<RequestState>> queue GUARDED_BY(mu);  // requests with pieces to issue
  std::deque<Piece*> retry GUARDED_BY(mu);                         // remainders and EAGAIN retries
  std::unordered_map<const IoFile*, RangeLocks> range_locks GUARDED_BY(mu);
  int64_t inflight GUARDED_BY(mu) = 0;
  int64_t active_requests GUARDED_BY(mu) = 0;
  bool shutdown GUARDED_BY(mu) = false;
  IoServiceStats stats GUARDED_BY(mu);

  // The granularity of unaligned I/O on an O_DIRECT file: a page, or the
  // device's O_DIRECT alignment where that is larger.
  static uint64_t Unit(const IoFile* f) { return std::max<uint64_t>(f->block_, 4096); }

  // Publishes the result once nothing of the request is left.
  void MaybeFinish(const std::shared_ptr<RequestState>& r) REQUIRES(mu) {
    if (r->finished || r->outstanding > 0) return;
    if (!r->failed && !r->cancelled && !r->exhausted()) return;
    r->finished = true;
    Status s =
        r->failed ? r->error
        : r->cancelled
            ? CancelledError(fmt::format("{} of {} bytes cancelled",
                                         r->kind == IoOpKind::kRead ? "read" : "write", r->total))
            : Status::Ok();
    {
      MutexLock lock(&r->mu);
      r->final_status = std::move(s);
      r->done = true;
    }
    r->cv.NotifyAll();
    --active_requests;
    if (active_requests == 0) idle_cv.NotifyAll();
  }

  void Fail(const std::shared_ptr<RequestState>& r, Status s) REQUIRES(mu) {
    if (!r->failed) {
      r->failed = true;
      r->error = std::move(s);
    }
  }

  static bool DirectOk(const IoFile* f, const char* buf, uint64_t len, uint64_t off) {
    const uint64_t u = Unit(f);
    return f->direct_fd_ >= 0 && IsAligned(buf, f->block_) && off % u == 0 && len % u == 0;
  }

  static void SetOp(Piece* p, IoOpKind kind, int fd, char* buf, uint64_t len, uint64_t off) {
    p->op.kind = kind;
    p->op.fd = fd;
    p->op.buf = buf;
    p->op.len = static_cast<uint32_t>(len);
    p->op.offset = off;
    p->op.done = &Impl::OnDone;
    p->op.ctx = p;
  }

  // Sets up the piece's (first) op. False when it got none: it waits for a
  // range lock, or it was retired (no memory for its bounce buffer).
  bool Prepare(Piece* p) REQUIRES(mu) {
    IoFile* f = p->file;
    const IoOpKind kind = p->req->kind;
    if (f->direct_fd_ < 0) {
      p->path = Path::kBuffered;
      SetOp(p, kind, f->buffered_fd_, p->buf, p->len, p->off);
      ++stats.buffered_pieces;
    } else if (DirectOk(f, p->buf, p->len, p->off)) {
      p->path = Path::kDirect;
      SetOp(p, kind, f->direct_fd_, p->buf, p->len, p->off);
      ++stats.direct_pieces;
    } else {
      const uint64_t u = Unit(f);
      p->path = Path::kBounce;
      p->span_off = AlignDown(p->off, u);
      p->span_len = AlignUp(p->off + p->len, u) - p->span_off;
      const bool head = kind == IoOpKind::kWrite && p->off != p->span_off;
      const bool tail = kind == IoOpKind::kWrite && p->off + p->len != p->span_off + p->span_len;
      if ((head || tail) && !TryLock(p)) return false;
      auto b = AlignedBuffer::Allocate(p->span_len, u);
      if (!b.ok()) {
        Fail(p->req, b.status().WithContext(PieceContext(p)));
        Retire(p);
        return false;
      }
      p->bounce = std::move(b).value();
      ++stats.bounce_pieces;
      // A write of whole units needs no read-back: Pump copies the caller's
      // bytes in after it lets go of mu.
      p->copy_in = !head && !tail && kind == IoOpKind::kWrite;
      StartStage(p, head ? Stage::kHead : tail ? Stage::kTail : Stage::kMain);
    }
    ++stats.pieces;
    return true;
  }

  // Points the op of a bounce piece at one step. kMain of a write copies the
  // caller's bytes in first (unless copy_in leaves that to Pump). REQUIRES:
  // the piece is not in flight.
  static void StartStage(Piece* p, Stage stage) {
    const uint64_t u = Unit(p->file);
    const int fd = p->file->direct_fd_;
    char* b = p->bounce.as<char>();
    p->stage = stage;
    switch (stage) {
      case Stage::kHead:
        SetOp(p, IoOpKind::kRead, fd, b, u, p->span_off);
        break;
      case Stage::kTail:
        SetOp(p, IoOpKind::kRead, fd, b + p->span_len - u, u, p->span_off + p->span_len - u);
        break;
      case Stage::kMain:
        if (p->req->kind == IoOpKind::kWrite && !p->copy_in)
          std::memcpy(b + (p->off - p->span_off), p->buf, p->len);
        SetOp(p, p->req->kind, fd, b, p->span_len, p->span_off);
        break;
    }
  }

  static bool Overlaps(const RangeLocks& rl, uint64_t b, uint64_t e) {
    for (const auto& [hb, he] : rl.held) {
      if (hb < e && b < he) return true;
    }
    return false;
  }

  // Takes the file's range lock over the piece's span (unless Release handed
  // it over already), or parks the piece until the holders overlapping it let
  // go. Every parked piece overlaps a held span.
  bool TryLock(Piece* p) REQUIRES(mu) {
    if (p->locked) return true;
    RangeLocks& rl = range_locks[p->file];
    const uint64_t b = p->span_off, e = p->span_off + p->span_len;
    if (Overlaps(rl, b, e)) {
      rl.waiting.push_back(p);
      return false;
    }
    rl.held.emplace_back(b, e);
    p->locked = true;
    return true;
  }

  // Drops what a bounce piece holds (buffer, range lock). The lock goes on,
  // oldest first, to the parked pieces it kept out that no other holder keeps
  // out; they move to the retry deque holding it.
  void Release(Piece* p) REQUIRES(mu) {
    p->bounce = AlignedBuffer();
    if (!p->locked) return;
    p->locked = false;
    auto it = range_locks.find(p->file);
    RangeLocks& rl = it->second;
    const uint64_t b = p->span_off, e = p->span_off + p->span_len;
    rl.held.erase(std::find(rl.held.begin(), rl.held.end(), std::make_pair(b, e)));
    for (auto w = rl.waiting.begin(); w != rl.waiting.end();) {
      Piece* q = *w;
      const uint64_t qb = q->span_off, qe = q->span_off + q->span_len;
      if (qb < e && b < qe && !Overlaps(rl, qb, qe)) {
        rl.held.emplace_back(qb, qe);
        q->locked = true;
        retry.push_back(q);
        w = rl.waiting.erase(w);
      } else {
        ++w;
      }
    }
    if (rl.held.empty() && rl.waiting.empty()) range_locks.erase(it);
  }

  // REQUIRES: !r->exhausted(). Cuts the next piece off the request.
  Piece* NextPiece(const std::shared_ptr<RequestState>& r) REQUIRES(mu) {
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
    const uint64_t rest = s.len - lane->pos;
    uint64_t len = std::min<uint64_t>(opts.block_size, rest);
    if (f->direct_fd_ >= 0) {
      // Piece boundaries on unit boundaries, so that at most the first and the
      // last piece of a segment share a unit with other bytes (and need a
      // read-modify-write) and aligned parts stay zero-copy.
      const uint64_t u = Unit(f);
      if (off % u != 0) {
        const uint64_t next = AlignUp(off, u);
        const uint64_t end = AlignDown(off + len, u);
        if (next < off + len && IsAligned(buf + (next - off), f->block_))
          len = next - off;  // the head alone; the caller's buffer is aligned after it
        else if (end > off && len < rest)
          len = end - off;
      } else if (len % u != 0 && len > u) {
        len = AlignDown(len, u);  // the ragged tail becomes the next piece
      }
    }
    lane->pos += len;
    if (lane->pos == s.len) {
      ++lane->seg;
      lane->pos = 0;
    }
    ++r->outstanding;
    auto* p = new Piece();
    p->impl = this;
    p->req = r;
    p->file = f;
    p->buf = buf;
    p->len = len;
    p->off = off;
    return p;
  }

  // Cuts segs into `n` lanes of about equal, block_size-aligned byte counts.
  std::vector<RequestState::Lane> SplitLanes(std::vector<IoSegment> segs, uint64_t total,
                                             int n) const {
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

  // Retires a piece that will not be issued (again).
  void Retire(Piece* p) REQUIRES(mu) {
    Release(p);
    auto r = std::move(p->req);
    delete p;
    --r->outstanding;
    MaybeFinish(r);
  }

  // Issues pieces while there is room. Called from any thread.
  void Pump() EXCLUDES(mu) {
    for (;;) {
      std::vector<IoOp*> batch;
      {
        MutexLock lock(&mu);
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
          if (!Prepare(p)) continue;  // waits for a range lock, or retired
          ++inflight;
          batch.push_back(&p->op);
        }
      }
      if (batch.empty()) return;
      for (IoOp* op : batch) {  // the pieces are this thread's until submitted
        auto* p = static_cast<Piece*>(op->ctx);
        if (!p->copy_in) continue;
        std::memcpy(p->bounce.as<char>() + (p->off - p->span_off), p->buf, p->len);
        p->copy_in = false;
      }
      Status s = engine->Submit(batch);
      if (s.ok()) return;
      SubmitFailed(batch, s);  // then issue what is left, if anything
    }
  }

  // A Submit refused `batch` (none of it started): fails its pieces.
  void SubmitFailed(std::span<IoOp* const> batch, const Status& s) EXCLUDES(mu) {
    MutexLock lock(&mu);
    for (IoOp* op : batch) {
      auto* p = static_cast<Piece*>(op->ctx);
      Fail(p->req, s.WithContext(PieceContext(p)));
      --inflight;
      Retire(p);
    }
    if (inflight == 0) idle_cv.NotifyAll();
  }

  std::string PieceContext(const Piece* p) const {
    return fmt::format("{} {} offset {} length {}",
                       p->req->kind == IoOpKind::kRead ? "read" : "write", p->file->path_, p->off,
                       p->len);
  }

  static void OnDone(IoOp* op, int64_t res) {
    auto* p = static_cast<Piece*>(op->ctx);
    Impl* impl = p->impl;
    if (p->path == Path::kBounce && BounceStep(p, res)) {
      IoOp* next = &p->op;  // the piece keeps its in-flight slot
      Status s = impl->engine->Submit(std::span<IoOp* const>(&next, 1));
      if (s.ok()) return;
      impl->SubmitFailed(std::span<IoOp* const>(&next, 1), s);
    } else {
      impl->Complete(p, res);
    }
    impl->Pump();
  }

  // The part of a bounce piece's completion that needs no lock (the piece is
  // in flight, so it is this thread's). After a read-back of an edge unit, sets
  // up the next step and returns true. After kMain, copies a read out and sets
  // `moved`. Errors are left to Complete.
  static bool BounceStep(Piece* p, int64_t res) {
    if (res < 0) return false;
    if (p->stage == Stage::kMain) {
      const uint64_t end = p->span_off + static_cast<uint64_t>(res);
      p->moved = end > p->off ? std::min(p->len, end - p->off) : 0;
      if (p->req->kind == IoOpKind::kRead)
        std::memcpy(p->buf, p->bounce.as<char>() + (p->off - p->span_off), p->moved);
      return false;
    }
    const uint64_t u = Unit(p->file);
    if (static_cast<uint64_t>(res) < u) {
      // Short: the end of the file (the rest of the unit is a hole: zeros), or
      // a transfer cut short (read the unit again).
      struct stat st;
      const uint64_t at = p->op.offset + static_cast<uint64_t>(res);
      if (fstat(p->file->direct_fd_, &st) == 0 && static_cast<uint64_t>(st.st_size) > at)
        return true;
      std::memset(static_cast<char*>(p->op.buf) + res, 0, u - static_cast<uint64_t>(res));
    }
    const bool tail = p->off + p->len != p->span_off + p->span_len;
    StartStage(p,
               p->stage == Stage::kHead && tail && p->span_len > u ? Stage::kTail : Stage::kMain);
    return true;
  }

  void Complete(Piece* p, int64_t res) EXCLUDES(mu) {
    MutexLock lock(&mu);
    --inflight;
    auto& r = p->req;
    bool stop = r->failed || r->cancelled;
    const bool bounce = p->path == Path::kBounce;
    // A bounce piece comes here with an error of any step, or done with kMain.
    const uint64_t moved =
        bounce ? (res < 0 ? 0 : p->moved) : static_cast<uint64_t>(std::max<int64_t>(res, 0));
    if (res < 0) {
      int err = static_cast<int>(-res);
      if (err == EAGAIN && p->eagain < opts.eagain_retries && !stop && !shutdown) {
        ++p->eagain;
        ++stats.eagain_retries;
        Release(p);
        retry.push_front(p);
      } else {
        Fail(r, ErrnoError(PieceContext(p), err));
        Retire(p);
      }
    } else if (moved == 0 && p->len > 0) {
      if (r->kind == IoOpKind::kRead)
        Fail(r, DataLossError(fmt::format(
                    "{}: unexpected end of file ({} bytes missing; truncated underneath?)",
                    PieceContext(p), p->len)));
      else
        Fail(r, IOError(fmt::format("{}: the write moved 0 bytes", PieceContext(p))));
      Retire(p);
    } else if (moved < p->len) {
      p->buf += moved;
      p->off += moved;
      p->len -= moved;
      ++stats.short_resubmits;
      if (stop || shutdown) {
        if (shutdown && !stop) r->cancelled = true;
        Retire(p);
      } else {
        Release(p);
        retry.push_front(p);
      }
    } else {
      Retire(p);
    }
    if (inflight == 0) idle_cv.NotifyAll();
  }

  IoHandle Start(IoOpKind kind, std::span<const IoSegment> segments) EXCLUDES(mu) {
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
      MutexLock lock(&mu);
      if (shutdown)
        return IoHandle(CompletedRequest(FailedPreconditionError(
            fmt::format("{} of {} bytes after IoService shutdown",
                        kind == IoOpKind::kRead ? "read" : "write", total))));
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

  void CancelLocked(const std::shared_ptr<RequestState>& r) REQUIRES(mu) {
    if (r->finished) return;
    r->cancelled = true;
    // Its parked pieces first, so that no range lock its other pieces let go
    // of is handed to one of them.
    for (auto& [file, rl] : range_locks) {
      for (auto it = rl.waiting.begin(); it != rl.waiting.end();) {
        if ((*it)->req == r) {
          Piece* p = *it;
          it = rl.waiting.erase(it);
          Retire(p);  // holds no lock: range_locks is not changed
        } else {
          ++it;
        }
      }
    }
    std::vector<Piece*> mine;
    for (auto it = retry.begin(); it != retry.end();) {
      if ((*it)->req == r) {
        mine.push_back(*it);
        it = retry.erase(it);
      } else {
        ++it;
      }
    }
    for (Piece* p : mine) Retire(p);  // may hand range locks on (to the retry deque)
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
  if (!options.fixed_buffers.empty())
    RETURN_IF_ERROR(engine->RegisterBuffers(options.fixed_buffers));
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
    MutexLock lock(&impl_->mu);
    impl_->CancelLocked(handle.state_);
  }
  impl_->Pump();
}

void IoService::Drain() {
  MutexLock lock(&impl_->mu);
  while (impl_->active_requests != 0 || impl_->inflight != 0) impl_->idle_cv.Wait(&impl_->mu);
}

void IoService::Shutdown() {
  {
    MutexLock lock(&impl_->mu);
    if (!impl_->shutdown) {
      impl_->shutdown = true;
      // The requests first: cancelling one retires its pieces.
      std::vector<std::shared_ptr<RequestState>> pending(impl_->queue.begin(), impl_->queue.end());
      for (auto* p : impl_->retry) pending.push_back(p->req);
      for (const auto& [file, rl] : impl_->range_locks)
        for (auto* p : rl.waiting) pending.push_back(p->req);
      for (auto& r : pending) impl_->CancelLocked(r);
    }
    while (impl_->inflight != 0) impl_->idle_cv.Wait(&impl_->mu);
  }
  if (engine_) engine_->Shutdown();
}

IoServiceStats IoService::stats() const {
  MutexLock lock(&impl_->mu);
  return impl_->stats;
}

}  // namespace strata::nvme
