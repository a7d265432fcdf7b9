"""Small venvs for start-up checks: the hotfix installed, with or without its site hook.

No vLLM here: these are the many Python processes of an environment that never import vLLM.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.testenv import REPO


def make_venv(root: Path, python: str = sys.executable, hook: bool = True) -> str:
    """A venv (no pip) with vllm_hotfix installed from this checkout; its site hook if `hook`."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(root)], check=True)
    (site,) = root.glob("lib/python*/site-packages")
    pip = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    subprocess.run([*pip, str(REPO)], check=True, capture_output=True)
    venv_python = str(root / "bin" / "python")
    if hook:
        subprocess.run(
            [venv_python, "-m", "vllm_hotfix", "install-sitecustomize"], check=True, capture_output=True
        )
    return venv_python
