"""GPU check: the real vllm 0.24.0 CUDA build, MLA on, vLLM's default compilation and CUDA graphs,
extract_hidden_states with the final layer: without the deepseek fix, with the hotfix (plugin),
the hotfix again on warm compile caches, and vllm 0.25.0 as the reference. The 0.24.0 runs share
one VLLM_CACHE_ROOT, so the patched runs meet the unpatched run's artifacts (vLLM's ahead-of-time
and JIT caches) and must not load them. Run by benchmarks/gpu_check.sh; prints lines to read."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.testenv import BUG, FIXED, TestEnv
from harness.tiny_checkpoint import build as build_checkpoint
from harness.ways_in import Ways

IDS = "1,2,4"
GPU = {"VLLM_MLA_DISABLE": "0", "VLLM_CPU_KVCACHE_SPACE": ""}


def main() -> int:
    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-gpu-"))
    build_checkpoint(str(work / "tiny"), gpu_mla=True)
    print(f"GPU: {torch.cuda.get_device_name(0)}; ids [{IDS}], bfloat16, default compilation + CUDA graphs")
    ways = Ways(testenv, work / "tiny", work)
    runs = {}
    shared = {"VLLM_CACHE_ROOT": str(work / "shared-vllm-cache")}
    for label, way, version, env in (
        ("0.24.0, deepseek fix off", "import", BUG, {"VLLM_HOTFIX_DISABLE": "deepseek-final-aux", **shared}),
        ("0.24.0 + hotfix (plugin)", "plugin", BUG, shared),
        ("0.24.0 + hotfix, warm", "plugin", BUG, shared),
        ("0.25.0", "stock", FIXED, {}),
    ):
        start = time.monotonic()
        run = ways.run(way, IDS, "compile", version, extra_args=["--dtype", "bfloat16"], **GPU, **env)
        result = run["result"]
        cause = run["root_cause"] or result.get("error", "")
        outcome = "generated" if result["ok"] else "FAILED: " + cause.splitlines()[0][:150]
        print(f"{label:28s} {outcome} ({time.monotonic() - start:.0f} s)")
        runs[label] = run
    upstream = runs["0.25.0"]
    status = 0
    for label in ("0.24.0 + hotfix (plugin)", "0.24.0 + hotfix, warm"):
        fixed = runs[label]
        if not (fixed["calls"] and upstream["calls"]):
            print(f"{label}: no proposer call recorded")
            status = 1
            continue
        print(f"{label} against 0.25.0, first proposer call:")
        mine_all, theirs_all = fixed["calls"][0]["received"], upstream["calls"][0]["received"]
        if len(mine_all) != len(theirs_all):
            print(f"  {len(mine_all)} states vs {len(theirs_all)}")
            status = 1
        for layer, mine, theirs in zip(IDS.split(","), mine_all, theirs_all, strict=False):
            equal = torch.equal(mine, theirs)
            diff = (mine.float() - theirs.float()).abs().max().item()
            print(f"  layer {layer}: {'bitwise equal' if equal else f'max abs diff {diff:.3g}'}")
            status = status or int(not equal)
    return status


if __name__ == "__main__":
    sys.exit(main())
