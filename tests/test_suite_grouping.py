"""The suite's own scheduling: tests that share expensive runs carry one `xdist_group` and must run on
one pytest-xdist worker (`--dist loadgroup`, scripts/test.sh), or each worker remakes the runs.
pytest 9.2 with pytest-xdist 3.8 silently lost the grouping (scripts/build-test-env.sh pins pytest);
this fails when that happens again, in the environment the suite runs in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

GROUPED = """
import os
import pytest

pytestmark = [pytest.mark.xdist_group("shared")]


@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    with open(os.environ["WORKER_LOG"], "a") as log:
        log.write(os.environ.get("PYTEST_XDIST_WORKER", "none") + "\\n")
"""


def test_an_xdist_group_runs_on_one_worker(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    log = tmp_path / "workers.log"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"],
        cwd=tmp_path,
        env={"WORKER_LOG": str(log), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    workers = log.read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, f"one group ran on workers {sorted(set(workers))}"
