// Options, probes, engine selection and filesystem helpers of the nvme module.
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include "src/common/aligned_buffer.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/nvme/internal.h"
#include "src/nvme/nvme.h"

namespace strata::nvme {

std::string_view EngineKindName(EngineKind k) {
  switch (k) {
    case EngineKind::kAuto:
      return "auto";
    case EngineKind::kUring:
      return "uring";
    case EngineKind::kPosix:
      return "posix";
  }
  return "?";
}

StatusOr<EngineKind> ParseEngineKind(std::string_view text) {
  if (text == "auto") return EngineKind::kAuto;
  if (text == "uring" || text == "io_uring") return EngineKind::kUring;
  if (text == "posix") return EngineKind::kPosix;
  return InvalidArgumentError(
      fmt::format("io engine \"{}\" is not one of auto, uring, posix", text));
}

IoOptions IoOptionsFromConfig(const Config& config) {
  IoOptions o;
  switch (config.strata.io_engine) {
    case IoEngineKind::kAuto:
      o.engine = EngineKind::kAuto;
      break;
    case IoEngineKind::kUring:
      o.engine = EngineKind::kUring;
      break;
    case IoEngineKind::kPosix:
      o.engine = EngineKind::kPosix;
      break;
  }
  o.block_size = static_cast<size_t>(std::max<int64_t>(config.aio.block_size, 1));
  o.queue_depth = static_cast<int>(std::clamp<int64_t>(config.aio.queue_depth, 1, 4096));
  o.threads = static_cast<int>(std::clamp<int64_t>(config.aio.intra_op_parallelism, 1, 64));
  o.single_submit = config.aio.single_submit;
  o.sqpoll = config.strata.io_sqpoll;
  return o;
}

Status ValidateIoOptions(const IoOptions& o) {
  if (o.block_size == 0 || o.block_size % 4096 != 0 || o.block_size > (size_t{1} << 30))
    return InvalidArgumentError(fmt::format(
        "aio.block_size: {} is not a multiple of 4096 between 4096 and 1 GiB", o.block_size));
  if (o.queue_depth < 1 || o.queue_depth > 4096)
    return InvalidArgumentError(
        fmt::format("aio.queue_depth: {} is not between 1 and 4096", o.queue_depth));
  if (o.threads < 1 || o.threads > 64)
    return InvalidArgumentError(
        fmt::format("aio.intra_op_parallelism: {} is not between 1 and 64", o.threads));
  if (o.eagain_retries < 0)
    return InvalidArgumentError(fmt::format("eagain_retries: {} is negative", o.eagain_retries));
  if (o.engine == EngineKind::kAuto || o.engine == EngineKind::kUring ||
      o.engine == EngineKind::kPosix)
    return Status::Ok();
  return InvalidArgumentError("io engine: unknown kind");
}

StatusOr<EngineSelection> SelectEngine(EngineKind requested, const UringProbe& probe) {
  EngineSelection sel;
  switch (requested) {
    case EngineKind::kPosix:
      sel.kind = EngineKind::kPosix;
      return sel;
    case EngineKind::kUring:
      if (!probe.available)
        return NotSupportedError(fmt::format(
            "strata.io_engine is \"uring\" but io_uring is unavailable here ({}); use \"auto\" or "
            "\"posix\"",
            probe.error.ToString()));
      sel.kind = EngineKind::kUring;
      return sel;
    case EngineKind::kAuto:
      if (probe.available) {
        sel.kind = EngineKind::kUring;
        return sel;
      }
      sel.kind = EngineKind::kPosix;
      sel.fell_back = true;
      sel.reason = probe.error.ToString();
      STRATA_WARN_ONCE(kWarnUringFallback,
                       "nvme: io_uring is unavailable ({}); using the POSIX pread/pwrite engine",
                       sel.reason);
      return sel;
  }
  return InvalidArgumentError("io engine: unknown kind");
}

StatusOr<std::unique_ptr<IoEngine>> NewIoEngine(const IoOptions& options) {
  RETURN_IF_ERROR(ValidateIoOptions(options));
  UringProbe probe;
  if (options.engine != EngineKind::kPosix) probe = ProbeUring();
  ASSIGN_OR_RETURN(EngineSelection sel, SelectEngine(options.engine, probe));
  if (sel.kind == EngineKind::kUring) {
    auto engine = NewUringEngine(options);
    if (engine.ok() || options.engine == EngineKind::kUring) return engine;
    // The probe passed but a full-size ring did not: fall back, once, loudly.
    STRATA_WARN_ONCE(kWarnUringFallback,
                     "nvme: io_uring ring setup failed ({}); using the POSIX pread/pwrite engine",
                     engine.status().ToString());
  }
  return NewPosixEngine(options);
}

// ---------------------------------------------------------------------------
// Filesystem helpers
// ---------------------------------------------------------------------------

namespace internal {

namespace {
std::atomic<DirectOpenFn> g_direct_open{nullptr};
}  // namespace

void SetDirectOpenForTest(DirectOpenFn fn) { g_direct_open.store(fn); }

int OpenDirect(const char* path, int flags) {
  DirectOpenFn fn = g_direct_open.load();
  return fn ? fn(path, flags) : open(path, flags);
}

std::string DirName(const std::string& path) {
  auto pos = path.find_last_of('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return path.substr(0, pos);
}

std::string FsTypeName(const std::string& path) {
  struct statfs sf;
  if (statfs(path.c_str(), &sf) != 0) return "unknown";
  switch (static_cast<unsigned long>(sf.f_type)) {
    case EXT4_SUPER_MAGIC:
      return "ext4";
    case TMPFS_MAGIC:
      return "tmpfs";
    case XFS_SUPER_MAGIC:
      return "xfs";
    case BTRFS_SUPER_MAGIC:
      return "btrfs";
    case OVERLAYFS_SUPER_MAGIC:
      return "overlayfs";
    case NFS_SUPER_MAGIC:
      return "nfs";
    case PROC_SUPER_MAGIC:
      return "proc";
    case SYSFS_MAGIC:
      return "sysfs";
    default:
      return fmt::format("0x{:x}", static_cast<unsigned long>(sf.f_type));
  }
}

Status CheckWritableDir(const std::string& dir) {
  struct stat st;
  if (dir.empty()) return InvalidArgumentError("nvme path is empty");
  if (stat(dir.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT) return NotFoundError(fmt::format("nvme path {} does not exist", dir));
    return ErrnoError(fmt::format("nvme path {}: stat", dir), err);
  }
  if (!S_ISDIR(st.st_mode))
    return InvalidArgumentError(fmt::format("nvme path {} is not a directory", dir));
  struct statvfs vfs;
  // Kernel pseudo-filesystems (proc, sysfs, ...) hold no files of ours.
  if (struct statfs sf; statfs(dir.c_str(), &sf) == 0) {
    const char* pseudo = nullptr;
    switch (static_cast<unsigned long>(sf.f_type)) {
      case PROC_SUPER_MAGIC:
        pseudo = "proc";
        break;
      case SYSFS_MAGIC:
        pseudo = "sysfs";
        break;
      case DEBUGFS_MAGIC:
        pseudo = "debugfs";
        break;
      case TRACEFS_MAGIC:
        pseudo = "tracefs";
        break;
      case CGROUP_SUPER_MAGIC:
        pseudo = "cgroup";
        break;
      case CGROUP2_SUPER_MAGIC:
        pseudo = "cgroup2";
        break;
      case SECURITYFS_MAGIC:
        pseudo = "securityfs";
        break;
      case DEVPTS_SUPER_MAGIC:
        pseudo = "devpts";
        break;
      default:
        break;
    }
    if (pseudo != nullptr)
      return FailedPreconditionError(fmt::format(
          "nvme path {} is on a {} filesystem (kernel objects, no storage), not a writable "
          "regular filesystem",
          dir, pseudo));
  }
  if (statvfs(dir.c_str(), &vfs) == 0 && (vfs.f_flag & ST_RDONLY))
    return FailedPreconditionError(fmt::format("nvme path {} is on a read-only filesystem", dir));
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    int err = errno;
    return FailedPreconditionError(
        fmt::format("nvme path {} is not writable: {} (errno {})", dir, std::strerror(err), err));
  }
  return Status::Ok();
}

StatusOr<uint64_t> FreeBytes(const std::string& dir) {
  struct statvfs vfs;
  if (statvfs(dir.c_str(), &vfs) != 0) return ErrnoError(fmt::format("statvfs {}", dir), errno);
  return static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
}

static uint32_t ReadSysfsU32(const std::string& path) {
  std::ifstream in(path);
  uint64_t v = 0;
  if (in >> v) return static_cast<uint32_t>(v);
  return 0;
}

BlockSize LogicalBlockSize(int fd) {
  BlockSize b;
#ifdef STATX_DIOALIGN
  struct statx stx;
  std::memset(&stx, 0, sizeof(stx));
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN) &&
      stx.stx_dio_offset_align != 0) {
    b.bytes = std::max(stx.stx_dio_offset_align, stx.stx_dio_mem_align);
    b.source = "statx";
    return b;
  }
#endif
  struct stat st;
  if (fstat(fd, &st) == 0) {
    std::string base = fmt::format("/sys/dev/block/{}:{}", major(st.st_dev), minor(st.st_dev));
    uint32_t v = ReadSysfsU32(base + "/queue/logical_block_size");
    if (v == 0) v = ReadSysfsU32(base + "/../queue/logical_block_size");  // a partition
    if (v >= 512 && (v & (v - 1)) == 0) {
      b.bytes = v;
      b.source = "sysfs";
      return b;
    }
  }
  return b;
}

}  // namespace internal

StatusOr<DirectIoProbe> ProbeDirectIo(const std::string& dir) {
  RETURN_IF_ERROR(internal::CheckWritableDir(dir));
  DirectIoProbe r;
  std::string path = fmt::format("{}/.strata-dio-probe-{}", dir, getpid());
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    int err = errno;
    if (err != EINVAL) return ErrnoError(fmt::format("create {}", path), err);
    // The filesystem refuses O_DIRECT; report the block size of a buffered file.
    r.direct_error =
        ErrnoError(fmt::format("open {} with O_DIRECT ({})", path, internal::FsTypeName(dir)), err);
    fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoError(fmt::format("create {}", path), errno);
    auto b = internal::LogicalBlockSize(fd);
    r.logical_block_size = b.bytes;
    r.block_size_source = b.source;
    close(fd);
    unlink(path.c_str());
    return r;
  }
  auto b = internal::LogicalBlockSize(fd);
  r.logical_block_size = b.bytes;
  r.block_size_source = b.source;
  size_t n = std::max<size_t>(b.bytes, 4096);
  auto wbuf = AlignedBuffer::Allocate(n, n);
  auto rbuf = AlignedBuffer::Allocate(n, n);
  if (!wbuf.ok() || !rbuf.ok()) {
    close(fd);
    unlink(path.c_str());
    return ResourceExhaustedError(fmt::format("direct I/O probe: cannot allocate {} bytes", n));
  }
  std::mt19937_64 rng(static_cast<uint64_t>(getpid()) * 0x9E3779B97F4A7C15ull);
  for (size_t i = 0; i < n; ++i) wbuf->as<uint8_t>()[i] = static_cast<uint8_t>(rng() | 1);
  ssize_t w = pwrite(fd, wbuf->data(), n, 0);
  int werr = errno;
  ssize_t rd = w == static_cast<ssize_t>(n) ? pread(fd, rbuf->data(), n, 0) : -1;
  int rerr = errno;
  close(fd);
  unlink(path.c_str());
  if (w != static_cast<ssize_t>(n)) {
    r.direct_error =
        w < 0 ? ErrnoError(fmt::format("O_DIRECT write of {} bytes to {}", n, path), werr)
              : IOError(fmt::format("O_DIRECT write to {}: {} of {} bytes", path, w, n));
  } else if (rd != static_cast<ssize_t>(n)) {
    r.direct_error =
        rd < 0 ? ErrnoError(fmt::format("O_DIRECT read of {} bytes from {}", n, path), rerr)
               : IOError(fmt::format("O_DIRECT read from {}: {} of {} bytes", path, rd, n));
  } else if (std::memcmp(wbuf->data(), rbuf->data(), n) != 0) {
    r.direct_error =
        DataLossError(fmt::format("O_DIRECT round trip through {} changed the data", path));
  } else {
    r.direct_supported = true;
  }
  return r;
}

}  // namespace strata::nvme
