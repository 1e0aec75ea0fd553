"""DeepSpeed's names for checkpoints under a directory, with one rule for
every reader: strata.deepspeed's save_checkpoint and load_checkpoint,
deepspeed.utils.zero_to_fp32 and strata.zero_to_fp32.

A tag names one directory directly under the checkpoint directory
(DeepSpeed's ``global_step<N>``, Strata's ``ckpt-<N>``): never empty, "."
or "..", and without "/" or control characters, so no tag, given or read
from ``latest``, reaches outside the directory. ``latest`` is a regular
file holding one tag; only a missing ``latest`` means "nothing saved yet".
A ``latest`` that is there but unusable (a symlink, a directory, a FIFO,
empty or blank, not UTF-8, or naming something that is not a tag) is
refused, naming it and why, so that a damaged one never silently restarts
a run at step 0.
"""

import os

from ._errors import InvalidArgumentError
from ._private_fs import (check_dir, check_private_dir, errno_error, open_regular_file,
                          write_file_replacing)

LATEST = "latest"

# The longest `latest` read: a tag is one directory name (NAME_MAX 255
# bytes); what is longer is not one.
_LATEST_MAX_BYTES = 4096

_TAG_RULE = "not empty, '.' or '..', and without '/' or control characters"


def _tag_problem(tag):
    if not tag or tag in (".", ".."):
        return "empty, '.' or '..'"
    if "/" in tag:
        return "holds '/'"
    if any(ord(c) < 0x20 or ord(c) == 0x7f for c in tag):
        return "holds a control character"
    return None


def check_tag(tag):
    """Raises InvalidArgumentError unless `tag` (a str) names one directory
    under the checkpoint directory."""
    if _tag_problem(tag) is not None:
        raise InvalidArgumentError(f"checkpoint tag {tag!r}: must be one directory name "
                                   f"({_TAG_RULE})", "InvalidArgument")


def tag_path(checkpoint_dir, tag):
    """checkpoint_dir/tag after check_tag."""
    tag = str(tag)
    check_tag(tag)
    return os.path.join(os.fspath(checkpoint_dir), tag)


def read_latest(checkpoint_dir, private=False):
    """The tag checkpoint_dir/latest names, or None when there is no
    `latest`. One that is there but unusable raises: a symlink, directory
    or FIFO (StrataError naming what it is; the file is opened without
    following a link or blocking), empty or blank contents, contents that
    are not UTF-8 or not a tag (InvalidArgumentError naming the file). With
    `private` it must also be this user's alone (owned by the effective
    uid, not writable by group or others), as a file whose tag is loaded
    into a run must be."""
    path = os.path.join(os.fspath(checkpoint_dir), LATEST)
    what = "checkpoint latest file"
    try:
        fd = open_regular_file(path, what, private=private)
    except FileNotFoundError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(_LATEST_MAX_BYTES + 1)
    except OSError as e:
        raise errno_error(f"{what} {path}: read", e.errno) from None

    def bad(why):
        return InvalidArgumentError(f"{what} {path}: {why}; it should hold the tag of the "
                                    "checkpoint to load (or pass tag=)", "InvalidArgument")
    if len(data) > _LATEST_MAX_BYTES:
        raise bad(f"longer than {_LATEST_MAX_BYTES} bytes, not one tag")
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise bad("not UTF-8 text") from None
    if not tag:
        raise bad("empty or blank")
    problem = _tag_problem(tag)
    if problem is not None:
        shown = tag if len(tag) <= 80 else tag[:80] + "..."
        raise bad(f"names {shown!r}, which {problem}: not one directory name ({_TAG_RULE})")
    return tag


def write_latest(checkpoint_dir, tag):
    """Writes `tag` as checkpoint_dir/latest (a new file of mode 0600 renamed
    over it; a symlink or anything but a regular file there is refused)."""
    check_tag(tag)
    write_file_replacing(os.path.join(os.fspath(checkpoint_dir), LATEST),
                         lambda f: f.write(tag.encode()), "checkpoint latest file")


def tag_dir(checkpoint_dir, tag, private=False):
    """checkpoint_dir/tag after check_tag, which must be a directory (lstat:
    not a symlink); with `private` also this user's alone
    (check_private_dir). A missing one is NotFoundError."""
    path = tag_path(checkpoint_dir, tag)
    (check_private_dir if private else check_dir)(path, "checkpoint tag directory")
    return path
