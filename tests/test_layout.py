"""The package's layout: the runtime core, the fixes and the check in the package, the release
tooling in the repository's maintainer tooling (harness/releases/, not shipped), and the package
never reaching the repository's tooling, at run time or by an import."""

from __future__ import annotations

import ast
import json
import os
import shutil
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
from vllm_hotfix.commands.cli import main
main(["status", "--json"])
print(json.dumps(sorted(name for name in sys.modules if name.startswith(("vllm_hotfix", "harness")))))
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stand_in_vllm.write(tmp_path_factory.mktemp("stand-in-vllm"))


def test_the_runtime_path_never_imports_the_repositorys_tooling(stand_in: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(PYTHONPATH=os.pathsep.join([str(stand_in), str(REPO)]), XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", RUNTIME_PATH], capture_output=True, text=True, env=env, cwd=str(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert {"vllm_hotfix.runtime.arming", "vllm_hotfix.runtime.patching", "vllm_hotfix.commands.cli"} <= set(
        loaded
    ), loaded
    assert not [name for name in loaded if name.startswith("harness")], loaded  # on its sys.path


PLUGIN_PATH = """
import json, sys
from vllm_hotfix import plugin
plugin.register()
import vllm
from vllm.model_executor.models import deepseek_v2
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] == "vllm_hotfix")))
"""
# What a vLLM process of an ordinary server loads of the package: the front, the plugin, the
# version, and the rooms every vLLM process needs (runtime, fixes); never the check, the audit,
# judging or the command line.
PLUGIN_ROOMS = ("vllm_hotfix.runtime", "vllm_hotfix.fixes")
PLUGIN_MODULES = {"vllm_hotfix", "vllm_hotfix.plugin", "vllm_hotfix._version"}


def test_a_vllm_process_loads_only_the_runtime_and_the_fixes(stand_in: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLLMHOTFIX_", "PYTHON"))}
    env.update(PYTHONPATH=os.pathsep.join([str(stand_in), str(REPO)]), XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", PLUGIN_PATH], capture_output=True, text=True, env=env, cwd=str(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert {"vllm_hotfix.runtime.arming", "vllm_hotfix.fixes.deepseek_final_aux"} <= loaded, loaded
    other = {n for n in loaded - PLUGIN_MODULES if not n.startswith(PLUGIN_ROOMS)}
    assert other == set(), f"a vLLM process loaded {sorted(other)}"


def _imports(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in the file names (a `from` gives both)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


# What no module of the package may import: the network and wheel archives (the release tooling's
# work) and the repository's tooling, which the wheel does not ship.
NOT_IN_THE_PACKAGE = ("urllib", "http", "zipfile", "harness", "tests", "scripts")


def test_the_package_never_imports_the_release_tooling_which_lives_in_harness() -> None:
    """A structural rule, not a list of files: no module of the package (the runtime core, the
    fixes, the check, the command line) reads the network or wheel archives or imports the
    repository's tooling, so the wheel works without it; the release tooling is in harness/releases/,
    run as `python -m harness.releases`, and the package has no releases/ of its own."""
    package = REPO / "vllm_hotfix"
    for path in package.rglob("*.py"):
        wrong = {name for name in _imports(path) if name.split(".")[0] in NOT_IN_THE_PACKAGE}
        assert not wrong, f"{path.relative_to(REPO)} imports {sorted(wrong)}"
    assert not list(package.glob("releases/*.py")), "the release tooling is back in the package"
    tooling = REPO / "harness" / "releases"
    assert (tooling / "__main__.py").is_file() and (tooling / "command.py").is_file()


def test_no_import_circles_in_the_package() -> None:
    """No two modules of the package import each other, directly or round a longer circle, counting
    imports inside functions too (check/checks.py and check/reference.py once did). An edge
    `from vllm_hotfix.runtime import settings` goes to that module, not to the package's __init__."""
    package = REPO / "vllm_hotfix"
    modules = {
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): path
        for path in package.rglob("*.py")
    }
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
                found |= subs or {node.module}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        edges[name] = (found & modules.keys()) - {name}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for step in edges[start] - seen:
            seen.add(step)
            if step == goal or reaches(step, goal, seen):
                return True
        return False

    circles = sorted(name for name in modules if reaches(name, name, set()))
    assert circles == [], f"modules on an import circle: {circles}"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter on the package under `root`, with pyproject.toml's contracts (the rooms)."""
    beside = Path(sys.executable).parent / "lint-imports"
    tool = str(beside) if beside.exists() else shutil.which("lint-imports")
    if tool is None:
        pytest.fail("import-linter is not installed: scripts/build-test-env.sh installs it (TEST_TOOLS)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(root)
    return subprocess.run(
        [tool, "--config", str(root / "pyproject.toml"), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=str(root),
        env=env,
    )


def test_the_rooms_import_downward_only() -> None:
    """pyproject.toml's contracts: commands, then the check and the audit (independent), judging,
    the fixes, the runtime; imports inside functions count, and a new module must join a room."""
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 1 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(
    ("module", "planted"),
    [
        ("runtime/store.py", "from vllm_hotfix.commands import cli"),
        ("check/taps.py", "from vllm_hotfix import audit"),
        ("judging/precision.py", "import vllm_hotfix.check.records"),
    ],
)
def test_an_upward_import_breaks_the_rooms(tmp_path: Path, module: str, planted: str) -> None:
    """The same contracts on a copy of the package with one import planted inside a function."""
    shutil.copytree(
        REPO / "vllm_hotfix", tmp_path / "vllm_hotfix", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "vllm_hotfix" / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n\ndef _planted() -> None:\n    {planted}\n")
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 0 kept, 1 broken." in done.stdout


# The repository's non-package code, by job: harness/ (drivers used from the test process),
# harness/child/ (what runs inside a child interpreter), gpu/ (the GPU kit), benchmarks/, scripts/.
CHILD = REPO / "harness" / "child"
HOST_CODE = ("harness", "gpu", "benchmarks", "scripts", "tests")


def _top_level_imports(path: Path) -> set[str]:
    """The modules the file imports when it is imported (module level, not inside a function)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _host_files() -> list[Path]:
    return [
        path for folder in HOST_CODE for path in (REPO / folder).rglob("*.py") if CHILD not in path.parents
    ]


def test_child_code_never_reaches_the_repository() -> None:
    """A harness/child/ script runs by path with the test environment's Python and the repository
    off sys.path (stock vLLM, no vllm_hotfix from the checkout): it imports its siblings by bare
    name, never `harness.*`, and a bare name it imports is a sibling."""
    drivers = {path.stem for path in (REPO / "harness").glob("*.py")} - {"__init__"}
    for path in CHILD.rglob("*.py"):
        wrong = sorted(n for n in _imports(path) if n.split(".")[0] in {"harness", *drivers})
        assert not wrong, f"{path.relative_to(REPO)} imports {wrong}"


def test_the_test_process_reaches_child_code_only_as_harness_child() -> None:
    """Drivers, the GPU kit, benchmarks, scripts and tests import harness/child/ modules as
    `harness.child.NAME` (never by bare name), and only those that import no sibling at module
    level, so that the import works without harness/child on sys.path."""
    siblings = {path.stem for path in CHILD.glob("*.py")} - {"__init__"}
    for path in _host_files():
        names = _imports(path)
        bare = sorted(n for n in names if n.split(".")[0] in siblings)
        assert not bare, f"{path.relative_to(REPO)} imports child modules by bare name: {bare}"
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["harness", "child"] and len(parts) > 2 and parts[2] in siblings:
                child = CHILD / f"{parts[2]}.py"
                top = {n.split(".")[0] for n in _top_level_imports(child)} & siblings
                assert not top, f"{path.relative_to(REPO)} imports {child.name}, which imports {top} at load"
