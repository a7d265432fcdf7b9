"""Small venvs for start-up checks: the hotfix installed, with or without its site hook.

No vLLM here: these are the many Python processes of an environment that never import vLLM.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.testenv import outside_checkout
from harness.wheel import pip_install_wheel


def make_venv(root: Path, python: str = sys.executable, hook: bool = True) -> str:
    """A venv (no pip) with vllm_hotfix installed from this checkout's wheel (harness.wheel, built once
    per process); its site hook if `hook`."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(root)], check=True)
    (site,) = root.glob("lib/python*/site-packages")
    pip_install_wheel(python, site)
    venv_python = str(root / "bin" / "python")
    if hook:
        subprocess.run(
            [venv_python, "-m", "vllm_hotfix", "install-site-hook"],
            check=True,
            capture_output=True,
            cwd=outside_checkout(),  # the installed vllm_hotfix, not the checkout's
        )
    return venv_python
