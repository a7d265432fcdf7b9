"""The check's one exchange per step (vllm_hotfix/verify/exchange.py, through checks.check_step) at
TP=2 over vLLM's own TP group (gloo), with a fault planted on rank 1 (harness/child/verify_exchange.py):
an exception at each stage of a step, a stall past the deadline, other ids, a rank not armed. Every
rank ends with a clear verdict naming rank 1, no rank waits past the deadline, and vLLM's own
collectives on the group still complete afterwards. The contrast shows what the design avoids: a
gloo collective that a peer never joins leaves the group unusable."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness.testenv import BUG

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("verify-exchange")]

STAGES = ["shapes", "projection", "float32", "payload", "record", "step"]


@pytest.fixture(scope="module")
def ranks(testenv, tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("verify-exchange")
    done = testenv.run(
        [testenv.script("verify_exchange"), "--out", str(out)], version=BUG, hotfix=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_clean_step_passes_and_the_group_stays_usable(ranks) -> None:
    for rank in ranks:
        clean = rank["clean"]
        assert clean["ok"] and clean["complete"] and clean["final_ok"] is True, clean
        assert clean["ranks_rel_diff"] == 0.0 and clean["errors"] == [] and clean["usable"]


def test_each_step_sends_only_its_own_tokens(ranks) -> None:
    """The all-gather of a step carries that step's tokens, not the window's capacity: a 245-float
    header, 3 flags, then per id (3 here) 9 floats per token and a block of 2 + 16 per token. 1, 5
    and 1 tokens: 329, 629 and 329 floats (the capacity of 7 tokens would be 779 at every step)."""
    for rank in ranks:
        sized = rank["sized-by-step"]
        assert sized["sent"] == [329, 629, 329], sized
        assert sized["every_ok"] == [True, True, True] and sized["usable"], sized


@pytest.mark.parametrize("stage", STAGES)
def test_an_exception_on_one_rank_at_each_stage_is_an_error_on_every_rank(ranks, stage: str) -> None:
    for rank in ranks:
        check = rank[f"raise-{stage}"]
        assert check["errors"] and check["errors"][0]["rank"] == 1, check
        assert [e["stage"] for e in check["errors"]] == [stage], check
        assert "planted" in check["errors"][0]["message"], check
        assert not check["ok"] and not check["complete"] and not check["failed"], check  # UNKNOWN, not FAIL
        assert check["usable"], f"vLLM's TP group is unusable after a {stage} error"
        if stage == "step":  # the _Step is built once, at the first step: through the handshake
            assert check["exchange_note"] == "not run: rank(s) [1] could not start the check"
        else:  # after a good first step: through the all-gather's error flag
            assert check["first_ok"] and check["exchange_note"] is None, check


def test_an_exception_at_the_first_step_goes_through_the_handshake(ranks) -> None:
    for rank in ranks:
        check = rank["raise-first-projection"]
        assert check["errors"] == [
            {"rank": 1, "stage": "projection", "message": "RuntimeError: planted at projection"}
        ]
        assert check["exchange_note"] == "not run: rank(s) [1] could not start the check" and check["usable"]


def test_a_final_norm_that_raises_on_one_rank_makes_the_final_id_na_there(ranks) -> None:
    rank0, rank1 = (rank["raise-final-norm"] for rank in ranks)
    assert rank0["ok"] and rank0["final_ok"] is True and rank1["ok"] and rank1["final_ok"] is None
    assert rank1["final_error"] == "the final norm could not be applied: RuntimeError: planted at final-norm"
    assert rank0["usable"] and rank1["usable"]


@pytest.mark.parametrize("where", ["handshake", "step"])
def test_a_stalled_rank_hits_the_deadline_and_both_ranks_stop(ranks, where: str) -> None:
    rank0, rank1 = (rank[f"stall-{where}"] for rank in ranks)
    if where == "handshake":
        assert "rank(s) [1] did not join the check's handshake within 2 s" in rank0["exchange_note"], rank0
        assert "rank 1 joined the check's handshake" in rank1["exchange_note"], rank1
    else:
        assert all(rank["stall-step"]["first_ok"] for rank in ranks)
        assert "did not complete within 2 s" in rank0["exchange_note"], rank0
        assert "rank 1 joined the exchange" in rank1["exchange_note"], rank1  # the late rank stops too
    for check in (rank0, rank1):
        assert not check["complete"] and not check["failed"] and check["usable"], check


def test_ranks_armed_with_other_ids_are_told_apart_without_a_stall(ranks) -> None:
    for rank in ranks:
        check = rank["other-ids"]
        assert check["exchange_note"].startswith("ranks armed differently"), check
        assert '"ids": [1, 4]' in check["exchange_note"] and '"ids": [1, 2, 4]' in check["exchange_note"]
        assert not check["failed"] and check["usable"]


def test_a_rank_not_armed_costs_one_deadline_and_leaves_the_group_usable(ranks) -> None:
    rank0, rank1 = (rank["not-armed"] for rank in ranks)
    assert "rank(s) [1] did not join the check's handshake" in rank0["exchange_note"], rank0
    assert rank0["usable"] and rank1["usable"]


def test_contrast_a_collective_a_peer_never_joins_leaves_the_group_unusable(ranks) -> None:
    """Why the handshake goes through the store: measured here, not assumed."""
    assert [rank["contrast-collective-never-joined"]["usable"] for rank in ranks] == [False, False]
