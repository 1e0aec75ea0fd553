"""An opt-in `deepspeed` package that is strata.deepspeed, for scripts whose
first DeepSpeed import is not `import deepspeed` (`import deepspeed.comm as
dist`, `from deepspeed.ops.adam import FusedAdam`) and so fail before the
line a user would change:

    /usr/bin/python3 -m strata.deepspeed.alias install [--target DIR]
    /usr/bin/python3 -m strata.deepspeed.alias status [--target DIR]
    /usr/bin/python3 -m strata.deepspeed.alias uninstall [--target DIR]

`install` writes DIR/deepspeed/__init__.py (DIR: this interpreter's
site-packages, where pip installs, unless --target names another
directory on sys.path): three lines that import strata.deepspeed and
register it, and its submodules, as `deepspeed`. It refuses where a real
DeepSpeed is importable (the alias never shadows one), where anything but
its own alias is at DIR/deepspeed, and a symlink anywhere it writes.
`uninstall` removes only what `install` wrote.
"""

import argparse
import importlib.util
import os
import stat
import sys
import sysconfig

from .._errors import InvalidArgumentError, StrataError
from .._private_fs import check_dir, errno_error, io_error, kind_of, write_file_replacing

MARKER = "# strata.deepspeed alias"
_INIT = f'''{MARKER}: `import deepspeed` is strata.deepspeed here. Written by
# `python3 -m strata.deepspeed.alias install`; removed by its `uninstall`.
from strata.deepspeed import _register_as_deepspeed
_register_as_deepspeed(alias=True)
'''


def is_alias_file(path):
    """Whether `path` is a regular file (not followed if a symlink) that
    begins with the alias's marker line. Reads it; never runs it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        return os.read(fd, len(MARKER)).decode("utf-8", "replace") == MARKER
    finally:
        os.close(fd)


def real_deepspeed():
    """The origin of an importable DeepSpeed that is not the alias, or None."""
    ours = sys.modules.get("strata.deepspeed")
    saved = sys.modules.pop("deepspeed") if sys.modules.get("deepspeed") is ours is not None else None
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        spec = None
    finally:
        if saved is not None:
            sys.modules["deepspeed"] = saved
    if spec is None or spec.origin is None:
        return None if spec is None else "a namespace package"
    return None if is_alias_file(spec.origin) else spec.origin


def default_target():
    return sysconfig.get_paths()["purelib"]


def _package_dir(target):
    check_dir(target, "strata.deepspeed.alias: --target")
    return os.path.join(target, "deepspeed")


def status(target):
    """'installed', 'absent', or what else is at target/deepspeed."""
    pkg = _package_dir(target)
    try:
        st = os.lstat(pkg)
    except FileNotFoundError:
        return "absent"
    if not stat.S_ISDIR(st.st_mode):
        return f"{kind_of(st.st_mode)} at {pkg}"
    return "installed" if is_alias_file(os.path.join(pkg, "__init__.py")) else f"another package at {pkg}"


def install(target):
    real = real_deepspeed()
    if real is not None:
        raise StrataError(f"strata.deepspeed.alias install: DeepSpeed is installed ({real}); "
                          "the alias is only for machines without it, and is not installed",
                          "FailedPrecondition")
    pkg = _package_dir(target)
    what = status(target)
    if what not in ("absent", "installed"):
        raise io_error(f"strata.deepspeed.alias install: {what}; only the alias's own package is "
                       "replaced, and this is left alone")
    if what == "absent":
        try:
            os.mkdir(pkg, 0o755)
        except OSError as e:
            raise errno_error(f"strata.deepspeed.alias install: mkdir {pkg}", e.errno) from None
    check_dir(pkg, "strata.deepspeed.alias install")
    init = os.path.join(pkg, "__init__.py")
    # (A world-readable module: it holds no weights.)
    write_file_replacing(init, lambda f: f.write(_INIT.encode()), "strata.deepspeed.alias install",
                         mode=0o644)
    return init


def uninstall(target):
    pkg = _package_dir(target)
    what = status(target)
    if what == "absent":
        return False
    if what != "installed":
        raise io_error(f"strata.deepspeed.alias uninstall: {what}, not the alias; left alone")
    cache = os.path.join(pkg, "__pycache__")
    entries = [e for e in os.listdir(pkg) if e not in ("__init__.py", "__pycache__")]
    if entries:
        raise io_error(f"strata.deepspeed.alias uninstall: {pkg} holds other files ({', '.join(entries)}); "
                       "left alone")
    if os.path.lexists(cache):
        check_dir(cache, "strata.deepspeed.alias uninstall")
        for name in os.listdir(cache):
            p = os.path.join(cache, name)
            if not (name.startswith("__init__.") and name.endswith(".pyc")
                    and stat.S_ISREG(os.lstat(p).st_mode)):
                raise io_error(f"strata.deepspeed.alias uninstall: {p} is not the alias's; left alone")
            os.unlink(p)
        os.rmdir(cache)
    os.unlink(os.path.join(pkg, "__init__.py"))
    os.rmdir(pkg)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m strata.deepspeed.alias",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["install", "uninstall", "status"])
    p.add_argument("--target", default=None,
                   help=f"the directory on sys.path to hold deepspeed/ (default: {default_target()})")
    args = p.parse_args(argv)
    target = args.target or default_target()
    try:
        if args.command == "install":
            print(f"installed {install(target)}: `import deepspeed` is strata.deepspeed")
        elif args.command == "uninstall":
            print(f"removed {os.path.join(target, 'deepspeed')}" if uninstall(target)
                  else f"no alias at {os.path.join(target, 'deepspeed')}")
        else:
            print(f"{os.path.join(target, 'deepspeed')}: {status(target)}")
            real = real_deepspeed()
            if real is not None:
                print(f"DeepSpeed itself is importable: {real}")
    except (StrataError, InvalidArgumentError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
