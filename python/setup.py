"""pip's way in to the Python package `strata` (see pyproject.toml).

    pip install --no-build-isolation ./python

builds, for the interpreter pip runs under:
  1. libstrata.so from this checkout, with CMake into
     <checkout>/build/pip-<python tag> (the library alone: no tests, no
     benchmarks; STRATA_CMAKE_ARGS adds CMake arguments, for example
     -DSTRATA_CUDA=OFF), unless STRATA_BUILD_DIR names a build tree that
     already holds it;
  2. the _strata extension against it (python/CMakeLists.txt standalone,
     as scripts/build_python.sh does): pybind11 and a DLPack header from the
     interpreter (pip's pybind11, torch's DLPack) or the system.
Both go into the package (the extension finds the library beside itself),
with the frontend's Python files; `pip uninstall strata` removes them all.
Needs CMake, Ninja or make, a C++20 compiler and the library's Debian
packages (scripts/setup.sh installs them).
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _version():
    m = re.search(r"project\(strata VERSION ([0-9.]+)", (ROOT / "CMakeLists.txt").read_text())
    if not m:
        raise RuntimeError(f"no 'project(strata VERSION ...)' in {ROOT / 'CMakeLists.txt'}")
    return m.group(1)


def _run(cmd, what):
    print(f"strata setup.py: {what}: {shlex.join(str(c) for c in cmd)}", flush=True)
    r = subprocess.run([str(c) for c in cmd])
    if r.returncode != 0:
        raise RuntimeError(f"strata setup.py: {what} failed (exit {r.returncode}): "
                           f"{shlex.join(str(c) for c in cmd)}")


def _generator():
    return ["-G", "Ninja"] if shutil.which("ninja") else []


def _jobs():
    return os.environ.get("STRATA_JOBS") or str(os.cpu_count() or 1)


class CMakeBuild(build_ext):
    """The extension is built by CMake, not by setuptools' compiler."""

    def build_extension(self, ext):
        if shutil.which("cmake") is None:
            raise RuntimeError("strata setup.py: cmake is not installed (apt-get install cmake "
                               "ninja-build; scripts/setup.sh installs every build dependency)")
        tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
        lib_build = os.environ.get("STRATA_BUILD_DIR")
        if lib_build:
            lib_build = Path(lib_build).resolve()
            if not (lib_build / "libstrata.so").exists():
                raise RuntimeError(f"strata setup.py: STRATA_BUILD_DIR={lib_build} holds no "
                                   "libstrata.so (build it: scripts/setup.sh)")
        else:
            lib_build = ROOT / "build" / f"pip-{tag}"
            _run(["cmake", "-S", ROOT, "-B", lib_build, *_generator(), "-DCMAKE_BUILD_TYPE=Release",
                  "-DSTRATA_BUILD_TESTS=OFF", "-DSTRATA_BUILD_BENCH=OFF", "-DSTRATA_PYTHON=OFF",
                  f"-DPython_EXECUTABLE={sys.executable}",
                  *shlex.split(os.environ.get("STRATA_CMAKE_ARGS", ""))],
                 "configure libstrata")
            _run(["cmake", "--build", lib_build, "-j", _jobs(), "--target", "strata"],
                 "build libstrata")
        ext_build = ROOT / "build" / f"pip-ext-{tag}"
        _run(["cmake", "-S", HERE, "-B", ext_build, *_generator(), "-DCMAKE_BUILD_TYPE=Release",
              f"-DSTRATA_BUILD_DIR={lib_build}", f"-DPython_EXECUTABLE={sys.executable}",
              "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN"],
             "configure the extension")
        _run(["cmake", "--build", ext_build, "-j", _jobs(), "--target", "_strata"],
             "build the extension")
        built = sorted((ext_build / "python" / "strata").glob("_strata*.so"))
        if not built:
            raise RuntimeError(f"strata setup.py: no _strata*.so in {ext_build / 'python/strata'}")
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], dest)
        # The library under its soname (what the extension's DT_NEEDED names).
        soname = os.path.realpath(lib_build / "libstrata.so")
        so = next((p for p in sorted(lib_build.glob("libstrata.so.*"))
                   if p.name.count(".") == 2), None)
        shutil.copyfile(soname, dest.parent / (so.name if so else "libstrata.so"))


setup(
    name="strata",
    version=_version(),
    description="Strata's PyTorch frontend: train with optimizer states and parameters "
                "offloaded to CPU memory and NVMe, configured with DeepSpeed JSON",
    python_requires=">=3.9",
    packages=find_packages(where=str(HERE), include=["strata", "strata.*"]),
    package_dir={"": "."},
    ext_modules=[Extension("strata._strata", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
