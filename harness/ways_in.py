"""The three ways the hotfix gets into vLLM's processes, set up for real, and an engine run on each.

- plugin: pip installs the package's wheel (with its `vllm.general_plugins` entry point; built once
  per process outside the source tree, harness.wheel) into a directory on PYTHONPATH; nothing
  imports it but vLLM's plugin loader.
- site: a venv layered on the test environment, the package installed in it and its site hook
  written by `python -m vllm_hotfix install-site-hook`; VLLM_PLUGINS filters the plugin out.
- import: the launch script does `import vllm_hotfix` at its top; no plugin, no site hook.
- stock: none of them.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from harness.testenv import BUG, REPO, TestEnv, child_result, outside_checkout, site
from harness.wheel import pip_install_wheel

CAPTURE_SITE = site("capture")
WAYS = ("plugin", "site", "import", "stock")


def pip_install_hotfix(testenv: TestEnv, target: Path) -> None:
    pip_install_wheel(testenv.python, target)


def install_plugin(testenv: TestEnv, target: Path) -> str:
    pip_install_hotfix(testenv, target)
    assert list(target.glob("vllm_hotfix-*.dist-info/entry_points.txt")), "no entry points installed"
    return str(target)


def make_site_venv(testenv: TestEnv, root: Path) -> str:
    """Return the python of a venv that sees the test environment's packages plus the hotfix."""
    subprocess.run([testenv.python, "-m", "venv", "--without-pip", str(root)], check=True)
    (site,) = root.glob("lib/python*/site-packages")
    (site / "_base_env.pth").write_text(f"import site; site.addsitedir({str(testenv.site_packages())!r})\n")
    pip_install_hotfix(testenv, site)
    python = str(root / "bin" / "python")
    done = subprocess.run(
        [python, "-m", "vllm_hotfix", "install-site-hook"],
        capture_output=True,
        text=True,
        cwd=outside_checkout(),  # the installed vllm_hotfix, not the checkout's
    )
    assert done.returncode == 0 and str(site) in done.stdout, done.stderr
    return python


_ERROR_LINE = re.compile(r"^\((?:Worker|EngineCore)[^)]*\) ERROR .*?\] (\w+(?:Error|Exception): .*)$")


def root_cause(log: str) -> str | None:
    """The first error a vLLM child process logged: what a user reads above the launcher's
    generic "Engine core initialization failed" or "EngineDeadError"."""
    for line in log.splitlines():
        match = _ERROR_LINE.match(line)
        if match:
            return match.group(1)
    return None


class Ways:
    """Sets each way up once (lazily) under `work`, then runs engine_run.py through it."""

    def __init__(self, testenv: TestEnv, checkpoint: Path, work: Path) -> None:
        self.testenv, self.checkpoint, self.work = testenv, checkpoint, work
        self._plugin: str | None = None
        self._site_python: str | None = None

    def setup(self, way: str) -> tuple[tuple[str, ...], str | None, dict[str, str]]:
        """PYTHONPATH entries, the python to run, and environment variables for `way`."""
        if way == "plugin":
            self._plugin = self._plugin or install_plugin(self.testenv, self.work / "plugin-install")
            return (self._plugin,), None, {}
        if way == "site":
            self._site_python = self._site_python or make_site_venv(self.testenv, self.work / "site-venv")
            return (), self._site_python, {"VLLM_PLUGINS": "none"}
        if way == "import":
            return (str(REPO),), None, {"HARNESS_IMPORT_HOTFIX": "1", "VLLM_PLUGINS": "none"}
        if way == "stock":
            return (), None, {}
        raise ValueError(f"unknown way {way!r}; one of {WAYS}")

    def run(
        self,
        way: str,
        ids: str,
        mode: str = "eager",
        version: str = BUG,
        extra_args: list[str] | None = None,
        **env: str,
    ) -> dict[str, Any]:
        """Generate with extract_hidden_states; return the result, the consumer's states and the log."""
        import torch

        paths, python, way_env = self.setup(way)
        capture = Path(tempfile.mkdtemp(prefix="capture-", dir=self.work))
        env = {**way_env, **env, "VLLMHOTFIX_CAPTURE_DIR": str(capture)}
        env.setdefault("VLLM_CACHE_ROOT", str(capture / "vllm-cache"))
        args = [self.testenv.script("engine_run"), "--checkpoint", str(self.checkpoint)]
        args += ["--ids", ids, "--mode", mode, *(extra_args or [])]
        done = self.testenv.run(
            args, version=version, paths=(CAPTURE_SITE, *paths), python=python, timeout=1200, **env
        )
        result = child_result(done.stdout)
        if result is None:
            raise RuntimeError(f"engine run gave no result:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        # One file per process that ran the proposer (one per worker with TP > 1), in pid order.
        files = sorted(capture.glob("propose-*.pt"), key=lambda f: int(f.stem.split("-")[1]))
        per_process = [torch.load(f) for f in files]
        return {
            "result": result,
            "calls": per_process[0] if len(per_process) == 1 else None,
            "per_process": per_process,
            "log": done.stdout + done.stderr,
            "root_cause": root_cause(done.stdout + done.stderr),
        }
