"""The package's layout: the runtime core, the fixes and the release tooling are each in their own
place, and the runtime path never loads the release tooling."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import stand_in_vllm
from harness.testenv import REPO

RUNTIME_PATH = """
import json, sys
import vllm_hotfix
from vllm_hotfix import plugin
plugin.register()
import vllm
from vllm.model_executor.models import deepseek_v2
vllm_hotfix.status(); vllm_hotfix.remove(); vllm_hotfix.apply()
from vllm_hotfix.cli import main
main(["status", "--json"])
print(json.dumps(sorted(name for name in sys.modules if name.startswith("vllm_hotfix"))))
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stand_in_vllm.write(tmp_path_factory.mktemp("stand-in-vllm"))


def test_the_runtime_path_never_imports_the_release_tooling(stand_in: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(PYTHONPATH=os.pathsep.join([str(stand_in), str(REPO)]), XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", RUNTIME_PATH], capture_output=True, text=True, env=env, cwd=str(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert {"vllm_hotfix.engine", "vllm_hotfix.patching", "vllm_hotfix.cli"} <= set(loaded), loaded
    assert not [name for name in loaded if name.startswith("vllm_hotfix.releases")], loaded


def _imports(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in the file names (a `from` gives both)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


# What only the release tooling may use: the network, wheel archives, and the tooling itself.
TOOLING_ONLY = ("urllib", "http", "zipfile", "vllm_hotfix.releases")


def test_runtime_core_fixes_and_release_tooling_each_in_their_own_place() -> None:
    """A structural rule, not a list of files: no module of the package outside `releases/` (the
    runtime core, the fixes, the verify check) reads the network or wheel archives or reaches the
    release tooling (only the CLI's `releases` command does), and the tooling lives in `releases/`."""
    package = REPO / "vllm_hotfix"
    core = [path for path in package.rglob("*.py") if "releases" not in path.relative_to(package).parts]
    for path in core:
        tooling = {
            name
            for name in _imports(path)
            if name.split(".")[0] in TOOLING_ONLY or name.startswith(TOOLING_ONLY)
        }
        allowed = (
            {name for name in tooling if name.startswith("vllm_hotfix.releases")}
            if path.name == "cli.py"
            else set()
        )
        assert tooling <= allowed, f"{path.relative_to(REPO)} imports {sorted(tooling - allowed)}"
    tooling_modules = [p for p in (package / "releases").glob("*.py") if p.name != "__init__.py"]
    assert tooling_modules, "no release tooling found where it belongs"
