// src/nvme/nvme.h — the NVMe tier: asynchronous file I/O and the swap store.
//
// Layers, bottom up (each usable on its own):
//
//   IoEngine    one table of operations that moves bytes between memory and a
//               file descriptor: io_uring (liburing; fixed buffers, registered
//               files, batched submission, optional SQPOLL) or a POSIX
//               pread/pwrite thread pool. Engines never split, retry or
//               interpret results: an op completes exactly once with the
//               kernel's answer (bytes moved, possibly short, or -errno).
//               IoEngineWrapper forwards every call (LevelDB EnvWrapper style);
//               FaultInjectionEngine uses it to inject EIO/ENOSPC/EAGAIN and
//               short reads/writes.
//   IoService   the asynchronous API: Read/Write of (file, buffer, length,
//               offset) → IoHandle to Wait() on or Poll(). Splits requests into
//               block_size pieces and keeps queue_depth × threads pieces in
//               flight; resubmits short reads/writes for the remainder; retries
//               EAGAIN a bounded number of times; moves pieces that O_DIRECT
//               cannot take (unaligned buffer/offset/length) through an aligned
//               bounce buffer, still O_DIRECT (see "Unaligned requests" below);
//               turns every failure into a Status naming the file, offset,
//               length and errno.
//   SwapStore   named shards → extents in preallocated swap files, one file per
//               directory, striped over all directories in stripe_unit pieces.
//
// Probes for `strata info`: ProbeUring() (a real ring and a NOP round trip)
// and ProbeDirectIo(dir) (O_DIRECT open + aligned write/read, logical block
// size). SelectEngine() turns a requested kind and the probe into the engine to
// use, logging a fallback once.
//
// Threading: IoService, SwapStore and the engines are thread-safe unless a
// method says otherwise. Completions run on engine threads; IoHandle::Wait()
// may be called from any thread (not from an engine thread).
// Ownership: callers own every buffer; a buffer must stay valid and untouched
// until its request's handle reports done. Files (IoFile) and handles must not
// outlive the IoService that made them; a SwapStore must not outlive its
// IoService.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/config.h"
#include "strata/status.h"

namespace strata::nvme {

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

enum class EngineKind { kAuto, kUring, kPosix };
std::string_view EngineKindName(EngineKind k);  // "auto", "uring", "posix"
// "auto" | "uring" | "io_uring" | "posix" → kind; anything else InvalidArgument.
StatusOr<EngineKind> ParseEngineKind(std::string_view text);

// A memory region to register as io_uring fixed buffers (e.g. the pinned pool's
// slabs). Requests whose buffer lies entirely inside one region use the
// READ_FIXED/WRITE_FIXED opcodes. The caller keeps the memory alive for the
// engine's lifetime.
struct MemoryRegion {
  void* data = nullptr;
  size_t size = 0;
};

struct IoOptions {
  EngineKind engine = EngineKind::kAuto;
  size_t block_size = 1 << 20;  // bytes per piece (aio.block_size)
  int queue_depth = 8;          // pieces in flight per ring/thread group (aio.queue_depth)
  int threads = 1;      // io_uring rings (each with a reaper thread) (aio.intra_op_parallelism)
  bool sqpoll = false;  // io_uring SQPOLL (strata.io_sqpoll)
  bool single_submit =
      false;               // one io_uring_submit per piece instead of per batch (aio.single_submit)
  bool direct = true;      // try O_DIRECT (falls back to buffered where refused)
  int eagain_retries = 3;  // EAGAIN resubmissions per piece before failing with Unavailable
  std::vector<MemoryRegion> fixed_buffers;
};

// aio.* and strata.io_engine/io_sqpoll → IoOptions. Values < 1 become 1.
IoOptions IoOptionsFromConfig(const Config& config);
// Checks ranges (block_size a multiple of 4096 and ≤ 1 GiB, 1 ≤ queue_depth ≤ 4096,
// 1 ≤ threads ≤ 64); the error names the field and value.
Status ValidateIoOptions(const IoOptions& options);

// ---------------------------------------------------------------------------
// Probes (for `strata info` and engine selection)
// ---------------------------------------------------------------------------

struct UringProbe {
  bool available = false;
  Status error;  // why not, when !available (e.g. "io_uring_queue_init: Operation not permitted")
  uint32_t features = 0;  // IORING_FEAT_* bits reported by the kernel
};
// Sets up a small ring and round-trips a NOP. Never fails: refusal is a result.
UringProbe ProbeUring();

struct DirectIoProbe {
  bool direct_supported = false;
  Status direct_error;              // why O_DIRECT was refused, when !direct_supported
  uint32_t logical_block_size = 0;  // alignment O_DIRECT needs for offsets/lengths/buffers
  std::string block_size_source;    // "statx", "sysfs" or "default"
};
// Creates, O_DIRECT-writes, reads back and removes a probe file in `dir`.
// Errors only when `dir` itself is unusable (missing, not a directory, not
// writable); a refused O_DIRECT is a result.
StatusOr<DirectIoProbe> ProbeDirectIo(const std::string& dir);

// Log keys of the once-only fallback warnings (for tests and `strata info`).
inline constexpr std::string_view kWarnUringFallback = "nvme.uring_unavailable_using_posix";
inline constexpr std::string_view kWarnBufferedFallbackPrefix = "nvme.odirect_refused:";

struct EngineSelection {
  EngineKind kind = EngineKind::kPosix;  // never kAuto
  bool fell_back = false;                // auto asked, io_uring refused
  std::string reason;                    // the probe error when fell_back
};
// auto → uring if probe.available, else posix (warns once); uring → uring or
// NotSupported with the probe's error; posix → posix.
StatusOr<EngineSelection> SelectEngine(EngineKind requested, const UringProbe& probe);

// ---------------------------------------------------------------------------
// IoEngine: the low-level table of operations
// ---------------------------------------------------------------------------

enum class IoOpKind : uint8_t { kRead, kWrite };

// One kernel-sized operation. Owned by the submitter; must stay valid until
// done() is called. An engine does not modify it.
struct IoOp {
  IoOpKind kind = IoOpKind::kRead;
  int fd = -1;
  void* buf = nullptr;
  uint32_t len = 0;
  uint64_t offset = 0;
  // Called exactly once on an engine thread: result = bytes moved (may be
  // short, 0 at EOF) or -errno. May submit more ops; must not block long.
  void (*done)(IoOp* op, int64_t result) = nullptr;
  void* ctx = nullptr;  // the submitter's
};

struct IoEngineStats {
  uint64_t ops = 0;
  uint64_t fixed_buffer_ops = 0;  // ops that used READ_FIXED/WRITE_FIXED
  uint64_t fixed_file_ops = 0;    // ops that used a registered file
  uint64_t submit_calls = 0;      // io_uring_submit calls (batches)
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  virtual EngineKind kind() const = 0;
  // Number of rings / worker groups; the IoService keeps queue_depth ×
  // parallelism() ops in flight.
  virtual int parallelism() const = 0;
  // Registers regions as fixed buffers (replacing earlier ones). Engines
  // without the notion accept and ignore them. REQUIRES: no ops in flight.
  virtual Status RegisterBuffers(std::span<const MemoryRegion> regions) = 0;
  // Registers/unregisters an fd as a fixed file. Best effort: an engine that
  // cannot register returns OK and uses the plain fd.
  virtual Status RegisterFile(int fd) = 0;
  virtual void UnregisterFile(int fd) = 0;
  // Starts every op (one batch). On error no op of the batch was started.
  // When the kernel refuses part of a batch after some of it started (a failed
  // io_uring_submit), Submit returns OK and each op it could not start
  // completes with the -errno, possibly on the calling thread. Engines never
  // abort the process.
  virtual Status Submit(std::span<IoOp* const> ops) = 0;
  // Waits for every started op to complete, then stops the engine threads.
  // Idempotent; Submit afterwards fails with FailedPrecondition.
  virtual void Shutdown() = 0;
  virtual IoEngineStats stats() const = 0;
};

// Factories. NewUringEngine fails (NotSupported/Unavailable, with the kernel's
// errno) when io_uring is refused.
StatusOr<std::unique_ptr<IoEngine>> NewUringEngine(const IoOptions& options);
StatusOr<std::unique_ptr<IoEngine>> NewPosixEngine(const IoOptions& options);
// Probes and selects (see SelectEngine), then builds the engine.
StatusOr<std::unique_ptr<IoEngine>> NewIoEngine(const IoOptions& options);

// Forwards every call to `target` (owned). Subclass and override one call.
class IoEngineWrapper : public IoEngine {
 public:
  explicit IoEngineWrapper(std::unique_ptr<IoEngine> target) : target_(std::move(target)) {}
  EngineKind kind() const override { return target_->kind(); }
  int parallelism() const override { return target_->parallelism(); }
  Status RegisterBuffers(std::span<const MemoryRegion> r) override {
    return target_->RegisterBuffers(r);
  }
  Status RegisterFile(int fd) override { return target_->RegisterFile(fd); }
  void UnregisterFile(int fd) override { target_->UnregisterFile(fd); }
  Status Submit(std::span<IoOp* const> ops) override { return target_->Submit(ops); }
  void Shutdown() override { target_->Shutdown(); }
  IoEngineStats stats() const override { return target_->stats(); }
  IoEngine* target() const { return target_.get(); }

 private:
  std::unique_ptr<IoEngine> target_;
};

// Fails chosen ops. A rule matches the Nth op (1-based, counted per rule) of
// its kind whose [offset, offset+len) contains `at_offset` (or any op when
// at_offset < 0). The op is still performed by the target and its result
// replaced (-err, or `short_bytes` for a short transfer), so faults arrive
// asynchronously on engine threads like real ones. Thread-safe.
class FaultInjectionEngine : public IoEngineWrapper {
 public:
  enum class Fault { kErrno, kShort };
  struct Rule {
    IoOpKind kind = IoOpKind::kRead;
    int64_t nth = 1;
    int64_t at_offset = -1;
    Fault fault = Fault::kErrno;
    int err = 5;               // EIO; for kErrno
    uint32_t short_bytes = 0;  // for kShort: bytes reported as moved (< len)
    int64_t times = 1;         // how many consecutive matches (from the Nth) fail
  };
  explicit FaultInjectionEngine(std::unique_ptr<IoEngine> target);
  ~FaultInjectionEngine() override;
  void AddRule(const Rule& rule);
  void ClearRules();
  int64_t faults_injected() const;
  Status Submit(std::span<IoOp* const> ops) override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// ---------------------------------------------------------------------------
// IoService: the asynchronous API
// ---------------------------------------------------------------------------

struct RequestState;  // implementation

// The completion of one request. Cheap to copy (shared state). A default-
// constructed handle is invalid.
class IoHandle {
 public:
  IoHandle() = default;
  explicit IoHandle(std::shared_ptr<RequestState> s) : state_(std::move(s)) {}
  // A handle that is already complete with `status` (nothing was submitted).
  static IoHandle Completed(Status status);
  bool valid() const { return state_ != nullptr; }
  // True once the request has completed (success or failure). Non-blocking.
  bool Poll() const;
  // Blocks until completion; returns the request's final Status.
  Status Wait() const;
  // REQUIRES: Poll(). The final Status.
  Status status() const;
  uint64_t bytes() const;  // bytes of the request (sum of its segments)

 private:
  friend class IoService;
  std::shared_ptr<RequestState> state_;
};

// Waits for all handles; returns the first error (in order), OK otherwise.
Status WaitAll(std::span<const IoHandle> handles);

class IoService;

// An open file. Two descriptors: O_DIRECT (when the filesystem allows it) and
// buffered; requests use only the O_DIRECT one where there is one (see
// "Unaligned requests" at IoService), else the buffered one. Closed on
// destruction.
// REQUIRES: destroyed before its IoService, and with no request in flight.
class IoFile {
 public:
  ~IoFile();
  IoFile(const IoFile&) = delete;
  IoFile& operator=(const IoFile&) = delete;
  const std::string& path() const { return path_; }
  bool direct() const { return direct_fd_ >= 0; }
  uint32_t logical_block_size() const { return block_; }
  // Current size (fstat); IOError naming the path on failure. An unaligned
  // write past the end rounds it up to 4096 (see "Unaligned requests").
  StatusOr<uint64_t> Size() const;

 private:
  friend class IoService;
  IoFile() = default;
  IoService* service_ = nullptr;
  std::string path_;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
  uint32_t block_ = 4096;
};

struct OpenOptions {
  bool create = false;       // O_CREAT
  bool truncate = false;     // O_TRUNC
  uint64_t preallocate = 0;  // fallocate this many bytes (ftruncate if unsupported, warned once)
};

// One segment of a request.
struct IoSegment {
  IoFile* file = nullptr;
  void* buf = nullptr;
  size_t len = 0;
  uint64_t offset = 0;
};

struct IoServiceStats {
  uint64_t requests = 0;
  uint64_t pieces = 0;
  uint64_t direct_pieces = 0;    // aligned: zero-copy on the O_DIRECT descriptor
  uint64_t buffered_pieces = 0;  // on a file without an O_DIRECT descriptor
  uint64_t bounce_pieces = 0;    // unaligned, on an O_DIRECT file: through a bounce buffer
  uint64_t short_resubmits = 0;
  uint64_t eagain_retries = 0;
};

// Unaligned requests. On a file with an O_DIRECT descriptor, a piece whose
// offset and length are multiples of the unit (4096, or the O_DIRECT alignment
// where larger) and whose buffer is aligned goes straight from/to the caller's
// buffer (zero-copy). Any other piece moves the whole units it touches through
// an aligned bounce buffer, also O_DIRECT: a write first reads back the units
// it covers only in part (read-modify-write) while it holds a per-file range
// lock over its units, so concurrent unaligned writes of adjacent byte ranges
// sharing a unit serialize there and none writes back stale bytes of another;
// reads and aligned pieces take no lock. The page cache is never involved on
// such a file: a buffered partial-page write racing an O_DIRECT write of the
// same page could write stale bytes back. Pieces are cut on unit boundaries,
// so only a request's first and last unit need the read-modify-write. Caveat:
// an unaligned write that ends past the end of the file leaves the file size
// rounded up to the unit (the extra bytes read as zeros); reads still end at
// the file's size (DataLoss past it).
class IoService {
 public:
  // Builds the engine from options (see NewIoEngine) and registers
  // options.fixed_buffers.
  static StatusOr<std::unique_ptr<IoService>> Create(const IoOptions& options);
  // Uses the given engine (e.g. a FaultInjectionEngine).
  static StatusOr<std::unique_ptr<IoService>> Create(const IoOptions& options,
                                                     std::unique_ptr<IoEngine> engine);
  ~IoService();  // Shutdown()

  // Opens `path` read/write. O_DIRECT is tried first; where the filesystem
  // refuses it (e.g. tmpfs) the file is buffered and a warning is logged once
  // per directory.
  StatusOr<std::unique_ptr<IoFile>> Open(const std::string& path, const OpenOptions& opts = {});

  // Starts a request. Never blocks on the device (may briefly take a lock).
  // Errors in the arguments and after Shutdown() come back in the handle.
  IoHandle Read(IoFile* file, void* buf, size_t len, uint64_t offset);
  IoHandle Write(IoFile* file, const void* buf, size_t len, uint64_t offset);
  // Several segments as one request (one handle): all reads or all writes.
  IoHandle Submit(IoOpKind kind, std::span<const IoSegment> segments);

  // Stops issuing the request's remaining pieces; it completes with Cancelled
  // once its in-flight pieces are back (or with its result if it already
  // finished). Safe on a finished or invalid handle.
  void Cancel(const IoHandle& handle);
  // Waits until no request is pending or in flight.
  void Drain();
  // Cancels everything not yet issued, waits for in-flight pieces, stops the
  // engine. Idempotent. Later requests fail with FailedPrecondition.
  void Shutdown();

  const IoOptions& options() const { return options_; }
  IoEngine* engine() const { return engine_.get(); }
  IoServiceStats stats() const;

 private:
  friend class IoFile;
  struct Impl;
  IoService(const IoOptions& options, std::unique_ptr<IoEngine> engine);
  IoOptions options_;
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------
// SwapStore
// ---------------------------------------------------------------------------
//
// On-disk layout (scratch space, not a persistent format): one swap file per
// directory, `<dir>/strata-swap-<token>-<pid>-<n>.bin`, preallocated to
// capacity/num_dirs rounded up to stripe_unit. A shard of N bytes is cut into
// stripe_unit pieces; piece k lives in file (first + k) mod D at
// extent_offset[file] + (k div D) × stripe_unit, where `first` rotates from shard
// to shard so small shards spread over the directories. Each shard owns one
// extent per file it touches, aligned to stripe_unit; extents are reused after
// Free (first fit, neighbours coalesced). Metadata lives in memory only; files
// are removed by Close() and by the destructor.
//
// Ownership (see docs/design.md, "Swap-file ownership"). <token> is a random
// 64-bit value drawn once per process (getrandom), so names differ across
// hosts sharing a filesystem and across PID namespaces (two containers are
// both PID 1); <pid> and the serial <n> keep a forked child and several
// stores of one process apart. Each file is created with O_CREAT|O_EXCL (a
// name that exists is never reused) and locked with flock(LOCK_EX) for the
// store's life. A file of this scheme (any `strata-swap-*.bin`) whose lock is
// free belongs to no live run: a leftover of a run that was killed. Open()
// removes the leftovers in its directories first, one notice each (path,
// size); a locked file belongs to a live run and is left alone, so several
// runs (or stores) on one directory each work in their own file. Close()
// reports a swap file it cannot remove (a warning naming the path and errno,
// and its Status).

// The stripe unit a swap store cuts shards into unless told otherwise.
inline constexpr int64_t kDefaultSwapStripeUnit = int64_t{1} << 20;

struct SwapStoreOptions {
  std::vector<std::string> paths;                 // 1+ writable directories (nvme_path)
  uint64_t capacity_bytes = 0;                    // total over all paths
  uint64_t stripe_unit = kDefaultSwapStripeUnit;  // multiple of 4096
};

struct ShardInfo {
  std::string name;
  uint64_t size = 0;
};

// A swap file found in a directory (ListSwapFiles).
struct SwapFileEntry {
  std::string path;
  uint64_t size = 0;  // bytes allocated on disk (st_blocks × 512), what removing it frees
  double age_s = 0;   // seconds since it was last modified
  bool live = false;  // its lock is held: a running store owns it
};

// True for a file name of the swap-file scheme, `strata-swap-*.bin` (older
// releases' `strata-swap-<pid>-<n>.bin` included: they held no lock).
bool IsSwapFileName(std::string_view name);
// The swap files in `dir`, sorted by path; each is probed with
// flock(LOCK_EX|LOCK_NB) (held for an instant, never while it is written).
// Errors when `dir` cannot be read (naming it and errno).
StatusOr<std::vector<SwapFileEntry>> ListSwapFiles(const std::string& dir);
// Removes the leftovers in `dir`: each is locked, checked to still be the
// file at its path, then unlinked under the lock, so a live run's file is
// never removed. Logs one line per file (path, size). Returns the removed
// files; one that cannot be removed is warned about (path, errno) and skipped.
StatusOr<std::vector<SwapFileEntry>> RemoveLeftoverSwapFiles(const std::string& dir);

class SwapStore {
 public:
  // Checks each path (exists, is a directory, writable), removes its
  // leftover swap files (RemoveLeftoverSwapFiles), checks it has
  // capacity/num_paths bytes free (ResourceExhausted names required vs
  // available), then creates (O_EXCL), locks and preallocates the swap
  // files. `io` is not owned.
  static StatusOr<std::unique_ptr<SwapStore>> Open(const SwapStoreOptions& options, IoService* io);
  ~SwapStore();  // Close()

  // Reserves space for a shard of `bytes` (> 0). AlreadyExists-style errors
  // are InvalidArgument; a full store is ResourceExhausted naming the bytes
  // asked and free.
  Status Allocate(const std::string& name, uint64_t bytes);
  // Releases the shard's extents. REQUIRES: no request on it in flight.
  Status Free(const std::string& name);
  StatusOr<ShardInfo> Lookup(const std::string& name) const;

  // Asynchronous byte-range I/O between a shard and a caller buffer of any
  // size; the range must lie inside the shard (else the handle carries
  // OutOfRange). Concurrent requests on disjoint ranges are fine.
  IoHandle Write(const std::string& name, uint64_t shard_offset, const void* buf, size_t len);
  IoHandle Read(const std::string& name, uint64_t shard_offset, void* buf, size_t len);

  // Drains the IoService (every request on it, not only this store's), then
  // closes and removes the swap files (each unlinked while still locked). A
  // file that cannot be removed is logged as a warning naming its path and
  // errno, and the first such error is returned. Idempotent; later I/O fails
  // with FailedPrecondition.
  Status Close();

  uint64_t capacity() const;
  uint64_t free_bytes() const;
  size_t num_shards() const;
  std::vector<std::string> swap_files() const;

 private:
  struct Impl;
  explicit SwapStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::nvme
