"""What the DeepseekV32Model fix costs under tensor parallelism, on CPU: the forward of vLLM's real
DeepseekV32Model (harness/v32_states.py: 4 dense layers, hidden 64, 12 tokens, float32, DSA
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

from harness.testenv import NEWEST, TestEnv

VARIANTS = ";1,2,3;1,2,3,4"


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--version", default=NEWEST)
    parser.add_argument("--vendor", default="nvidia")
    args = parser.parse_args()
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
    for ids, times in saved["timings"].items():
        stock, patched = times["stock"], times["patched"]
        ratios = [p / s for p, s in zip(patched, stock, strict=True)]
        q1, ratio, q3 = _quartiles(ratios)
        added = counts[ids]["patched"]["all_reduces"] - counts[ids]["stock"]["all_reduces"]
        print(
            f"  ids {list(ids)!s:14s} stock {statistics.median(stock) * 1e3:6.2f} ms"
            f"  patched {statistics.median(patched) * 1e3:6.2f} ms"
            f"  ratio {ratio:.3f} (IQR {q1:.3f}-{q3:.3f})  all-reduces added: {added}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
