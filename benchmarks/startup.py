"""Start-up cost of the hotfix in processes that never import vLLM.

1. `import vllm_hotfix` over a bare interpreter (and which modules it loads).
2. Interpreter start-up with the site hook installed vs without it (same venv contents otherwise).
3. The same with every fix disabled (VLLMHOTFIX_DISABLE=1): the `.pth` line alone, which imports
   nothing then; the rest of 2 is the import.
Medians of interleaved runs in one invocation, with the interquartile spread, and the median of the
paired ratios with its 95% interval; written to benchmarks/results/startup.json (harness/bench_results.py).
Every command runs once before the timed rounds, with bytecode writing allowed, so that the package is
measured compiled, as pip installs it (PYTHONDONTWRITEBYTECODE in the caller's environment would
otherwise make every run of 1 compile the package from source).
Run: bash scripts/bench.sh startup [--runs 200]
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.bench_results import Recorder, Row, ratio_text, summary
from harness.site_venvs import make_venv
from harness.testenv import REPO


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1000


def compare(
    name: str, base: list[str], other: list[str], runs: int, env: dict[str, str] | None = None
) -> dict[str, object]:
    """Interleaved runs of both commands; prints and returns medians, spreads and the paired ratios."""
    for warm_up in (base, other):  # writes bytecode where it is missing, fills the caches
        timed(warm_up, env)
    a, b = [], []
    for _ in range(runs):  # interleaved, so drift hits both equally
        a.append(timed(base, env))
        b.append(timed(other, env))
    qa, qb = statistics.quantiles(a, n=4), statistics.quantiles(b, n=4)
    ma, mb = statistics.median(a), statistics.median(b)
    ratio = summary([y / x for x, y in zip(a, b, strict=True)])
    print(f"{name}")
    print(f"  baseline median {ma:7.2f} ms (IQR {qa[0]:.2f}-{qa[2]:.2f})")
    print(f"  with     median {mb:7.2f} ms (IQR {qb[0]:.2f}-{qb[2]:.2f})")
    print(f"  difference {mb - ma:+.2f} ms, paired ratio {ratio_text(ratio)}  ({runs} runs each)")
    return {"baseline_ms": summary(a), "with_ms": summary(b), "ratio": ratio}


def figure(measured: dict) -> str:
    base, with_ = measured["baseline_ms"]["median"], measured["with_ms"]["median"]
    return (
        f"{with_ - base:+.2f} ms ({base:.2f} → {with_:.2f} ms medians); ratio {ratio_text(measured['ratio'])}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    recorder = Recorder("startup", f"bash scripts/bench.sh startup --runs {args.runs}")
    python = sys.executable
    # The caller's switches and bytecode setting left out: each case sets what it measures.
    left_out = ("PYTHONDONTWRITEBYTECODE", "VLLMHOTFIX_")
    bare = {k: v for k, v in os.environ.items() if not k.startswith(left_out)}
    env = dict(bare, PYTHONPATH=str(REPO))
    loaded = subprocess.run(
        [
            python,
            "-c",
            "import sys; b = set(sys.modules); import vllm_hotfix; print(sorted(set(sys.modules) - b))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(f"Python {sys.version.split()[0]} at {python}")
    print(f"modules `import vllm_hotfix` adds: {loaded}")
    importing = compare(
        "import vllm_hotfix (bare interpreter, -c pass vs -c 'import vllm_hotfix')",
        [python, "-c", "pass"],
        [python, "-c", "import vllm_hotfix"],
        args.runs,
        env,
    )
    with tempfile.TemporaryDirectory() as tmp:
        plain = make_venv(Path(tmp) / "plain", python, hook=False)
        hooked = make_venv(Path(tmp) / "hooked", python, hook=True)
        hook = compare(
            "interpreter start-up, site hook installed vs not (python -c pass)",
            [plain, "-c", "pass"],
            [hooked, "-c", "pass"],
            args.runs,
            bare,
        )
        line_only = compare(
            "interpreter start-up, site hook installed vs not, every fix disabled (VLLMHOTFIX_DISABLE=1)",
            [plain, "-c", "pass"],
            [hooked, "-c", "pass"],
            args.runs,
            dict(bare, VLLMHOTFIX_DISABLE="1"),
        )
    modules = ", ".join(f"`{m}`" for m in ast.literal_eval(loaded))
    rows = [
        Row(
            "`import vllm_hotfix` in a bare interpreter, against `python -c pass`",
            f"{figure(importing)}; loads only {modules} (no vllm, torch, wrapt)",
        ),
        Row("start-up of a Python process that never imports vLLM, site hook installed vs not", figure(hook)),
        Row(
            "the same, every fix disabled (`VLLMHOTFIX_DISABLE=1`): the `.pth` line alone, no import",
            figure(line_only),
        ),
    ]
    figures = {
        "runs": args.runs,
        "modules_added": loaded,
        "import": importing,
        "site_hook": hook,
        "site_hook_disabled": line_only,
    }
    recorder.write(rows, figures, {"Python": sys.version.split()[0]})


if __name__ == "__main__":
    main()
