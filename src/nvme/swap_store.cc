// SwapStore: named shards striped over one preallocated swap file per
// directory. Layout and rules: see nvme.h.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <ctime>
#include <functional>
#include <set>
#include <unordered_map>
#include <utility>

#include "src/common/aligned_buffer.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/thread_annotations.h"
#include "src/nvme/extent_allocator.h"
#include "src/nvme/internal.h"
#include "src/nvme/nvme.h"

namespace strata::nvme {

namespace {
std::atomic<uint64_t> g_swap_serial{0};
constexpr uint64_t kExtentAlign = 4096;
constexpr std::string_view kSwapPrefix = "strata-swap-";
constexpr std::string_view kSwapSuffix = ".bin";

// The process's random token (see nvme.h, "Ownership"): getrandom, else a
// mix of the clock, the pid and an address (ASLR) when getrandom is refused.
uint64_t ProcessToken() {
  static const uint64_t token = [] {
    uint64_t t = 0;
    if (getrandom(&t, sizeof(t), 0) != static_cast<ssize_t>(sizeof(t)) || t == 0) {
      t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
          (static_cast<uint64_t>(getpid()) << 32) ^ reinterpret_cast<uintptr_t>(&t);
      t *= 0x9E3779B97F4A7C15ull;
    }
    return t;
  }();
  return token;
}

// An open descriptor closed on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int release() { return std::exchange(fd, -1); }
};

bool SameFile(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

SwapFileEntry EntryOf(const std::string& path, const struct stat& st, bool live) {
  SwapFileEntry e;
  e.path = path;
  e.size = static_cast<uint64_t>(st.st_blocks) * 512;
  e.age_s = std::max(0.0, std::difftime(std::time(nullptr), st.st_mtime));
  e.live = live;
  return e;
}

// Scans `dir` for swap files. For each, opens it and tries its lock; `visit`
// gets the path, the descriptor (locked when !live) and its stat. The lock is
// released when visit returns.
Status ForEachSwapFile(
    const std::string& dir,
    const std::function<void(const std::string&, int, const struct stat&, bool live)>& visit) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return ErrnoError(fmt::format("list swap files in {}", dir), errno);
  std::vector<std::string> names;
  while (dirent* e = readdir(d))
    if (IsSwapFileName(e->d_name)) names.emplace_back(e->d_name);
  closedir(d);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string path = dir + "/" + name;
    // Read-write where allowed: NFS emulates flock with POSIX locks, whose
    // exclusive lock needs a descriptor open for writing.
    constexpr int kFlags = O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
    Fd fd(open(path.c_str(), O_RDWR | kFlags));
    if (fd.fd < 0 && (errno == EACCES || errno == EROFS))
      fd.fd = open(path.c_str(), O_RDONLY | kFlags);
    if (fd.fd < 0) continue;  // removed meanwhile, or not a regular file we may open
    struct stat st {};
    if (fstat(fd.fd, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    // Live unless the lock could be taken. A lock refused for another reason
    // (EBADF, ENOLCK) counts as live too: never remove what may be in use.
    const bool live = flock(fd.fd, LOCK_EX | LOCK_NB) != 0;
    visit(path, fd.fd, st, live);
  }
  return Status::Ok();
}

}  // namespace

bool IsSwapFileName(std::string_view name) {
  return name.size() > kSwapPrefix.size() + kSwapSuffix.size() && name.starts_with(kSwapPrefix) &&
         name.ends_with(kSwapSuffix);
}

StatusOr<std::vector<SwapFileEntry>> ListSwapFiles(const std::string& dir) {
  std::vector<SwapFileEntry> out;
  RETURN_IF_ERROR(ForEachSwapFile(dir, [&](const std::string& path, int, const struct stat& st,
                                           bool live) { out.push_back(EntryOf(path, st, live)); }));
  return out;
}

StatusOr<std::vector<SwapFileEntry>> RemoveLeftoverSwapFiles(const std::string& dir) {
  std::vector<SwapFileEntry> removed;
  RETURN_IF_ERROR(
      ForEachSwapFile(dir, [&](const std::string& path, int, const struct stat& st, bool live) {
        if (live) return;
        // Still the file we locked? (Another run may have removed it and no
        // name is reused, but check rather than unlink a stranger.)
        struct stat now {};
        if (lstat(path.c_str(), &now) != 0 || !SameFile(now, st)) return;
        SwapFileEntry e = EntryOf(path, st, false);
        if (unlink(path.c_str()) != 0) {
          STRATA_LOG_WARN("nvme: cannot remove leftover swap file {} ({} bytes): {} (errno {})",
                          path, e.size, std::strerror(errno), errno);
          return;
        }
        STRATA_LOG_INFO(
            "nvme: removed leftover swap file {} ({} bytes, unlocked: its run ended "
            "without removing it)",
            path, e.size);
        removed.push_back(std::move(e));
      }));
  return removed;
}

struct SwapStore::Impl {
  struct SwapFile {
    std::string path;
    int lock_fd = -1;  // holds flock(LOCK_EX) while the file exists
    std::unique_ptr<IoFile> file;
    ExtentAllocator alloc;
  };
  struct Shard {
    uint64_t size = 0;
    size_t first = 0;                  // file of stripe 0
    std::vector<int64_t> extent;       // per file: offset, or -1 when unused
    std::vector<uint64_t> extent_len;  // per file: bytes asked
  };

  SwapStoreOptions opts;
  IoService* io = nullptr;
  mutable Mutex mu;
  std::vector<SwapFile> files GUARDED_BY(mu);
  std::unordered_map<std::string, Shard> shards GUARDED_BY(mu);
  size_t next_first GUARDED_BY(mu) = 0;
  bool closed GUARDED_BY(mu) = false;

  size_t D() const REQUIRES(mu) { return files.size(); }

  // Bytes of the shard that land in file j (by position relative to `first`).
  uint64_t BytesInFile(const Shard& s, size_t j) const REQUIRES(mu) {
    const uint64_t S = opts.stripe_unit;
    uint64_t nstripes = (s.size + S - 1) / S;
    uint64_t rel = (j + D() - s.first) % D();
    if (nstripes <= rel) return 0;
    uint64_t count = (nstripes - 1 - rel) / D() + 1;
    uint64_t last_k = rel + (count - 1) * D();
    uint64_t last_len = std::min<uint64_t>(S, s.size - last_k * S);
    return (count - 1) * S + last_len;
  }

  Status CloseLocked() REQUIRES(mu) {
    if (closed) return Status::Ok();
    closed = true;
    if (io) io->Drain();
    Status first;
    for (auto& f : files) {
      f.file.reset();
      // Unlinked while still locked: a sweeping run never sees it unlocked.
      if (unlink(f.path.c_str()) != 0) {
        const int err = errno;
        STRATA_LOG_WARN("nvme: cannot remove swap file {}: {} (errno {})", f.path,
                        std::strerror(err), err);
        if (first.ok()) first = ErrnoError(fmt::format("remove swap file {}", f.path), err);
      }
      if (f.lock_fd >= 0) close(f.lock_fd);
      f.lock_fd = -1;
    }
    files.clear();
    shards.clear();
    return first;
  }

  IoHandle Start(IoOpKind kind, const std::string& name, uint64_t off, void* buf, size_t len)
      EXCLUDES(mu) {
    std::vector<IoSegment> segs;
    {
      MutexLock lock(&mu);
      const char* what = kind == IoOpKind::kRead ? "read" : "write";
      if (closed)
        return FailedHandle(FailedPreconditionError(
            fmt::format("swap {} of shard {}: store is closed", what, name)));
      auto it = shards.find(name);
      if (it == shards.end())
        return FailedHandle(NotFoundError(fmt::format("swap {}: no shard named {}", what, name)));
      const Shard& s = it->second;
      if (off > s.size || len > s.size - off)
        return FailedHandle(OutOfRangeError(
            fmt::format("swap {} of shard {}: bytes [{}, {}) outside the shard's {} bytes", what,
                        name, off, off + len, s.size)));
      const uint64_t S = opts.stripe_unit;
      uint64_t pos = off, end = off + len;
      char* p = static_cast<char*>(buf);
      while (pos < end) {
        uint64_t k = pos / S;
        uint64_t within = pos - k * S;
        uint64_t n = std::min<uint64_t>(end, (k + 1) * S) - pos;
        size_t j = (s.first + k) % D();
        uint64_t foff = static_cast<uint64_t>(s.extent[j]) + (k / D()) * S + within;
        if (!segs.empty() && segs.back().file == files[j].file.get() &&
            segs.back().offset + segs.back().len == foff &&
            static_cast<char*>(segs.back().buf) + segs.back().len == p) {
          segs.back().len += n;  // one directory: the whole range is contiguous
        } else {
          segs.push_back(IoSegment{files[j].file.get(), p, n, foff});
        }
        pos += n;
        p += n;
      }
    }
    return io->Submit(kind, segs);
  }

  static IoHandle FailedHandle(Status s) { return IoHandle::Completed(std::move(s)); }
};

namespace {

// Creates a new swap file in `dir` with O_EXCL and takes its lock. A sweeping
// run may lock and unlink the file between the two (it looks like a
// leftover for that instant): then the lock comes on an unlinked inode
// (st_nlink 0) and a new name is tried.
StatusOr<std::pair<std::string, int>> CreateLocked(const std::string& dir) {
  constexpr int kTries = 8;
  for (int attempt = 0; attempt < kTries; ++attempt) {
    const std::string path = fmt::format("{}/{}{:016x}-{}-{}{}", dir, kSwapPrefix, ProcessToken(),
                                         getpid(), g_swap_serial.fetch_add(1), kSwapSuffix);
    Fd fd(open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (fd.fd < 0) {
      if (errno == EEXIST) continue;  // never reuse a name
      return ErrnoError(fmt::format("create swap file {} (O_EXCL)", path), errno);
    }
    int rc;
    do {
      rc = flock(fd.fd, LOCK_EX);  // held by a sweeper for an instant at most
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      const int err = errno;
      unlink(path.c_str());
      return ErrnoError(fmt::format("lock swap file {} (flock LOCK_EX)", path), err);
    }
    struct stat st {};
    if (fstat(fd.fd, &st) != 0) {
      const int err = errno;
      unlink(path.c_str());
      return ErrnoError(fmt::format("fstat swap file {}", path), err);
    }
    if (st.st_nlink == 0) continue;  // swept before we locked it
    return std::make_pair(path, fd.release());
  }
  return UnavailableError(fmt::format(
      "nvme path {}: could not create a swap file of a fresh name in {} tries", dir, kTries));
}

}  // namespace

SwapStore::SwapStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SwapStore::~SwapStore() { Close().IgnoreError(); }

StatusOr<std::unique_ptr<SwapStore>> SwapStore::Open(const SwapStoreOptions& o, IoService* io) {
  if (io == nullptr) return InvalidArgumentError("SwapStore::Open: null IoService");
  if (o.paths.empty()) return InvalidArgumentError("nvme_path: no directory given");
  if (o.capacity_bytes == 0) return InvalidArgumentError("swap store capacity is 0 bytes");
  if (o.stripe_unit == 0 || o.stripe_unit % kExtentAlign != 0)
    return InvalidArgumentError(
        fmt::format("swap stripe unit {} is not a positive multiple of 4096", o.stripe_unit));
  std::set<std::string> seen;
  for (const auto& p : o.paths)
    if (!seen.insert(p).second)
      return InvalidArgumentError(fmt::format("nvme_path lists {} twice", p));
  const uint64_t D = o.paths.size();
  const uint64_t per_file = AlignUp((o.capacity_bytes + D - 1) / D, o.stripe_unit);
  for (const auto& p : o.paths) {
    RETURN_IF_ERROR(internal::CheckWritableDir(p));
    RETURN_IF_ERROR(RemoveLeftoverSwapFiles(p).status());
    ASSIGN_OR_RETURN(uint64_t avail, internal::FreeBytes(p));
    if (avail < per_file)
      return ResourceExhaustedError(fmt::format(
          "nvme path {}: the swap file needs {} bytes ({} over {} path(s)) but only {} bytes are "
          "available",
          p, per_file, o.capacity_bytes, D, avail));
  }
  auto impl = std::make_unique<Impl>();
  impl->opts = o;
  impl->io = io;
  auto store = std::unique_ptr<SwapStore>(new SwapStore(std::move(impl)));
  Impl& m = *store->impl_;
  MutexLock lock(&m.mu);  // uncontended: the store is not shared yet
  for (const auto& p : o.paths) {
    ASSIGN_OR_RETURN(auto created, CreateLocked(p));
    auto& [path, lock_fd] = created;
    // From here the file is ours (locked): the store's Close removes it.
    m.files.push_back(
        Impl::SwapFile{path, lock_fd, nullptr, ExtentAllocator(per_file, kExtentAlign)});
    OpenOptions oo;
    oo.preallocate = per_file;
    auto f = io->Open(path, oo);
    if (!f.ok()) return f.status().WithContext(fmt::format("swap file in nvme path {}", p));
    m.files.back().file = std::move(f).value();
  }
  STRATA_LOG_DEBUG("nvme: swap store of {} bytes over {} path(s), stripe {} bytes", per_file * D, D,
                   o.stripe_unit);
  return store;
}

Status SwapStore::Allocate(const std::string& name, uint64_t bytes) {
  Impl& m = *impl_;
  MutexLock lock(&m.mu);
  if (m.closed)
    return FailedPreconditionError(fmt::format("allocate shard {}: store is closed", name));
  if (bytes == 0) return InvalidArgumentError(fmt::format("allocate shard {}: 0 bytes", name));
  if (m.shards.count(name))
    return InvalidArgumentError(
        fmt::format("allocate shard {}: a shard of that name exists", name));
  Impl::Shard s;
  s.size = bytes;
  s.first = m.next_first;
  s.extent.assign(m.D(), -1);
  s.extent_len.assign(m.D(), 0);
  for (size_t j = 0; j < m.D(); ++j) {
    uint64_t n = m.BytesInFile(s, j);
    if (n == 0) continue;
    auto off = m.files[j].alloc.Allocate(n);
    if (!off.ok()) {
      for (size_t i = 0; i < j; ++i)
        if (s.extent[i] >= 0)
          m.files[i].alloc.Free(static_cast<uint64_t>(s.extent[i]), s.extent_len[i]).IgnoreError();
      uint64_t free_total = 0;
      for (auto& f : m.files) free_total += f.alloc.free_bytes();
      return ResourceExhaustedError(fmt::format(
          "allocate shard {} of {} bytes: swap file {} cannot hold its {} bytes ({}); store has {} "
          "of {} bytes free",
          name, bytes, m.files[j].path, n, off.status().message(), free_total,
          m.files.size() * m.files[0].alloc.capacity()));
    }
    s.extent[j] = static_cast<int64_t>(*off);
    s.extent_len[j] = n;
  }
  m.next_first = (m.next_first + 1) % m.D();
  m.shards.emplace(name, std::move(s));
  return Status::Ok();
}

Status SwapStore::Free(const std::string& name) {
  Impl& m = *impl_;
  MutexLock lock(&m.mu);
  auto it = m.shards.find(name);
  if (it == m.shards.end()) return NotFoundError(fmt::format("free shard {}: no such shard", name));
  Status first;
  for (size_t j = 0; j < m.D(); ++j) {
    if (it->second.extent[j] < 0) continue;
    Status s = m.files[j].alloc.Free(static_cast<uint64_t>(it->second.extent[j]),
                                     it->second.extent_len[j]);
    if (first.ok() && !s.ok()) first = s;
  }
  m.shards.erase(it);
  return first;
}

StatusOr<ShardInfo> SwapStore::Lookup(const std::string& name) const {
  MutexLock lock(&impl_->mu);
  auto it = impl_->shards.find(name);
  if (it == impl_->shards.end()) return NotFoundError(fmt::format("no shard named {}", name));
  return ShardInfo{name, it->second.size};
}

IoHandle SwapStore::Write(const std::string& name, uint64_t off, const void* buf, size_t len) {
  return impl_->Start(IoOpKind::kWrite, name, off, const_cast<void*>(buf), len);
}

IoHandle SwapStore::Read(const std::string& name, uint64_t off, void* buf, size_t len) {
  return impl_->Start(IoOpKind::kRead, name, off, buf, len);
}

Status SwapStore::Close() {
  MutexLock lock(&impl_->mu);
  return impl_->CloseLocked();
}

uint64_t SwapStore::capacity() const {
  MutexLock lock(&impl_->mu);
  uint64_t c = 0;
  for (auto& f : impl_->files) c += f.alloc.capacity();
  return c;
}

uint64_t SwapStore::free_bytes() const {
  MutexLock lock(&impl_->mu);
  uint64_t c = 0;
  for (auto& f : impl_->files) c += f.alloc.free_bytes();
  return c;
}

size_t SwapStore::num_shards() const {
  MutexLock lock(&impl_->mu);
  return impl_->shards.size();
}

std::vector<std::string> SwapStore::swap_files() const {
  MutexLock lock(&impl_->mu);
  std::vector<std::string> v;
  for (auto& f : impl_->files) v.push_back(f.path);
  return v;
}

}  // namespace strata::nvme
