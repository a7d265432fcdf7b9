"""GPU check of `deepseek-v32-final-aux-nvidia` (DeepseekV32Model) on one GPU, TP=1, on a chosen vllm
release (`--release`): 0.26.0 (the newest vllm on torch 2.11.0: the offline bundle's and the online
environment's) or 0.32.0 (torch 2.13.0: the online environment only, gpu/online_env.py). Its
`vllm/models/deepseek_v32/nvidia/model.py` with the real DSA attention (sparse MLA through FlashMLA,
the lightning indexer through DeepGEMM, an fp8_ds_mla KV cache: the only DSA path on SM90), vLLM's
default compilation and CUDA graph settings, extract_hidden_states with the final layer, on a tiny
random DeepSeek V3.2 checkpoint.

In vLLM 0.25.0-0.28.x the architecture DeepseekV32ForCausalLM resolves to deepseek_v2's model by
default (registry.py), and the nvidia file is reached through `model_class_overrides`, which this
check sets; from 0.29.0 vLLM's registry resolves it to that file on CUDA, and the check sets no
override: it checks that the backbone the engine built is the nvidia file's.

Runs (fresh engines, the hotfix as a plugin in each): stock with the final layer (fix disabled by
VLLMHOTFIX_DISABLE: the bug), stock without it (ids [1,2]: the reference for every step), patched
with it (ids [1,2,4]). Oracles, per proposer call (the prefill runs eagerly between CUDA-graph
segments, decode steps replay CUDA graphs):
- in-loop states (ids 1, 2) equal stock's bit for bit (at TP=1 the fix changes nothing else);
- the final state equals `hidden_states + residual` at the input of the model's final norm (a forward
  pre-hook on that norm, in the same process and step; harness/child/sites/capture): on every release the
  fix takes it from the final fused norm's second output;
- the model's output (the final norm's output, same hook mechanism) and the generated tokens equal
  stock's.
Then `vllm-hotfix verify` on the same checkpoint and flags: FAIL with the fix off, PASS with it.
Prints one line per check, PASS or FAIL, and exits 1 on any failure. Run by gpu/check.sh.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu.check_v2 import GPU, Report, _diff, check_output_and_tokens, finish, keep_run, verify_runs

if TYPE_CHECKING:
    from harness.testenv import TestEnv

RELEASES = ("0.26.0", "0.32.0")  # on torch 2.11.0 (bundle or online), on torch 2.13.0 (online)
REGISTRY_DEFAULT = (0, 29, 0)  # from here vLLM's registry picks the nvidia file on CUDA
FIX = "deepseek-v32-final-aux-nvidia"
BACKBONE = "vllm.models.deepseek_v32.nvidia.model.DeepseekV32Model"
IDS, INNER = "1,2,4", "1,2"
ARGS = ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8_ds_mla", "--tokenizer-mode", "hf"]
OVERRIDE = [
    "--model-class-override",
    "DeepseekV32ForCausalLM=vllm.models.deepseek_v32.nvidia.model:DeepseekV32ForCausalLM",
]
STOCK_BUG, STOCK, PATCHED = f"stock, ids [{IDS}]", f"stock, ids [{INNER}]", f"hotfix, ids [{IDS}]"
# `vllm-hotfix verify` on the same checkpoint and flags (check_v2.verify_runs): at TP=1 stock's in-loop
# states are right (no partial sums on one rank), so only the missing final state fails, as a count
# failure; the hotfix passes every check.
VERIFY_RUNS = {
    "verify, v32 fix off": ([], {"VLLMHOTFIX_DISABLE": FIX}, "FAIL"),
    "verify, v32 hotfix": ([], {}, "PASS"),
}


def engine_args(release: str) -> list[str]:
    """The engine's arguments on `release`: the override only where the registry does not pick the file."""
    numbers = tuple(int(part) for part in release.split(".")[:3])
    return ARGS if numbers >= REGISTRY_DEFAULT else [*ARGS, *OVERRIDE]


def missing_release(testenv: TestEnv, release: str) -> str | None:
    """Why `release` cannot run in this environment, in words a user can act on (None if it can):
    the offline bundle has no venv for 0.32.0, which needs its own torch."""
    python = Path(testenv.python_for(release))
    if python.exists():
        return None
    return (
        f"vllm {release} is not installed in {testenv.root} (no {python}): build the environment"
        " with `bash gpu/check.sh install-online` (plain pip); the offline bundle"
        " carries no torch, so it stops at vllm 0.26.0"
    )


def compare(runs: dict[str, dict]) -> Report:
    """Every check from the recorded runs (pure: tests feed it recorded runs)."""
    import torch

    report = Report()
    for label, run in runs.items():
        built = {c.get("backbone") for c in run["calls"]}
        report.check(
            built == {BACKBONE},
            f"{label}: the engine built the nvidia file's DeepseekV32Model",
            ", ".join(map(str, built)),
        )
    bug = runs[STOCK_BUG]
    first = bug["calls"][0]["received"] if bug["calls"] else []
    cause = bug["root_cause"] or bug["result"].get("error", "")
    report.check(
        len(first) == len(INNER.split(",")) and all(not c.get("patched_v32") for c in bug["calls"]),
        f"{STOCK_BUG}: the bug (one state too few)",
        f"{len(first)} states; "
        + ("generated" if bug["result"]["ok"] else "failed: " + cause.splitlines()[0][:120]),
    )
    stock, patched = runs[STOCK], runs[PATCHED]
    for label, run in ((STOCK, stock), (PATCHED, patched)):
        report.check(
            run["result"]["ok"] and bool(run["calls"]),
            f"{label}: generated, proposer called",
            run["result"].get("error", "")[:150],
        )
    if not (stock["calls"] and patched["calls"]):
        return report
    report.check(
        all(c.get("patched_v32") for c in patched["calls"]),
        f"{PATCHED}: the engine core ran the patched forward",
    )
    report.check(
        not any(c.get("patched_v32") for c in stock["calls"]), f"{STOCK}: the engine core ran stock's forward"
    )
    calls, ref = patched["calls"], stock["calls"]
    report.check(
        len(calls) == len(ref), f"{PATCHED}: as many proposer calls as stock", f"{len(calls)} vs {len(ref)}"
    )
    report.check(
        all(len(c["received"]) == 3 for c in calls),
        f"{PATCHED}: 3 states per call (ids [{IDS}])",
        ", ".join(str(len(c["received"])) for c in calls),
    )
    inner = [
        f"call {n} id {i}: {_diff(x, y)}"
        for n, (a, b) in enumerate(zip(calls, ref, strict=False))
        for i, x, y in zip(INNER.split(","), a["received"], b["received"], strict=False)
        if x.shape != y.shape or not torch.equal(x, y)
    ]
    report.check(
        not inner,
        f"{PATCHED}: in-loop states (ids [{INNER}]) == stock's, every call",
        "; ".join(inner[:6]) or "bitwise equal",
    )
    recorded = all("oracle_pre_norm_sum" in c for c in calls)
    if report.check(recorded, f"{PATCHED}: the in-process oracle recorded every call"):
        final = [
            f"call {n}: {_diff(c['received'][-1], c['oracle_pre_norm_sum'])}"
            for n, c in enumerate(calls)
            if len(c["received"]) == 3 and not torch.equal(c["received"][-1], c["oracle_pre_norm_sum"])
        ]
        report.check(
            not final and all(len(c["received"]) == 3 for c in calls),
            f"{PATCHED}: final state (id 4) == hidden_states + residual at the final norm's input, "
            "every call (pre-hook, same process)",
            "; ".join(final) or f"{len(calls)} calls bitwise equal",
        )
    check_output_and_tokens(report, PATCHED, patched, stock, "stock's")
    return report


def main() -> int:
    import argparse

    import torch

    from harness.child.tiny_checkpoint import build as build_checkpoint
    from harness.testenv import TestEnv
    from harness.ways_in import Ways

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--release", choices=RELEASES, default=RELEASES[0])
    release = parser.parse_args().release
    testenv = TestEnv.locate()
    missing = missing_release(testenv, release)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-gpu-v32-"))
    logs = Path(os.environ.get("GPU_CHECK_LOGS") or work)  # where each run's engine log is kept
    build_checkpoint(str(work / "tiny-v32"), v32=True)
    how = "vLLM's registry" if engine_args(release) == ARGS else "model_class_overrides"
    print(
        f"GPU: {torch.cuda.get_device_name(0)}; DeepseekV32Model (vllm {release}, nvidia file by {how}), "
        "TP=1, bfloat16, fp8_ds_mla"
    )
    ways = Ways(testenv, work / "tiny-v32", work)
    shared = {"VLLM_CACHE_ROOT": str(work / "vllm-cache"), "DG_JIT_CACHE_DIR": str(work / "deep-gemm-cache")}
    runs = {}
    for label, ids, env in (
        (STOCK_BUG, IDS, {"VLLMHOTFIX_DISABLE": FIX}),
        (STOCK, INNER, {"VLLMHOTFIX_DISABLE": FIX}),
        (PATCHED, IDS, {}),
    ):
        start = time.monotonic()
        run = ways.run(
            "plugin", ids, "compile", release, extra_args=engine_args(release), **GPU, **shared, **env
        )
        keep_run(runs, label, run, logs / f"v32-run{len(runs)}.log", start)
    report = compare(runs)
    env = {key: GPU[key] for key in ("VLLM_MLA_DISABLE", "VLLM_USE_FLASHINFER_SAMPLER")}
    env["DG_JIT_CACHE_DIR"] = shared["DG_JIT_CACHE_DIR"]
    verify_runs(
        report, testenv, work / "tiny-v32", work, release, engine_args(release), VERIFY_RUNS, logs, env
    )
    return finish(report, logs)


if __name__ == "__main__":
    sys.exit(main())
