"""Engine throughput, generate with extract_hidden_states (ids [1,2,4], default multiprocessing):
vLLM 0.24.0 with the hotfix (as a plugin) vs vLLM 0.25.0. Tokens per second of repeated
generate calls in one engine each (the first call, with warm-up effects, is reported apart).
Run: bash scripts/bench.sh engine_throughput [--max-tokens 64 --times 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.testenv import BUG, FIXED, TestEnv
from harness.tiny_checkpoint import build as build_checkpoint
from harness.ways_in import Ways


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--times", type=int, default=5)
    args = parser.parse_args()
    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-bench-"))
    build_checkpoint(str(work / "tiny"))
    ways = Ways(testenv, work / "tiny", work)
    rates = {}
    for label, way, version in (("0.24.0 + hotfix (plugin)", "plugin", BUG), ("0.25.0", "stock", FIXED)):
        run = ways.run(
            way,
            "1,2,4",
            version=version,
            extra_args=["--max-tokens", str(args.max_tokens), "--generate-times", str(args.times)],
        )
        if not run["result"]["ok"]:
            sys.exit(run["result"]["error"])
        tokens = sum(len(t) for t in run["result"]["tokens"])
        seconds = run["result"]["generate_s"]
        per_call = [tokens / s for s in seconds[1:]] or [tokens / seconds[0]]
        rates[label] = statistics.median(per_call)
        print(
            f"{label:26s} {rates[label]:8.1f} tokens/s (median of {len(per_call)} calls,"
            f" range {min(per_call):.1f}-{max(per_call):.1f}; first call {tokens / seconds[0]:.1f})"
        )
    a, b = rates.values()
    print(f"ratio hotfix/0.25.0: {a / b:.3f}")


if __name__ == "__main__":
    main()
