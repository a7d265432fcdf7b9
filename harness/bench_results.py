"""Benchmark results as files: what each benchmark records.

Each benchmark prints its figures and writes the same figures, as rows of the benchmark table plus
the raw numbers, to benchmarks/results/NAME.json (with the date, the machine, the versions and the
load average it ran under). harness/tables.py makes the table from those files alone.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from harness.child.cpu_kernels import cpu_model, simd

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"

# The table's order, and the command that measures each benchmark (scripts/bench.sh NAME).
BENCHMARKS = (
    "startup",
    "patch_cost",
    "forward_time",
    "engine_throughput",
    "v32_tp_cost",
    "verify_cost",
    "audit_cost",
    "audit_scale",
    "audit_max_tokens",
)

# What one `vllm-hotfix audit` run executes of the package, engine side and command side.
AUDIT_RUN = (
    "vllm_hotfix/commands/session.py",
    "vllm_hotfix/commands/audit.py",
    "vllm_hotfix/audit/compare.py",
    "vllm_hotfix/audit/files.py",
    "vllm_hotfix/audit/results.py",
    "vllm_hotfix/audit/selection.py",
    "vllm_hotfix/audit/verdict.py",
    "vllm_hotfix/audit/worker.py",
    "vllm_hotfix/commands/verify.py",
    "vllm_hotfix/check/hook.py",
    "vllm_hotfix/check/outcome.py",
    "vllm_hotfix/check/records.py",
    "vllm_hotfix/judging/precision.py",
)
# The files whose code a benchmark measures (repository paths): each result records their digests;
# a result whose files changed since is stale (marked in the table, a warning in the tests).
SOURCES: dict[str, tuple[str, ...]] = {
    "startup": (
        "vllm_hotfix/__init__.py",
        "vllm_hotfix/runtime/site_hook.py",
        "benchmarks/startup.py",
    ),
    "v32_tp_cost": (
        "vllm_hotfix/fixes/aux_capture.py",
        "vllm_hotfix/fixes/deepseek_v32_final_aux.py",
        "vllm_hotfix/runtime/codegen.py",
        "harness/child/v32_states.py",
        "harness/child/tp_model.py",
        "benchmarks/v32_tp_cost.py",
    ),
    "verify_cost": (
        "vllm_hotfix/commands/session.py",
        "vllm_hotfix/check/checks.py",
        "vllm_hotfix/commands/verify.py",
        "vllm_hotfix/check/hook.py",
        "vllm_hotfix/check/outcome.py",
        "vllm_hotfix/check/records.py",
        "vllm_hotfix/check/reference.py",
        "vllm_hotfix/check/taps.py",
        "vllm_hotfix/judging/precision.py",
        "benchmarks/verify_cost.py",
    ),
    "audit_cost": (
        *AUDIT_RUN,
        "benchmarks/audit_cost.py",
    ),
    "audit_scale": (
        *AUDIT_RUN,
        "benchmarks/audit_scale.py",
    ),
    "audit_max_tokens": (
        *AUDIT_RUN,
        "benchmarks/audit_max_tokens.py",
    ),
}


def digests(paths: Sequence[str], repo: Path = REPO) -> dict[str, str]:
    """Each file's sha256 (first 16 hex digits): what a result's figures were measured on."""
    return {path: hashlib.sha256((repo / path).read_bytes()).hexdigest()[:16] for path in paths}


def stale_sources(result: dict[str, object], name: str | None = None, repo: Path = REPO) -> list[str]:
    """The measured files that changed since the result was written: a file whose digest differs,
    and, for benchmark `name`, a file it measures now that the result did not record (or one it no
    longer measures). Such a result is stale: marked in the table, warned about by the tests, re-run
    before a release (docs/releasing.md), never a failing test."""
    recorded = result.get("sources") or {}
    assert isinstance(recorded, dict)
    wanted = set(SOURCES.get(name, ())) if name is not None else set(recorded)
    present = [path for path in recorded if (repo / path).exists()]
    now = digests(present, repo)
    changed = {path for path, digest in recorded.items() if now.get(path) != digest}
    return sorted(changed | (wanted ^ set(recorded)))


def commit(repo: Path = REPO) -> str | None:
    """The checkout's commit, for people reading a result; None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip() or None


@dataclass(frozen=True)
class Row:
    """One row of the README's table: what was measured, and the figure as printed."""

    what: str
    figure: str


def median_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """Distribution-free 95% confidence interval of the median (order statistics, normal
    approximation of the binomial): says whether a median ratio can tell a 1% difference."""
    ordered = sorted(values)
    n = len(ordered)
    half = z * math.sqrt(n) / 2
    low, high = max(math.floor(n / 2 - half), 1), min(math.ceil(n / 2 + half + 1), n)
    return ordered[low - 1], ordered[high - 1]


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and the median's 95% interval of repeated measurements (one measurement,
    as a smoke run of one round gives: its value for all of them)."""
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    low, high = median_ci(values)
    median = statistics.median(values)
    return {"n": len(values), "median": median, "q1": q1, "q3": q3, "ci_low": low, "ci_high": high}


def ratio_text(stats: dict[str, float]) -> str:
    """`0.998 (95% CI 0.991-1.004; IQR 0.95-1.05, 300 rounds)`: the median ratio as the table shows it."""
    return (
        f"{stats['median']:.3f} (95% CI {stats['ci_low']:.3f}-{stats['ci_high']:.3f};"
        f" IQR {stats['q1']:.3f}-{stats['q3']:.3f}, {stats['n']} rounds)"
    )


def machine() -> str:
    """The machine in a few words: processor, cores, its SIMD flags, memory."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            kib = int(next(line.split()[1] for line in handle if line.startswith("MemTotal")))
        memory = f", {kib / 2**20:.0f} GiB"
    except (OSError, ValueError, StopIteration):
        memory = ""
    return f"{os.cpu_count()} cores of {cpu_model()} ({simd()}){memory}"


class Recorder:
    """Started before a benchmark measures, written after: the load average before and after is
    part of the result, since on a 2-core machine another job's load moves every figure."""

    def __init__(self, name: str, command: str) -> None:
        if name not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {name!r}: add it to BENCHMARKS")
        self.name, self.command = name, command
        self.load_before = os.getloadavg()[0]

    def write(
        self,
        rows: Sequence[Row],
        figures: dict[str, object],
        versions: dict[str, str],
        results_dir: Path = RESULTS_DIR,
        repo: Path = REPO,
    ) -> Path:
        """Print the rows and write them with the raw figures to RESULTS_DIR/NAME.json."""
        for row in rows:
            print(f"README row: {row.what} | {row.figure}")
        result = {
            "benchmark": self.name,
            "command": self.command,
            "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "machine": machine(),
            "python": sys.version.split()[0],
            "versions": versions,
            "load_average": [round(self.load_before, 2), round(os.getloadavg()[0], 2)],
            "rows": [asdict(row) for row in rows],
            "figures": figures,
            "commit": commit(),
            "sources": digests(SOURCES.get(self.name, ()), repo),
        }
        results_dir.mkdir(parents=True, exist_ok=True)
        path = results_dir / f"{self.name}.json"
        path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"results written to {path}; README table: python scripts/update_bench_table.py")
        return path


@dataclass
class TinyEngine:
    """What a benchmark of a command on the real engine starts from: the test environment, a work
    directory, the hotfix installed as vLLM's plugin, the tiny checkpoint, and the environment of
    each run (its own compile cache, a small KV cache). `positions`: the checkpoint's
    max_position_embeddings (the longest prompt it takes, less one)."""

    testenv: Any
    work: Path
    plugin: str
    checkpoint: str
    env: dict[str, str]

    @classmethod
    def build(cls, prefix: str, positions: int = 512) -> TinyEngine:
        from harness.child.tiny_checkpoint import build
        from harness.testenv import TestEnv
        from harness.ways_in import install_plugin

        testenv = TestEnv.locate()
        work = Path(tempfile.mkdtemp(prefix=prefix))
        plugin = install_plugin(testenv, work / "plugin")
        build(str(work / "tiny"), positions=positions)
        env = {"VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_CPU_KVCACHE_SPACE": "1"}
        return cls(testenv, work, plugin, str(work / "tiny"), env)

    def parts(self) -> tuple[Any, Path, str, str, dict[str, str]]:
        """(test environment, work directory, plugin, checkpoint, environment of each run)."""
        return self.testenv, self.work, self.plugin, self.checkpoint, self.env

    def vllm_version(self) -> str:
        """The version of the test environment's vLLM the runs used."""
        from harness.testenv import BUG

        python = self.testenv.python_for(BUG)
        done = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
        )
        return done.stdout.strip()


# what the commands (and the benchmarks' baselines) log once the engine is up
STARTED = re.compile(r"vLLM started in (\d+) s")


def started(log: str) -> float:
    """Seconds from a process's start to its engine's, as its log says."""
    found = STARTED.search(log)
    assert found, "no start-up time in the log"
    return float(found.group(1))


def tree_rss(root: int) -> int:
    """Bytes resident in `root`'s descendants (not `root` itself), summed, from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            parents[int(stat.parent.name)] = int(text[text.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError):
            continue
    tree, grew = {root}, True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= found
        grew = bool(found)
    total = 0
    for pid in tree - {root}:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def directory_bytes(root: Path) -> int:
    """The summed sizes of the files under `root` (0 where it does not exist yet); files that
    vanish while it walks (a writer's temporary file renamed) are skipped."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


Sampler = TypeVar("Sampler", bound="PeakSampler")


class PeakSampler:
    """The largest value of `measure()` while the block runs, sampled every `every` seconds (and
    once at the end, so a block shorter than one period is measured too)."""

    def __init__(self, every: float = 0.2) -> None:
        self.peak = 0
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def measure(self) -> int:
        raise NotImplementedError

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, self.measure())

    def __enter__(self: Sampler) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.measure())


class PeakRss(PeakSampler):
    """The largest summed resident set of this process's descendants while the block runs."""

    def measure(self) -> int:
        return tree_rss(os.getpid())


class PeakDisk(PeakSampler):
    """The largest summed size of the files under `root` while the block runs (`end`: at its end)."""

    def __init__(self, root: Path, every: float = 0.2) -> None:
        super().__init__(every)
        self.root, self.end = root, 0

    def measure(self) -> int:
        return directory_bytes(self.root)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.end = directory_bytes(self.root)


def rounds(argv: list[str] | None, description: str | None) -> int:
    """The paired benchmarks' one option: alternating pairs after the warm-up."""
    import argparse

    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating pairs after the warm-up (default 2)"
    )
    return int(parser.parse_args(argv).rounds)
