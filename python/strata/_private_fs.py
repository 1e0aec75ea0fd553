"""Files and directories the frontend writes and reads on a machine other
users share: the rules of src/common/private_fs.h, in Python.

Strata may run as root: it never follows a symbolic link it did not make,
never opens a FIFO or device where it expects a file, never writes into a
directory another user controls, and what it creates is readable by its
own user only. The rules every function here keeps:

- A file Strata writes is new: os.open with O_CREAT | O_EXCL | O_NOFOLLOW,
  mode 0600 (the umask may take more), fsynced, then renamed over the
  target, and only when what is there is a regular file (lstat): a
  symlink, FIFO, directory or device there is refused, naming it, and left
  alone.
- A file Strata opens that exists is opened with O_NOFOLLOW | O_NONBLOCK
  (a FIFO does not block the open) and used only when fstat says it is a
  regular file.
- A directory Strata creates gets mode 0700; one it reuses must be a
  directory (lstat: not a symlink), owned by the effective uid and not
  writable by group or others.

Errors are one line naming the path and what is wrong with it: StrataError
with code "IOError" (what C++'s IOError becomes in Python), or the class of
the errno (NotFoundError for ENOENT, ResourceExhaustedError for ENOSPC), as
C++'s ErrnoError chooses.
"""

import errno
import os
import secrets
import stat

from ._errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError, StrataError

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700

# How many names write_file_replacing tries for its temporary file.
_TEMP_TRIES = 16


def kind_of(mode):
    """What a st_mode is, for a message ("a symbolic link", "a FIFO")."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "not a regular file"


def io_error(message):
    return StrataError(message, "IOError")


def errno_error(context, err):
    """`context`: strerror (errno N), in the class C++'s ErrnoError picks."""
    message = f"{context}: {os.strerror(err)} (errno {err})"
    if err == errno.ENOENT:
        return NotFoundError(message, "NotFound")
    if err in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
        return ResourceExhaustedError(message, "ResourceExhausted")
    if err == errno.EINVAL:
        return InvalidArgumentError(message, "InvalidArgument")
    return io_error(message)


def check_private(st, path, what, use="use"):
    """The owner and mode rule for what `st` (an lstat or fstat) describes:
    owned by the effective uid, not writable by group or others."""
    if st.st_uid != os.geteuid():
        raise io_error(f"{what} {path}: owned by uid {st.st_uid}, not by this process's "
                       f"({os.geteuid()}); refusing to {use} it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise io_error(f"{what} {path}: writable by group or others (mode "
                       f"{stat.S_IMODE(st.st_mode):04o}); refusing to {use} it")


def check_dir(path, what):
    """The directory at `path` (lstat: a symlink to one is refused, naming
    what is there); NotFoundError when it is missing. Returns its lstat."""
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise errno_error(f"{what} {path}: lstat", e.errno) from None
    if not stat.S_ISDIR(st.st_mode):
        raise io_error(f"{what} {path}: {kind_of(st.st_mode)}, not a directory; "
                       "refusing to use it")
    return st


def check_private_dir(path, what):
    """What is wrong with the directory at `path` for Strata to keep files
    in: a symlink or anything but a directory (check_dir), another owner,
    group or others' write permission (StrataError naming it);
    NotFoundError when it is missing."""
    check_private(check_dir(path, what), os.fspath(path), what)


def make_private_dir(path, what):
    """Creates directory `path` with mode 0700 (its parent must exist), or
    checks the one there with check_private_dir. Returns whether it was
    created."""
    path = os.fspath(path)
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
        return True
    except FileExistsError:
        pass
    except OSError as e:
        raise errno_error(f"{what} {path}: mkdir", e.errno) from None
    check_private_dir(path, what)
    return False


def make_dirs(path, what):
    """mkdir -p where each directory created gets mode 0700; directories
    that exist are left as they are (the caller names them: they may be
    shared, e.g. /tmp). The last component must end up a directory."""
    path = os.fspath(path)
    if not path:
        raise InvalidArgumentError(f"{what}: an empty path", "InvalidArgument")
    # Each prefix ending before a '/', then the whole path.
    for i in range(1, len(path) + 1):
        if (i < len(path) and path[i] != "/") or path[i - 1] == "/":
            continue
        try:
            os.mkdir(path[:i], PRIVATE_DIR_MODE)
        except FileExistsError:
            pass
        except OSError as e:
            raise errno_error(f"{what} {path}: cannot create the directory {path[:i]}",
                              e.errno) from None
    if not os.path.isdir(path):
        raise io_error(f"{what} {path}: not a directory")


def check_replaceable(path, what):
    """What is at `path` is nothing or a regular file (lstat); otherwise a
    StrataError naming it, and it is left alone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise errno_error(f"{what} {path}: lstat", e.errno) from None
    if not stat.S_ISREG(st.st_mode):
        raise io_error(f"{what} {path}: {kind_of(st.st_mode)} is there; only a regular file is "
                       "replaced, and this is left alone")


def open_regular_file(path, what, private=False):
    """A read-only descriptor of the regular file at `path` (O_NOFOLLOW |
    O_NONBLOCK | O_CLOEXEC, O_NONBLOCK cleared once open). A symlink, FIFO,
    device or directory there is a StrataError naming it; a missing file
    NotFoundError. With `private`, the file must also be owned by the
    effective uid and not writable by group or others (check_private)."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        # ELOOP: a symlink (O_NOFOLLOW); ENXIO: a FIFO without a reader.
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            try:
                st = os.lstat(path)
            except OSError:
                st = None
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise io_error(f"{what} {path}: {kind_of(st.st_mode)}, not a regular file; "
                               "refusing to open it") from None
        raise errno_error(f"{what} {path}: open", e.errno) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise io_error(f"{what} {path}: {kind_of(st.st_mode)}, not a regular file; "
                           "refusing to use it")
        if private:
            check_private(st, path, what)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_temp(path, what, mode=PRIVATE_FILE_MODE):
    """A new file beside `path`: <path>.tmp, or <path>.tmp.<random hex> when
    that name is taken (by anything: O_EXCL fails on any existing name, a
    symlink included), with `mode` (less the umask). Returns (fd, name)."""
    tmp = f"{path}.tmp"
    for i in range(_TEMP_TRIES):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         mode)
            return fd, tmp
        except FileExistsError:
            if i + 1 == _TEMP_TRIES:
                raise errno_error(f"{what} {path}: create {tmp}", errno.EEXIST) from None
        except OSError as e:
            raise errno_error(f"{what} {path}: create {tmp}", e.errno) from None
        tmp = f"{path}.tmp.{secrets.token_hex(4)}"


def _sync_dir(directory):
    # So that the rename lasts; a file system that cannot fsync a directory
    # (EINVAL) keeps the file all the same.
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_replacing(path, write, what, mode=PRIVATE_FILE_MODE):
    """Writes the file `path` as `write(f)` writes into a binary file object:
    a new temporary file in the same directory (mode 0600 unless `mode`
    says otherwise: only for files that hold no weights, _create_temp),
    fsynced, then renamed over `path` when what is there is nothing or a
    regular file (check_replaceable, before and again just before the
    rename). On error `path` is as it was and the temporary file is gone."""
    path = os.fspath(path)
    check_replaceable(path, what)
    fd, tmp = _create_temp(path, what, mode)
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno is None:
                raise
            raise errno_error(f"{what} {path}: write {tmp}", e.errno) from None
        check_replaceable(path, what)
        try:
            os.rename(tmp, path)
        except OSError as e:
            raise errno_error(f"{what}: rename {tmp} to {path}", e.errno) from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _sync_dir(os.path.dirname(path) or ".")
