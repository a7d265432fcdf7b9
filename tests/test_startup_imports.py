"""What `import vllm_hotfix` and the site hook load before vLLM is imported: exactly the package's
`__init__.py`, nothing of the standard library beyond what a bare interpreter already has.

Every Python process of an environment with the site hook pays for these imports, and most never
touch vLLM, and each module file more is a lookup and a read in every one of them. A module-set
comparison is deterministic, unlike a timing: one stray import such as `collections.abc` (about
3 ms, measured by benchmarks/startup.py), or a module of the package imported at module level
instead of when first needed, fails it on any machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.site_venvs import make_venv
from harness.testenv import REPO, outside_checkout

# The package's front, one file holding the import trigger: the version, the error policy and
# everything else are imported when first needed.
ALLOWED = ["vllm_hotfix"]

MODULES = "import json, sys; print(json.dumps(sorted(sys.modules)))"
ADDED = (
    "import json, sys; before = set(sys.modules); import vllm_hotfix;"
    " print(json.dumps(sorted(set(sys.modules) - before)))"
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLLMHOTFIX_", "PYTHON"))}
    env.update(extra)
    return env


def _json_out(python: str, code: str, env: dict[str, str] | None = None) -> list[str]:
    done = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, env=env, cwd=outside_checkout(), check=True
    )
    assert done.stderr == "", done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def added_by_import(package_parent: Path) -> list[str]:
    """The modules `import vllm_hotfix` adds in a fresh interpreter (no vLLM imported)."""
    return _json_out(sys.executable, ADDED, _clean_env(PYTHONPATH=str(package_parent)))


def test_import_adds_exactly_the_allow_list() -> None:
    assert added_by_import(REPO) == ALLOWED


def test_the_site_hook_adds_exactly_the_allow_list(tmp_path: Path) -> None:
    plain = make_venv(tmp_path / "plain", hook=False)
    hooked = make_venv(tmp_path / "hooked", hook=True)
    without = set(_json_out(plain, MODULES, _clean_env()))
    with_hook = set(_json_out(hooked, MODULES, _clean_env()))
    assert sorted(with_hook - without) == ALLOWED
    assert without <= with_hook


PLANTED = {
    "a stray standard-library import": "from collections.abc import Callable",
    "typing": "import typing",
    "the version at module level": "from vllm_hotfix._version import __version__ as _v",
    "the error policy at module level": "from vllm_hotfix.runtime import containment as _c",
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_planted_import_fails_the_check(tmp_path: Path, planted: str) -> None:
    """The check can fail: the same comparison on a copy of the package with one stray import."""
    copy = tmp_path / "vllm_hotfix"
    shutil.copytree(REPO / "vllm_hotfix", copy, ignore=shutil.ignore_patterns("__pycache__"))
    front = copy / "__init__.py"
    front.write_text(front.read_text(encoding="utf-8") + f"\n{PLANTED[planted]}\n", encoding="utf-8")
    added = added_by_import(tmp_path)
    assert added != ALLOWED
    assert set(added) - set(ALLOWED), added
