"""Start-up cost of the hotfix in processes that never import vLLM.

1. `import vllm_hotfix` over a bare interpreter (and which modules it loads).
2. Interpreter start-up with the site hook installed vs without it (same venv contents otherwise).
Medians of interleaved runs in one invocation, with the interquartile spread.
Run: bash scripts/bench.sh startup [--runs 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.site_venvs import make_venv
from harness.testenv import REPO


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1000


def compare(
    name: str, base: list[str], other: list[str], runs: int, env: dict[str, str] | None = None
) -> None:
    a, b = [], []
    for _ in range(runs):  # interleaved, so drift hits both equally
        a.append(timed(base, env))
        b.append(timed(other, env))
    qa, qb = statistics.quantiles(a, n=4), statistics.quantiles(b, n=4)
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{name}")
    print(f"  baseline median {ma:7.2f} ms (IQR {qa[0]:.2f}-{qa[2]:.2f})")
    print(f"  with     median {mb:7.2f} ms (IQR {qb[0]:.2f}-{qb[2]:.2f})")
    print(f"  difference {mb - ma:+.2f} ms, ratio {mb / ma:.3f}  ({runs} runs each)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    python = sys.executable
    env = dict(os.environ, PYTHONPATH=str(REPO))
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
    compare(
        "import vllm_hotfix (bare interpreter, -c pass vs -c 'import vllm_hotfix')",
        [python, "-c", "pass"],
        [python, "-c", "import vllm_hotfix"],
        args.runs,
        env,
    )
    with tempfile.TemporaryDirectory() as tmp:
        plain = make_venv(Path(tmp) / "plain", python, hook=False)
        hooked = make_venv(Path(tmp) / "hooked", python, hook=True)
        compare(
            "interpreter start-up, site hook installed vs not (python -c pass)",
            [plain, "-c", "pass"],
            [hooked, "-c", "pass"],
            args.runs,
        )


if __name__ == "__main__":
    main()
