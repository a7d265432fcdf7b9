"""The in-worker check's own code on vLLM's real DeepseekV32Model at TP=2 (harness/child/verify_v32.py):
stock fails (the ranks hold different per-rank partial sums; the final id is missing), patched
passes every check, final id included. The same `check_step` and final-norm probe the engine's
workers use, over vLLM's own TP group (gloo)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness.testenv import FIXED

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
        assert stock["ranks_rel_diff"] > 0.1, stock  # per-rank partial sums: measured 1.25 here
        assert stock["count_ok"] and stock["failed_ranks"] == []  # only the exchange can see it
        with_final = _entry(rank, "stock", [1, 2, 3, 4])
        assert with_final["count_detail"] == "3 state(s) for 4 id(s)" and with_final["failed_ranks"] == [0, 1]


def test_patched_passes_every_check_with_the_final_id(ranks) -> None:
    for rank in ranks:
        assert rank["final_note"].startswith("the output of DeepseekV32Model.norm equals")
        for ids in ([1, 2, 3], [1, 2, 3, 4]):
            patched = _entry(rank, "patched", ids)
            assert patched["ok"] and patched["ranks_rel_diff"] == 0.0, patched
            assert patched["count_ok"] and patched["finite_ok"]
        final = _entry(rank, "patched", [1, 2, 3, 4])
        assert final["final_ok"] is True and final["final_rel_diff"] <= final["tolerance"]
