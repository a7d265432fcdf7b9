"""docs/verification.md's benchmark table is made from the files the benchmarks write, and from nothing else
(its release-matrix and model-zoo tables likewise, from their row files).

A benchmark prints its figures and writes them to benchmarks/results/NAME.json
(harness/bench_results.py); `python scripts/update_bench_table.py` writes the table from those files
(harness/tables.py).
These tests fail when a figure in that file was edited by hand or a result file is incomplete. A
result whose measured code changed since it ran is stale: marked in the table and reported here as
a warning, never a failure (benchmarks are re-run before a release, docs/releasing.md).
"""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path

import pytest

from harness import bench_results, matrix
from harness.bench_results import BENCHMARKS, RESULTS_DIR, Recorder, Row, median_ci
from harness.tables import (
    BENCHMARK_MARKERS,
    MATRIX_MARKERS,
    ZOO_MARKERS,
    benchmark_table,
    matrix_table,
    table_in,
    with_table,
    without_stale_marks,
    zoo_table,
)

VERIFICATION = Path(__file__).resolve().parent.parent / "docs" / "verification.md"


def test_documented_table_is_the_one_the_result_files_give() -> None:
    documented, made = table_in(VERIFICATION.read_text(encoding="utf-8")), benchmark_table()
    assert without_stale_marks(documented) == without_stale_marks(made), (
        "docs/verification.md's benchmark table differs from benchmarks/results/:"
        " run `python scripts/update_bench_table.py`"
    )
    if documented != made:
        warnings.warn(
            "docs/verification.md's benchmark table marks other results stale than the code gives:"
            " run `python scripts/update_bench_table.py`",
            stacklevel=1,
        )


def test_documented_matrix_is_the_one_the_row_files_give() -> None:
    text = VERIFICATION.read_text(encoding="utf-8")
    assert table_in(text, MATRIX_MARKERS) == matrix_table(), (
        "docs/verification.md's release matrix differs from benchmarks/results/matrix/:"
        " run `python scripts/update_bench_table.py`"
    )


def test_documented_zoo_table_is_the_one_the_row_files_give() -> None:
    text = VERIFICATION.read_text(encoding="utf-8")
    assert table_in(text, ZOO_MARKERS) == zoo_table(), (
        "docs/verification.md's model-zoo table differs from benchmarks/results/zoo/:"
        " run `python scripts/update_bench_table.py`"
    )


def test_a_saved_matrix_row_is_what_the_matrix_table_shows(tmp_path: Path) -> None:
    assert "Not run yet: 0.18.0 eager, 0.18.0 compile" in matrix_table(tmp_path)
    row = matrix.Row("0.18.0", "eager", "[1,2,4]: 2 of 3 states", "patched", "final = h+r", 12.0, True)
    matrix.save(row, tmp_path, (0.5, 0.75))
    table = matrix_table(tmp_path)
    assert "| 0.18.0 | eager | [1,2,4]: 2 of 3 states | patched | PASS: final = h+r | 12 |" in table
    assert "0.18.0 eager," not in table.split("Not run yet:")[1]
    compiled = matrix.Row("0.18.0", "compile (DYNAMO_TRACE_ONCE, inductor)", "-", "patched", "ok", 1.0, True)
    assert matrix.save(compiled, tmp_path).name == "0.18.0--compile.json"
    assert "0.18.0 compile," not in matrix_table(tmp_path).split("Not run yet:")[1]


@pytest.mark.parametrize("path", sorted(RESULTS_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_each_result_file_says_what_where_and_when(path: Path) -> None:
    result = json.loads(path.read_text(encoding="utf-8"))
    assert result["benchmark"] == path.stem and path.stem in BENCHMARKS
    assert result["command"].startswith(f"bash scripts/bench.sh {path.stem}")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", result["measured"])
    assert result["machine"] and result["versions"] and len(result["load_average"]) == 2
    assert result["rows"] and all(row["what"] and row["figure"] for row in result["rows"])
    assert result["figures"], "the raw figures behind the rows are missing"


@pytest.mark.parametrize("name", sorted(bench_results.SOURCES))
def test_a_result_measured_on_older_code_is_reported_stale(name: str) -> None:
    path = RESULTS_DIR / f"{name}.json"
    result = json.loads(path.read_text(encoding="utf-8"))
    changed = bench_results.stale_sources(result, name)
    if changed:  # a warning, never a failure: re-run before a release (docs/releasing.md)
        message = f"{path.name} is stale ({', '.join(changed)} changed): {result['command']}"
        warnings.warn(message, stacklevel=1)


def test_a_changed_source_makes_its_result_stale_and_the_table_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(bench_results.SOURCES, "startup", ("measured.py",))
    (tmp_path / "measured.py").write_text("x = 1\n", encoding="utf-8")
    results = tmp_path / "results"
    Recorder("startup", "bash scripts/bench.sh startup").write(
        [Row("what it measured", "1 ms")], {"runs": 1}, {}, results_dir=results, repo=tmp_path
    )
    result = json.loads((results / "startup.json").read_text())
    assert bench_results.stale_sources(result, "startup", tmp_path) == []
    fresh = benchmark_table(results, repo=tmp_path)
    assert "| what it measured | 1 ms | 20" in fresh

    (tmp_path / "measured.py").write_text("x = 2\n", encoding="utf-8")
    assert bench_results.stale_sources(result, "startup", tmp_path) == ["measured.py"]
    stale = benchmark_table(results, repo=tmp_path)
    assert "| what it measured | 1 ms | **stale** (measured.py changed since); 20" in stale
    assert without_stale_marks(stale) == fresh
    # a file the benchmark measures now that the result never recorded makes it stale too
    monkeypatch.setitem(bench_results.SOURCES, "startup", ("measured.py", "added.py"))
    assert bench_results.stale_sources(result, "startup", tmp_path) == ["added.py", "measured.py"]


def test_a_recorded_result_is_what_the_table_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "| startup | not measured yet |" in benchmark_table(tmp_path)
    recorder = Recorder("startup", "bash scripts/bench.sh startup --runs 3")
    recorder.write(
        [Row("what it measured", "1.23 ms")], {"runs": 3}, {"Python": "3.11"}, results_dir=tmp_path
    )
    assert "README row: what it measured | 1.23 ms" in capsys.readouterr().out
    table = benchmark_table(tmp_path)
    assert "| what it measured | 1.23 ms |" in table and "Python 3.11" in table
    assert "| startup | not measured yet |" not in table
    with pytest.raises(ValueError, match="unknown benchmark"):
        Recorder("nonesuch", "bash scripts/bench.sh nonesuch")


def test_median_interval_is_the_order_statistics_interval() -> None:
    # For 100 observations the distribution-free 95% interval of the median is the 40th to 61st value.
    assert median_ci([float(v) for v in range(1, 101)]) == (40.0, 61.0)
    stats = bench_results.summary([1.0, 2.0, 3.0, 4.0, 5.0])
    assert stats["median"] == 3.0 and stats["ci_low"] <= 3.0 <= stats["ci_high"]


def test_table_replacement_keeps_the_rest_of_the_file() -> None:
    start, end = BENCHMARK_MARKERS
    readme = f"before\n{start}\nold\n{end}\nafter\n"
    updated = with_table(readme, "new\n")
    assert updated == f"before\n{start}\nnew\n{end}\nafter\n"
    assert table_in(updated) == "new\n"


def test_one_round_gives_a_summary_of_its_one_value() -> None:
    # a smoke run (--rounds 1) prints and records its one ratio rather than failing on the quartiles
    stats = bench_results.summary([0.5])
    assert (stats["n"], stats["median"], stats["q1"], stats["q3"]) == (1, 0.5, 0.5, 0.5)
    assert (stats["ci_low"], stats["ci_high"]) == (0.5, 0.5)


def test_peak_disk_keeps_the_largest_size_seen_and_the_size_at_the_end(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    with bench_results.PeakDisk(reports, every=0.01) as disk:
        (reports / "records").mkdir(parents=True)
        (reports / "records" / "forward-0.bin").write_bytes(b"x" * 5000)
        (reports / "verdict.json").write_bytes(b"y" * 100)
        time.sleep(0.2)  # sampled while both files are there
        (reports / "records" / "forward-0.bin").unlink()
    assert (disk.peak, disk.end) == (5100, 100)
    assert bench_results.directory_bytes(tmp_path / "nonesuch") == 0
