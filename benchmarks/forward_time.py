"""Forward time of the tiny DeepSeek-V3 model on CPU: stock vs patched vLLM 0.24.0 without the
final id (target 1.00 within noise), patched 0.24.0 vs 0.25.0 with it (target: no slower).

Each configuration is one in-process engine; inside one real prefill step the model's forward is
timed --repeat times (eager, or through vLLM's compiled forward). Medians with the IQR.
Run: bash scripts/bench.sh forward_time [--repeat 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.testenv import BUG, FIXED, TestEnv
from harness.tiny_checkpoint import build as build_checkpoint

RUNS = [  # (label, version, hotfix, ids)
    ("stock 0.24.0, ids [1,2]", BUG, False, "1,2"),
    ("patched 0.24.0, ids [1,2]", BUG, True, "1,2"),
    ("patched 0.24.0, ids [1,4]", BUG, True, "1,4"),
    ("0.25.0, ids [1,4]", FIXED, False, "1,4"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=100)
    args = parser.parse_args()
    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-bench-"))
    build_checkpoint(str(work / "tiny"))

    for mode in ("eager", "compile"):
        medians: dict[str, float] = {}
        print(f"\n{mode}: forward of 12 tokens, {args.repeat} timed calls each")
        for label, version, hotfix, ids in RUNS:
            out = work / f"{mode}-{len(medians)}.pt"
            cmd = [
                testenv.script("model_states"),
                "--checkpoint",
                str(work / "tiny"),
                "--variants",
                ids,
                "--mode",
                mode,
                "--out",
                str(out),
                "--repeat",
                str(args.repeat),
            ]
            done = testenv.run(
                cmd + (["--hotfix"] if hotfix else []),
                version=version,
                hotfix=hotfix,
                VLLM_CACHE_ROOT=str(work / f"cache-{mode}-{len(medians)}"),
            )
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            times = [t * 1e3 for t in torch.load(out)["timings"]]
            q = statistics.quantiles(times, n=4)
            medians[label] = statistics.median(times)
            print(f"  {label:28s} median {medians[label]:7.3f} ms  (IQR {q[0]:.3f}-{q[2]:.3f})")
        names = [r[0] for r in RUNS]
        print(f"  ratio patched/stock without final id: {medians[names[1]] / medians[names[0]]:.3f}")
        print(f"  ratio patched/0.25.0 with final id:   {medians[names[2]] / medians[names[3]]:.3f}")


if __name__ == "__main__":
    main()
