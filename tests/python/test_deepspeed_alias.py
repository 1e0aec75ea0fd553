"""The opt-in `deepspeed` alias (python3 -m strata.deepspeed.alias): with it
installed, a script whose first import is `import deepspeed.comm` or
`from deepspeed.ops.adam import ...` gets strata.deepspeed's modules (the
same objects); it never shadows a real DeepSpeed, never replaces what it
did not write, and uninstalls only its own files.
"""

import os
import subprocess
import sys

import pytest

from strata._errors import StrataError
from strata.deepspeed import alias


def run(code, *path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in path] + [env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def cli(*args):
    return alias.main(list(args))


def test_install_makes_deepspeed_submodule_imports_strata_and_uninstall_removes_it(tmp_path):
    target = tmp_path / "site"
    target.mkdir()
    assert alias.status(str(target)) == "absent"
    assert cli("install", "--target", str(target)) == 0
    init = target / "deepspeed" / "__init__.py"
    assert alias.is_alias_file(str(init)) and alias.status(str(target)) == "installed"
    umask = os.umask(0)
    os.umask(umask)
    assert (init.stat().st_mode & 0o777) == 0o644 & ~umask  # readable: it holds no weights
    assert cli("install", "--target", str(target)) == 0  # again: the same file
    r = run("import deepspeed.comm as dist\n"
            "from deepspeed.ops.adam import FusedAdam\n"
            "from deepspeed.runtime.lr_schedules import WarmupLR\n"
            "import deepspeed, strata.deepspeed as s\n"
            "assert deepspeed is s and dist is s.comm and FusedAdam is s.ops.adam.FusedAdam\n"
            "assert WarmupLR is s.runtime.lr_schedules.WarmupLR\n"
            "print('ok')", target)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    # The interpreter's cache of the alias goes with it.
    assert cli("uninstall", "--target", str(target)) == 0
    assert not (target / "deepspeed").exists()
    assert cli("uninstall", "--target", str(target)) == 0  # nothing to do
    r = run("import deepspeed.comm", target)
    assert r.returncode != 0 and "No module named 'deepspeed'" in r.stderr


def test_what_it_did_not_write_is_left_alone(tmp_path):
    target = tmp_path / "site"
    target.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (target / "deepspeed").symlink_to(elsewhere)
    with pytest.raises(StrataError, match="symbolic link.*left alone"):
        alias.install(str(target))
    assert not any(elsewhere.iterdir())
    (target / "deepspeed").unlink()
    (target / "deepspeed").mkdir()
    (target / "deepspeed" / "__init__.py").write_text("VERSION = 'someone else'\n")
    with pytest.raises(StrataError, match="another package.*left alone"):
        alias.install(str(target))
    with pytest.raises(StrataError, match="not the alias; left alone"):
        alias.uninstall(str(target))
    assert (target / "deepspeed" / "__init__.py").read_text() == "VERSION = 'someone else'\n"
    assert cli("install", "--target", str(target)) == 1


def test_a_real_deepspeed_is_never_shadowed(tmp_path):
    real = tmp_path / "real"
    (real / "deepspeed").mkdir(parents=True)
    (real / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    target = tmp_path / "site"
    target.mkdir()
    # The install refuses where DeepSpeed is importable...
    r = run("import sys\nfrom strata.deepspeed import alias\n"
            f"sys.exit(alias.main(['install', '--target', {str(target)!r}]))", real)
    assert r.returncode == 1 and "DeepSpeed is installed" in r.stderr, r.stderr
    assert not (target / "deepspeed").exists()
    # ...and without the alias, strata.deepspeed does not register itself over it.
    r = run("import sys, strata.deepspeed\nimport deepspeed\nprint(getattr(deepspeed, 'REAL', False))",
            real)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
