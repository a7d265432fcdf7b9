"""The check's own code on vLLM's real DeepseekV32Model at TP=2 (harness/child/verify_v32.py): stock
fails (the ranks hold different per-rank partial sums; the final id is missing), patched passes
every check, final id included. The same record and judgement (checks.py) and taps
(vllm_hotfix/check/taps.py) the command uses, the ranks' records gathered over vLLM's TP group
(gloo): each id is compared with the stream its decoder layer received, reduced over the ranks'
partial `hidden_states` (V3.2 fuses the all-reduce into the next norm at TP>1), and faults planted
in the patched states of a real forward (scaled, after a norm, off by one layer, zero, aliased to
the final state, the final state after the norm, a previous step's) each fail the per-id check. On
the newest release, under the GPU-only norm paths emulated on CPU (harness/child/gpu_norms.py:
vLLM's CUDA fused add-RMSNorm works in place), stock's id 0 aliases the residual that layer 0's
norms then overwrite: the check FAILs it, and passes it in the functional run and in the patched
forward (which captures id 0 as a copy)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness.testenv import FIXED, NEWEST

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("v32-states")]


@pytest.fixture(scope="module")
def ranks(testenv, tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("verify-v32")
    args = [testenv.script("verify_v32"), "--world", "2", "--variants", "1,2,3;1,2,3,4", "--out", str(out)]
    done = testenv.run(args, version=FIXED, hotfix=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _entry(rank: dict[str, Any], label: str, ids: list[int]) -> dict[str, Any]:
    (entry,) = [e for e in rank["results"] if e["label"] == label and e["ids"] == ids]
    return entry


def test_stock_ranks_disagree_and_the_check_fails(ranks) -> None:
    for rank in ranks:
        assert rank["vllm"] == FIXED and rank["patched"]
        stock = _entry(rank, "stock", [1, 2, 3])
        assert not stock["ok"] and not stock["ranks_agree"]
        assert stock["ranks_rel_diff"] > 0.1, stock  # per-rank partial sums: measured 0.64 here
        assert stock["count_ok"] and stock["failed_ranks"] == []  # only the ranks' records side by side
        with_final = _entry(rank, "stock", [1, 2, 3, 4])
        assert with_final["count_detail"] == "3 state(s) for 4 id(s)" and with_final["failed_ranks"] == [0, 1]


def test_patched_passes_every_check_with_the_final_id(ranks) -> None:
    for rank in ranks:
        for ids in ([1, 2, 3], [1, 2, 3, 4]):
            patched = _entry(rank, "patched", ids)
            assert patched["ok"] and patched["ranks_rel_diff"] == 0.0, patched
            assert patched["count_ok"] and patched["finite_ok"]
        final = _entry(rank, "patched", [1, 2, 3, 4])["per_id"][-1]
        assert final["id"] == 4 and final["status"] == "ok", final


def _statuses(entry: dict[str, Any]) -> dict[int, str]:
    return {e["id"]: e["status"] for e in entry["per_id"]}


def test_stock_partial_sums_fail_per_id_against_the_reduced_stream(ranks) -> None:
    for rank in ranks:
        stock = _entry(rank, "stock", [1, 2, 3])
        assert _statuses(stock) == {1: "wrong", 2: "wrong", 3: "wrong"}, stock["per_id"]
        for entry in stock["per_id"]:
            assert "(reduced: the sum of 2 ranks' partial hidden_states" in entry["reference"], entry
            assert entry["max_rel_diff"] > 0.1, entry


def test_patched_every_id_equals_what_its_layer_received(ranks) -> None:
    for rank in ranks:
        for ids in ([1, 2, 3], [1, 2, 3, 4]):
            patched = _entry(rank, "patched", ids)
            assert set(_statuses(patched).values()) == {"ok"}, patched["per_id"]
            for entry in patched["per_id"]:
                assert entry["max_rel_diff"] <= entry["tolerance"] == 1e-4, entry
        final = _entry(rank, "patched", [1, 2, 3, 4])["per_id"][-1]
        assert final["reference"].startswith("the final norm's input (the stream layer 3 returns) (reduced")


PLANTED = {  # on the patched states of ids 1,2,3,4: the ids each fault must fail
    "scaled": {1, 2, 3, 4},
    "after-norm": {1, 2, 3},
    "off-by-one": {1, 2, 3},
    "zero": {1, 2, 3},
    "alias-final": {1},
    "final-after-norm": {4},
    "stale": {1, 2, 3, 4},
}


@pytest.mark.parametrize("fault", sorted(PLANTED))
def test_a_planted_fault_fails_its_ids_and_only_those(ranks, fault) -> None:
    """Each of these passed the ranks-agree check (every rank holds the same wrong value)."""
    for rank in ranks:
        entry = _entry(rank, f"planted-{fault}", [1, 2, 3, 4])
        failed = {i for i, status in _statuses(entry).items() if status == "wrong"}
        assert failed == PLANTED[fault], entry["per_id"]
        assert set(_statuses(entry).values()) <= {"ok", "wrong"}, entry["per_id"]
        assert entry["ranks_agree"] and not entry["ok"], entry


@pytest.fixture(scope="module")
def gpu_norm_ranks(testenv, tmp_path_factory) -> list[dict[str, Any]]:
    """TP=2 on the newest release, ids 0..4, each forward also under the GPU norm emulation (the
    fused all-reduce + norm up to 6 tokens: the 12-token prompt takes vLLM's fallback, all-reduce
    then the in-place norm, as GPUs do above their workspace budget)."""
    out = tmp_path_factory.mktemp("verify-v32-gpu-norms")
    args = [testenv.script("verify_v32"), "--world", "2", "--variants", "0,1,2,3,4", "--gpu-norms", "6"]
    done = testenv.run([*args, "--out", str(out)], version=NEWEST, hotfix=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_id0_alias_under_in_place_norms_fails_and_the_patched_copy_passes(gpu_norm_ranks) -> None:
    ids = [0, 1, 2, 3, 4]
    for rank in gpu_norm_ranks:
        assert rank["vllm"] == NEWEST and rank["patched"]
        assert _statuses(_entry(rank, "stock", ids))[0] == "ok"  # functional norms: no alias
        aliased = _entry(rank, "stock-gpu-norms", ids)["per_id"][0]
        assert aliased["status"] == "wrong" and aliased["max_rel_diff"] > 0.1, aliased
        assert aliased["reference"] == "the embeddings entering layer 0"
        for label in ("patched", "patched-gpu-norms"):
            patched = _entry(rank, label, ids)
            assert set(_statuses(patched).values()) == {"ok"}, (label, patched["per_id"])
