"""The hotfix as users install it: an sdist and a wheel built from a copy of this checkout.

`pip install <checkout>` builds inside the checkout (setuptools leaves build/ and *.egg-info there)
and builds again for every venv. The harness instead builds one wheel per process, from a copy of
the source tree in a temporary directory, and installs that wheel wherever the hotfix must be
installed (`hotfix_wheel()`). Each pytest-xdist worker is a process of its own and builds its own
wheel into its own directory: nothing is shared between workers, so nothing needs a lock.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from harness.testenv import REPO

# What a copy of the checkout leaves out: version control, caches and earlier build outputs.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    "__pycache__",
    "*.pyc",
    "build",
    "dist",
    "*.egg-info",
    ".venv",
    ".pytest_cache",
    ".ruff_cache",
    "gpu-bundle",
)


def copy_source(dest: Path) -> Path:
    """Copy this checkout (without .git, caches, build outputs) to `dest`, which must not exist."""
    shutil.copytree(REPO, dest, ignore=_NOT_SOURCES)
    return dest


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def build_sdist(source: Path, out: Path, python: str = sys.executable) -> Path:
    """Build the sdist of `source` into `out` with setuptools' PEP 517 hook (no isolation, offline),
    as `python -m build --sdist --no-isolation` does; return its path."""
    out.mkdir(parents=True, exist_ok=True)
    code = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    name = _run([python, "-c", code, str(out)], cwd=source).strip().splitlines()[-1]
    return out / name


def build_wheel(source: Path, out: Path, python: str = sys.executable) -> Path:
    """Build the wheel of `source` (a source tree or an unpacked sdist) into `out`, with the
    setuptools of `python` (offline); return its path."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.whl"))
    pip = [python, "-m", "pip", "--disable-pip-version-check", "wheel", "-q", "--no-deps"]
    _run([*pip, "--no-build-isolation", "-w", str(out), str(source)])
    (wheel,) = set(out.glob("*.whl")) - before
    return wheel


_lock = threading.Lock()
_wheel: Path | None = None


def hotfix_wheel() -> Path:
    """This checkout's wheel, built on the first call in this process into a temporary directory
    outside the source tree (removed when the process exits); later calls return the same file."""
    global _wheel
    with _lock:
        if _wheel is None or not _wheel.exists():
            work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-wheel-"))
            atexit.register(shutil.rmtree, work, ignore_errors=True)
            _wheel = build_wheel(copy_source(work / "src"), work / "dist")
        return _wheel


def pip_install_wheel(python: str, target: Path) -> None:
    """Install the hotfix's wheel (no dependencies) into the directory `target` with `python`'s pip."""
    pip = [python, "-m", "pip", "--disable-pip-version-check", "install", "-q", "--no-deps"]
    _run([*pip, "--target", str(target), str(hotfix_wheel())])
