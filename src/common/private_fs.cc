#include "src/common/private_fs.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <random>

#include "src/common/status_util.h"

namespace strata {
namespace {

// How many names WriteFileReplacing tries for its temporary file.
constexpr int kTempTries = 16;

}  // namespace

const char* FileKind(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISREG(mode)) return "a regular file";
  return "not a regular file";
}

Status CheckPrivateDir(const std::string& path, std::string_view what) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0)
    return ErrnoError(fmt::format("{} {}: lstat", what, path), errno);
  if (!S_ISDIR(st.st_mode))
    return IOError(fmt::format("{} {}: {}, not a directory; refusing to use it", what, path,
                               FileKind(st.st_mode)));
  if (st.st_uid != ::geteuid())
    return IOError(
        fmt::format("{} {}: owned by uid {}, not by this process's ({}); refusing to use it", what,
                    path, st.st_uid, ::geteuid()));
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0)
    return IOError(
        fmt::format("{} {}: writable by group or others (mode {:04o}); refusing to use it", what,
                    path, st.st_mode & 07777));
  return Status();
}

StatusOr<bool> MakePrivateDir(const std::string& path, std::string_view what) {
  if (::mkdir(path.c_str(), kPrivateDirMode) == 0) return true;
  if (errno != EEXIST) return ErrnoError(fmt::format("{} {}: mkdir", what, path), errno);
  RETURN_IF_ERROR(CheckPrivateDir(path, what));
  return false;
}

Status MakeDirs(const std::string& path, std::string_view what) {
  if (path.empty()) return InvalidArgumentError(fmt::format("{}: an empty path", what));
  // Each prefix ending before a '/', then the whole path.
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i < path.size() && path[i] != '/') continue;
    if (path[i - 1] == '/') continue;
    const std::string prefix = path.substr(0, i);
    if (::mkdir(prefix.c_str(), kPrivateDirMode) != 0 && errno != EEXIST)
      return ErrnoError(fmt::format("{} {}: cannot create the directory {}", what, path, prefix),
                        errno);
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoError(fmt::format("{} {}", what, path), errno);
  if (!S_ISDIR(st.st_mode)) return IOError(fmt::format("{} {}: not a directory", what, path));
  return Status();
}

Status CheckReplaceable(const std::string& path, std::string_view what) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status();
    return ErrnoError(fmt::format("{} {}: lstat", what, path), errno);
  }
  if (S_ISREG(st.st_mode)) return Status();
  return IOError(
      fmt::format("{} {}: {} is there; only a regular file is replaced, and this is left alone",
                  what, path, FileKind(st.st_mode)));
}

StatusOr<int> CreateNewFile(const std::string& path, int flags, std::string_view what) {
  const int fd =
      ::open(path.c_str(), flags | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, kPrivateFileMode);
  if (fd < 0) {
    const int err = errno;
    struct stat st;
    if (err == EEXIST && ::lstat(path.c_str(), &st) == 0)
      return IOError(fmt::format("{} {}: {} is there already; a new file was expected", what, path,
                                 FileKind(st.st_mode)));
    return ErrnoError(fmt::format("{} {}: create", what, path), err);
  }
  return fd;
}

StatusOr<int> OpenRegularFile(const std::string& path, int flags, std::string_view what) {
  const int fd =
      ::open(path.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, kPrivateFileMode);
  if (fd < 0) {
    const int err = errno;
    struct stat st;
    // ELOOP: a symlink (O_NOFOLLOW); ENXIO: a FIFO without a reader.
    if ((err == ELOOP || err == ENXIO || err == EISDIR) && ::lstat(path.c_str(), &st) == 0 &&
        !S_ISREG(st.st_mode))
      return IOError(fmt::format("{} {}: {}, not a regular file; refusing to open it", what, path,
                                 FileKind(st.st_mode)));
    return ErrnoError(fmt::format("{} {}: open", what, path), err);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoError(fmt::format("{} {}: fstat", what, path), err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return IOError(fmt::format("{} {}: {}, not a regular file; refusing to use it", what, path,
                               FileKind(st.st_mode)));
  }
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoError(fmt::format("{} {}: fcntl", what, path), err);
  }
  return fd;
}

Status WriteFileReplacing(const std::string& path, std::string_view contents,
                          std::string_view what) {
  RETURN_IF_ERROR(CheckReplaceable(path, what));
  std::random_device rd;
  std::string tmp = path + ".tmp";
  int fd = -1;
  for (int i = 0;; ++i) {
    fd =
        ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, kPrivateFileMode);
    if (fd >= 0) break;
    if (errno != EEXIST || i + 1 == kTempTries)
      return ErrnoError(fmt::format("{} {}: create {}", what, path, tmp), errno);
    tmp = fmt::format("{}.tmp.{:08x}", path, rd());
  }
  Status s;
  for (size_t done = 0; done < contents.size() && s.ok();) {
    const ssize_t w = ::write(fd, contents.data() + done, contents.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0)
      s = ErrnoError(fmt::format("{} {}: write {}", what, path, tmp), errno);
    else
      done += static_cast<size_t>(w);
  }
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoError(fmt::format("{}: fsync {}", what, tmp), errno);
  if (::close(fd) != 0 && s.ok()) s = ErrnoError(fmt::format("{}: close {}", what, tmp), errno);
  if (s.ok()) s = CheckReplaceable(path, what);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
    s = ErrnoError(fmt::format("{}: rename {} to {}", what, tmp, path), errno);
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

bool HasControlChar(std::string_view s) {
  for (const char c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return true;
  return false;
}

}  // namespace strata
