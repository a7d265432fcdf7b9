"""The README's first command works as written, copied into a shell on a fresh machine: it clones the
repository the package's metadata names and installs the clone (the package is not on PyPI yet:
docs/releasing.md's checklist adds `pip install vllm-hotfix` once it is)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.testenv import REPO
from tests.network import network_unavailable

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def first_command() -> str:
    """The first line of the README's Quick start code block, without its comment."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.splitlines()[0].split("  #", 1)[0].strip()


def repository() -> str:
    urls = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]
    return str(urls["Repository"])


def test_the_first_command_clones_the_repository_the_package_names_and_installs_it() -> None:
    url = repository()
    assert first_command() == f"git clone {url} && pip install ./{url.rsplit('/', 1)[1]}"


def test_releasing_says_when_the_index_line_joins_it() -> None:
    releasing = (REPO / "docs" / "releasing.md").read_text(encoding="utf-8")
    checklist = releasing.split("## Each release", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"\n\d+\. ", checklist)
    assert [item for item in items if "Quick start" in item and "`pip install vllm-hotfix`" in item]


@pytest.mark.network
def test_the_first_command_in_a_fresh_venv(tmp_path: Path) -> None:
    """Run as written, with the repository's URL replaced by a clone of this checkout under the same
    name (only PyPI is reachable from the tests; pip fetches setuptools and wrapt there)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout")
    try:
        urllib.request.urlopen("https://pypi.org/simple/wrapt/", timeout=10).close()
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        network_unavailable(f"PyPI cannot be reached: {error}")
    url = repository()
    stand_in = tmp_path / "origin" / url.rsplit("/", 1)[1]
    stand_in.parent.mkdir()
    stand_in.symlink_to(REPO)
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    work = tmp_path / "work"
    work.mkdir()
    ours = ("PYTHON", "VLLM_", "VLLMHOTFIX_", "PIP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env["PATH"] = f"{tmp_path / 'venv' / 'bin'}{os.pathsep}{env['PATH']}"  # the venv, activated
    command = first_command().replace(url, str(stand_in))
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=work, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    status = subprocess.run(["vllm-hotfix", "status"], capture_output=True, text=True, cwd=work, env=env)
    python = tmp_path / "venv" / "bin" / "python"
    assert status.returncode == 2, status.stdout + status.stderr  # no vLLM in this venv: it says so
    assert status.stderr.startswith("vllm-hotfix status: no vLLM importable by ")
    assert Path(status.stderr.split(" by ", 1)[1].split(":", 1)[0]).parent == python.parent
