"""Runs the frontend's pytest suite (CTest: python_frontend); exit 77 = skipped."""
import importlib.util
import sys

missing = [m for m in ("torch", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    print(f"skipped: {sys.executable} has no {', '.join(missing)} "
          "(Debian: python3-torch python3-pytest; scripts/setup.sh installs them)")
    sys.exit(77)

import pytest  # noqa: E402

sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
