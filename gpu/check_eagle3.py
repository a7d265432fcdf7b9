"""GPU check of `eagle3-nested-layer-ids` (Model Runner V2's EAGLE3 aux layer ids) on one GPU: the real
vLLM CUDA build runs Model Runner V2 (it cannot on CPU: it needs Triton's GPU backend), an EAGLE3
draft whose config declares its ids under `eagle_config` (SpecForge/EAGLE), a tiny 8-layer Llama
target, dummy weights, vLLM's default compilation and CUDA graphs (harness/child/eagle3_engine.py).

Runs, each a fresh engine with the hotfix installed as a plugin (as a user installs it), on `--release`
0.26.0 (the offline bundle's newest) or 0.32.0 (online environment only):
- V2, fix off (`VLLMHOTFIX_DISABLE`): the bug: the target captures its default layers (2, 4, 5);
- V2 with the hotfix: the declared layers (1, 3, 6);
- V1 (`VLLM_USE_V2_MODEL_RUNNER=0`), fix off: the reference, the declared layers.
`VLLM_USE_V2_MODEL_RUNNER=1` on the V2 runs (before 0.29.0 V2 is not the default for Llama).
Checks per run: the runner that ran, the layers the target captures for the draft, the draft's `fc`
width (three states), the fix's installed state, and that tokens were generated. Prints one line per
check, PASS or FAIL, and exits 1 on any failure. Run by gpu/check.sh (`eagle3`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu.check_v2 import Report, finish

RELEASES = ("0.26.0", "0.32.0")
FIX = "eagle3-nested-layer-ids"
DECLARED, DEFAULTS = [1, 3, 6], [2, 4, 5]  # an 8-layer Llama target: (2, N // 2, N - 3)
V2_RUNNER, V1_RUNNER = "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"
GPU = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_CPU_KVCACHE_SPACE": "",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
STOCK_V2, PATCHED_V2, STOCK_V1 = "V2, fix off", "V2 + hotfix", "V1, fix off"
# label: (environment, the runner that must run, the layers it must capture, fix installed)
RUNS: dict[str, tuple[dict[str, str], str, list[int], bool]] = {
    STOCK_V2: ({"VLLMHOTFIX_DISABLE": FIX, "VLLM_USE_V2_MODEL_RUNNER": "1"}, V2_RUNNER, DEFAULTS, False),
    PATCHED_V2: ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, V2_RUNNER, DECLARED, True),
    STOCK_V1: ({"VLLMHOTFIX_DISABLE": FIX, "VLLM_USE_V2_MODEL_RUNNER": "0"}, V1_RUNNER, DECLARED, False),
}


def compare(runs: dict[str, dict[str, Any] | None]) -> Report:
    """Every check from the recorded runs (pure: tests feed it recorded runs)."""
    report = Report()
    for label, (_, runner, layers, installed) in RUNS.items():
        facts = runs.get(label)
        if not report.check(facts is not None, f"{label}: the engine ran and reported"):
            continue
        assert facts is not None
        report.check(facts["runner"] == runner, f"{label}: ran {runner}", facts["runner"])
        report.check(
            facts["aux_layers"] == layers,
            f"{label}: the target captures layers {layers} for the draft",
            str(facts["aux_layers"]),
        )
        report.check(facts["draft_fc_states"] == 3, f"{label}: the draft's fc takes 3 states")
        report.check(facts["fix_installed"] == installed, f"{label}: fix installed is {installed}")
        report.check(
            bool(facts["tokens"]) and all(len(t) == 8 for t in facts["tokens"]), f"{label}: generated"
        )
    return report


def main() -> int:
    import argparse

    import torch

    from harness.testenv import TestEnv, child_result
    from harness.ways_in import install_plugin

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--release", choices=RELEASES, default=RELEASES[0])
    release = parser.parse_args().release
    testenv = TestEnv.locate()
    if not Path(testenv.python_for(release)).exists():
        print(
            f"vllm {release} is not installed in {testenv.root}: bash gpu/check.sh install-online",
            file=sys.stderr,
        )
        return 2
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-gpu-eagle3-"))
    logs = Path(os.environ.get("GPU_CHECK_LOGS") or work)
    print(f"GPU: {torch.cuda.get_device_name(0)}; EAGLE3, ids {DECLARED} under eagle_config, vllm {release}")
    plugin = install_plugin(testenv, work / "plugin")
    runs: dict[str, dict[str, Any] | None] = {}
    for n, (label, (env, _, _, _)) in enumerate(RUNS.items()):
        start = time.monotonic()
        done = testenv.run(
            [testenv.script("eagle3_engine")], version=release, paths=(plugin,), timeout=1800, **GPU, **env
        )
        (logs / f"eagle3-run{n}.log").write_text(done.stdout + done.stderr)
        found = child_result(done.stdout)
        runs[label] = found if isinstance(found, dict) else None
        outcome = "reported" if runs[label] else f"FAILED (exit {done.returncode}): {done.stderr[-300:]}"
        print(f"{label:16s} {outcome} ({time.monotonic() - start:.0f} s)", flush=True)
    return finish(compare(runs), logs)


if __name__ == "__main__":
    sys.exit(main())
