// src/common/private_fs.h — files and directories that hold a run's data
// (checkpoints, plots, swap directories) on a machine other users share.
// Strata may run as root: it never follows a symbolic link it did not make,
// never opens a FIFO or device where it expects a file, never writes into a
// directory another user controls, and what it creates is readable by its
// own user only.
//
// The rules every function here keeps:
//   - A file Strata writes is new: open(2) with O_CREAT | O_EXCL |
//     O_NOFOLLOW, mode 0600 (the umask may take more). A file that replaces
//     another is written under a new temporary name and renamed over it,
//     and only when what is there is a regular file (lstat).
//   - A file Strata opens that exists (a lock, a manifest) is opened with
//     O_NOFOLLOW | O_NONBLOCK (a FIFO does not block the open) and used only
//     when fstat says it is a regular file.
//   - A directory Strata creates gets mode 0700; one it reuses must be a
//     directory (lstat: not a symlink), owned by the effective uid and not
//     writable by group or others.
// Every error names the path and what is wrong with it.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

// What a file of mode `mode` is, for messages: "a symbolic link", "a FIFO",
// "a directory", "a device", "a socket", "a regular file".
const char* FileKind(mode_t mode);

// The permissions of what these functions create.
inline constexpr mode_t kPrivateFileMode = 0600;
inline constexpr mode_t kPrivateDirMode = 0700;

// What is wrong with the directory at `path` for Strata to keep files in
// (IOError "<what> <path>: a symbolic link, not a directory",
// "...: owned by uid 1001, not by this process's (0)", "...: writable by
// group or others (mode 0777)"); NotFound when it is missing. `what` names
// it for the message ("nvme_path", "checkpoint").
Status CheckPrivateDir(const std::string& path, std::string_view what);

// Creates directory `path` with mode 0700 (its parent must exist), or checks
// the one there with CheckPrivateDir. Returns whether it was created.
StatusOr<bool> MakePrivateDir(const std::string& path, std::string_view what);

// mkdir -p where each directory created gets mode 0700; directories that
// exist are left as they are (the caller names them: they may be shared,
// e.g. /tmp). The last component must end up a directory (stat: a symlink
// the caller named is followed). `what` names the option for the message.
Status MakeDirs(const std::string& path, std::string_view what);

// What is at `path` is nothing or a regular file (lstat); otherwise
// IOError naming it ("a symbolic link", "a directory", "a FIFO",
// "not a regular file"), and it is left alone.
Status CheckReplaceable(const std::string& path, std::string_view what);

// Creates a new file at `path` (O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
// mode 0600, `flags` added: O_WRONLY or O_RDWR). Fails on any name that
// exists, a symlink included. Returns the descriptor.
StatusOr<int> CreateNewFile(const std::string& path, int flags, std::string_view what);

// Opens the regular file at `path` with `flags` (O_RDONLY, O_RDWR, O_CREAT
// ...; O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC added, O_NONBLOCK cleared again
// once open). A symlink, FIFO, device or directory there is
// IOError naming it; with O_CREAT a new file gets mode 0600.
StatusOr<int> OpenRegularFile(const std::string& path, int flags, std::string_view what);

// Writes `contents` as the file `path`: a new temporary file in the same
// directory (<path>.tmp, or <path>.tmp.<random hex> when taken), fsync'd,
// then renamed over `path` when what is there is nothing or a regular file
// (CheckReplaceable). On error `path` is as it was.
Status WriteFileReplacing(const std::string& path, std::string_view contents,
                          std::string_view what);

// Whether `s` holds a control character (below 0x20, or 0x7f): a path given
// on a command line must not (a newline in it would split a line-based
// record).
bool HasControlChar(std::string_view s);

}  // namespace strata
