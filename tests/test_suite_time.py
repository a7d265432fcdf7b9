"""tests/suite_time.py: the suite's wall time at the end of a run, and the warning past the threshold,
said by the pytest-xdist controller as scripts/test.sh runs the suite, never failing the run.

A small suite runs in a child pytest with the plugin and the threshold lowered to 0 minutes (it
must warn) or left at 60 (it must not); a few seconds each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.testenv import REPO
from tests.suite_time import THRESHOLD_VAR, WARNING

SMALL_SUITE = """
import time
import pytest

pytestmark = [pytest.mark.xdist_group("one")]


@pytest.mark.parametrize("i", range(4))
def test_takes_a_little_time(i):
    time.sleep(0.05)
"""
FAILING = "\n\ndef test_fails():\n    assert False\n"


def run_suite(
    tmp_path: Path, threshold: str | None, *args: str, failing: bool = False
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_small.py").write_text(SMALL_SUITE + (FAILING if failing else ""))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)}
    if threshold is not None:
        env[THRESHOLD_VAR] = threshold
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.suite_time", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _said(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stdout.splitlines() if "suite wall time" in line]


def test_the_controller_warns_past_the_threshold_under_xdist(tmp_path: Path) -> None:
    """As scripts/test.sh runs the suite: two workers, --dist loadgroup."""
    pytest.importorskip("xdist")
    done = run_suite(tmp_path, "0", "-n", "2", "--dist", "loadgroup")
    assert done.returncode == 0, done.stdout + done.stderr  # a warning, not a failure
    (line,) = _said(done)
    assert line.startswith(f"{WARNING}: suite wall time ") and "warning above 0 min" in line, line
    assert done.stdout.count(WARNING) == 3, done.stdout  # framed by two `!!! WARNING !!!` rules
    tests_seconds = float(line.split("summed over workers: ")[1].split(" s)")[0])
    assert tests_seconds >= 0.2 - 0.05, line  # four tests of 0.05 s, reported by the workers


def test_no_warning_under_the_threshold(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    done = run_suite(tmp_path, None, "-n", "2", "--dist", "loadgroup")
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = _said(done)
    assert line.startswith("suite wall time ") and "warning above 60 min" in line, line
    assert WARNING not in done.stdout


def test_without_xdist_a_failing_run_still_fails_and_a_bad_threshold_falls_back(tmp_path: Path) -> None:
    done = run_suite(tmp_path, "soon", "-p", "no:xdist", failing=True)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = _said(done)
    assert f"{THRESHOLD_VAR}='soon' is not a number of minutes: default used" in line, line
    assert "warning above 60 min" in line and WARNING not in done.stdout
