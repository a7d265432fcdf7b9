"""`python -m harness.releases`, the maintainer's command that classifies every release: the
package's exit codes and `--json` document, bad arguments as one line and exit 4 before PyPI is
read. PyPI is replaced by rows made here (classify_all), so nothing here reads the network."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest

from harness import releases
from harness.releases import command
from harness.testenv import REPO
from vllm_hotfix.commands.output import SCHEMA
from vllm_hotfix.fixes import ALL_FIXES
from vllm_hotfix.judging import verdicts
from vllm_hotfix.runtime.decisions import Decision

FIX = ALL_FIXES[0].fix_id


def run(*argv: str) -> int:
    """command.main in this process: its return or exit code."""
    try:
        return command.main(list(argv))
    except SystemExit as stop:
        return int(stop.code or 0)


def _rows(verdict: Decision) -> list[releases.Row]:
    outcome = releases.Outcome(FIX, verdict, "why", "digest")
    return [releases.Row("vllm", "0.24.0", "w.whl", None, [outcome])]


@pytest.fixture
def classified(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """classify_all answers these rows (set by the test) and records how it was called."""
    calls: list[Any] = []
    rows: list[releases.Row] = []

    def classify_all(dists: Sequence[str], workers: int, first: str) -> list[releases.Row]:
        calls.append((tuple(dists), workers, first))
        return rows

    monkeypatch.setattr(releases, "classify_all", classify_all)
    return [calls, rows]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--since", "banana"], "argument --since: 'banana' is not a release number"),
        (["--workers", "0"], "argument --workers: '0' is not a whole number from 1 to 64"),
        (["--dist", "vllm-rocm"], "argument --dist: invalid choice: 'vllm-rocm'"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_4(
    argv: list[str], said: str, classified: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(*argv) == verdicts.USAGE
    out, err = capsys.readouterr()
    assert out == "" and said in err and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.startswith("python -m harness.releases: error: ") and said in line
    assert classified[0] == []  # nothing read


def test_a_usage_error_under_json_is_a_releases_document(
    classified: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("--json", "--since", "banana") == verdicts.USAGE
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == SCHEMA and document["exit_code"] == verdicts.USAGE
    assert document["command"] == "releases" and "banana" in document["error"]


def test_json_is_a_document_that_says_decision_as_status_does(
    classified: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    calls, rows = classified
    rows += _rows(Decision.PATCHED)
    assert run("--json", "--dist", "vllm", "--since", "0.18.0", "--workers", "2") == verdicts.OK
    document = json.loads(capsys.readouterr().out)
    assert (document["schema"], document["command"], document["exit_code"]) == (SCHEMA, "releases", 0)
    (found,) = document["releases"]
    assert found["fixes"][FIX]["decision"] == "patched" and found["fixes"][FIX]["reason"] == "why"
    assert calls == [(("vllm",), 2, "0.18.0")]


def test_an_unknown_verdict_exits_2_in_every_output(
    classified: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    classified[1] += _rows(Decision.UNKNOWN)
    assert run() == verdicts.INCOMPLETE
    out, err = capsys.readouterr()
    assert f"unknown: vllm 0.24.0: {FIX}: why" in out and "1 releases in" in err
    assert run("--markdown") == verdicts.INCOMPLETE
    assert "| `vllm` | 0.24.0 |" in capsys.readouterr().out
    assert run("--json") == verdicts.INCOMPLETE
    assert json.loads(capsys.readouterr().out)["exit_code"] == verdicts.INCOMPLETE


def test_an_unreadable_index_exits_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def classify_all(*args: Any, **kwargs: Any) -> list[releases.Row]:
        raise OSError("no route to host")

    monkeypatch.setattr(releases, "classify_all", classify_all)
    assert run("--json") == verdicts.ERROR
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "schema": SCHEMA,
        "command": "releases",
        "verdict": "UNKNOWN",
        "exit_code": verdicts.ERROR,
        "reason": "PyPI's index could not be read: no route to host",
        "error": "no route to host",
        "releases": [],
    }
    assert "PyPI's index could not be read: no route to host" in err


def test_it_runs_from_a_checkout_as_a_module() -> None:
    """`python -m harness.releases` in the repository's root, as docs/development.md says."""
    done = subprocess.run(
        [sys.executable, "-m", "harness.releases", "--since", "banana"],
        capture_output=True,
        text=True,
        cwd=str(REPO),
    )
    assert done.returncode == verdicts.USAGE and "'banana' is not a release number" in done.stderr
