"""The spill store of strata.init: where spilled parameter values live.

Promises: ``_Store(directory)`` keeps one file per key in `directory` (a
private directory it owns: removed when its last record is discarded after
the context closed, or at exit), or a dict in RAM when `directory` is None.
write/read/copy/discard by key; a failed write, read or copy is a
StrataError naming the parameter, the file and the errno, and a short read
names the bytes expected. Knows nothing of parameters or modules
(strata.init_context does).
"""

import ctypes
import os
import shutil
import weakref


from ._errors import StrataError
from ._private_fs import PRIVATE_FILE_MODE


def _remove_tree(path):
    shutil.rmtree(path, ignore_errors=True)


def _open_for_writing(path):
    # A spill file holds weights: mode 0600 (its directory is a private
    # mkdtemp one as well), and a symlink there is never written through.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 PRIVATE_FILE_MODE)
    return os.fdopen(fd, "wb")


def _as_bytes(t):
    """A writable byte buffer over a contiguous CPU tensor's memory (for
    readinto/write; the caller keeps `t` alive while it is used). Not
    through numpy, which torch 2's wheels do not require."""
    return (ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())


class _Store:
    """Where spilled values live: one file per parameter in a private
    directory, or a dict in RAM (directory None)."""

    def __init__(self, directory):
        self.directory = directory
        self.ram = {} if directory is None else None
        self.next_key = 0
        self.live = 0  # records not discarded
        self.context_open = True
        self._finalizer = (weakref.finalize(self, _remove_tree, directory)
                           if directory is not None else None)

    def new_key(self):
        self.next_key += 1
        self.live += 1
        return self.next_key

    def path(self, key):
        return os.path.join(self.directory, f"p{key}.bin")

    def write(self, key, t, name):
        t = t.detach().contiguous()
        if self.ram is not None:
            self.ram[key] = t.clone()
            return
        path = self.path(key)
        try:
            with _open_for_writing(path) as f:
                f.write(memoryview(_as_bytes(t)))
        except OSError as e:
            raise StrataError(
                f"strata.init: writing parameter {name} ({t.numel() * t.element_size()} bytes) "
                f"to the spill file {path}: {e.strerror or e} (errno {e.errno}); give the "
                "context a spill directory with room: strata.init(spill=...) or the config's "
                "nvme_path", "Internal") from e

    def read(self, key, out, name):
        """Fills `out` (contiguous, CPU, the spilled dtype and numel)."""
        if self.ram is not None:
            out.view(-1).copy_(self.ram[key].view(-1))
            return
        path = self.path(key)
        buf = memoryview(_as_bytes(out))
        want = len(buf)
        got = 0
        try:
            with open(path, "rb", buffering=0) as f:
                while got < want:
                    n = f.readinto(buf[got:])
                    if not n:
                        break
                    got += n
        except OSError as e:
            raise StrataError(
                f"strata.init: reading spilled parameter {name} from {path}: "
                f"{e.strerror or e} (errno {e.errno})", "Internal") from e
        if got != want:
            raise StrataError(
                f"strata.init: spill file {path} of parameter {name} holds {got} bytes, "
                f"{want} expected (the file was truncated or replaced)", "DataLoss")

    def copy(self, src, dst, name):
        if self.ram is not None:
            self.ram[dst] = self.ram[src].clone()
            return
        try:
            with open(self.path(src), "rb") as fsrc, _open_for_writing(self.path(dst)) as fdst:
                offset = 0  # (sendfile: in the kernel, as shutil.copyfile copies)
                while n := os.sendfile(fdst.fileno(), fsrc.fileno(), offset, 1 << 30):
                    offset += n
        except OSError as e:
            raise StrataError(
                f"strata.init: copying the spill file of parameter {name} ({self.path(src)}) "
                f"to {self.path(dst)}: {e.strerror or e} (errno {e.errno})", "Internal") from e

    def discard(self, key):
        self.live -= 1
        if self.ram is not None:
            self.ram.pop(key, None)
        else:
            try:
                os.unlink(self.path(key))
            except OSError:
                pass
        self.maybe_remove()

    def maybe_remove(self):
        if self.live == 0 and not self.context_open and self._finalizer is not None:
            self._finalizer()
