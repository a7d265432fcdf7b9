"""GPU check of `deepseek-final-aux` (DeepseekV2Model, vLLM 0.24.0) on one GPU: the real vllm 0.24.0 CUDA
build, MLA on, vLLM's default compilation and CUDA graphs, extract_hidden_states with the final layer.

Runs, each a fresh engine: 0.24.0 without the fix (the bug), 0.24.0 with the hotfix as a plugin, the
same again on the warm compile caches (the three 0.24.0 runs share one VLLM_CACHE_ROOT, so the patched
runs meet the unpatched run's artifacts and must not load them), vllm 0.25.0 (upstream's fix), and
0.24.0 with the hotfix under --enforce-eager (vLLM's CUDA norm kernels; judged by the first oracle
below only). Then the check itself, `vllm-hotfix verify` as a user runs it (its own engine, the
user's flags, compiled with CUDA graphs off through vLLM's compilation config): FAIL (exit 1) with the
fix off, PASS (exit 0) with it, compiled and under --enforce-eager (`verify_runs`).

Oracles, each per proposer call (prefill and decode steps):
- in-process, independent of the fix: the final state equals `hidden_states + residual` at the input
  of the model's final norm, taken in the same process and step by a forward pre-hook on that norm
  (harness/child/sites/capture, VLLMHOTFIX_ORACLE=1);
- every other state equals stock's (the unpatched run's first call, recorded before it crashes);
- every state, and the norm's output, equal vllm 0.25.0's.
Prints one line per check, PASS or FAIL, and exits 1 on any failure. Run by gpu/check.sh.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

IDS = "1,2,4"  # 4 = num_hidden_layers: the final layer
GPU = {
    "VLLM_MLA_DISABLE": "0",
    # The bundle carries no FlashInfer; unset, vLLM's sampler imports it on CUDA (first GPU run,
    # 2026-12-04). The sampler is not under check: PyTorch's top-k/top-p path is used instead.
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_CPU_KVCACHE_SPACE": "",
    "VLLMHOTFIX_ORACLE": "1",
}
# --enforce-eager: vLLM runs its CUDA norm kernels (the in-place fused add-RMSNorm) only outside its
# default compiled mode, whose norms are native; the pre-norm-sum oracle is what that path can break.
EAGER = "0.24.0 + hotfix, eager"
BUG_LABEL, PATCHED, WARM, UPSTREAM = (
    "0.24.0, deepseek fix off",
    "0.24.0 + hotfix (plugin)",
    "0.24.0 + hotfix, warm",
    "0.25.0",
)
# What `vllm-hotfix verify` must say (its verdict, its exit code) with the fix off (the bug's missing
# state is a count failure) and on (every check passes, the final id's included), and the engine
# flags of each run beyond the kit's (label: flags, extra environment, verdict).
VERIFY_RUNS = {
    "verify, deepseek fix off": ([], {"VLLMHOTFIX_DISABLE": "deepseek-final-aux"}, "FAIL"),
    "verify, hotfix": ([], {}, "PASS"),
    "verify, hotfix, --enforce-eager": (["--enforce-eager"], {}, "PASS"),
}
EXIT = {"PASS": 0, "FAIL": 1}


class Report:
    """One line per check; remembers whether any failed."""

    def __init__(self) -> None:
        self.failed = 0

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {what}" + (f": {detail}" if detail else ""), flush=True)
        return ok


def _diff(a: Any, b: Any) -> str:
    import torch

    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    return (
        "bitwise equal"
        if torch.equal(a, b)
        else f"max abs diff {(a.float() - b.float()).abs().max().item():.3g}"
    )


def compare_states(report: Report, label: str, run: dict, stock: dict | None, upstream: dict | None) -> None:
    """The oracles above for one patched run (pure: tests feed it recorded runs)."""
    import torch

    layers = IDS.split(",")
    calls = run["calls"] or []
    if not report.check(bool(calls), f"{label}: the proposer was called", f"{len(calls)} calls"):
        return
    report.check(all(c.get("patched") for c in calls), f"{label}: the engine core ran the patched forward")
    report.check(
        all(len(c["received"]) == len(layers) for c in calls),
        f"{label}: {len(layers)} states per call (ids [{IDS}])",
        ", ".join(str(len(c["received"])) for c in calls),
    )
    oracle = [c for c in calls if "oracle_pre_norm_sum" in c]
    if report.check(len(oracle) == len(calls), f"{label}: the in-process oracle recorded every call"):
        bad = [
            f"call {n}: {_diff(c['received'][-1], c['oracle_pre_norm_sum'])}"
            for n, c in enumerate(calls)
            if len(c["received"]) == len(layers)
            and not torch.equal(c["received"][-1], c["oracle_pre_norm_sum"])
        ]
        report.check(
            not bad,
            f"{label}: final state (id {layers[-1]}) == hidden_states + residual at the final norm's input, "
            f"every call (pre-hook, same process)",
            "; ".join(bad) or f"{len(calls)} calls bitwise equal",
        )
    if stock is not None and stock["calls"]:
        mine, theirs = calls[0]["received"], stock["calls"][0]["received"]
        inner = len(layers) - 1
        ok = len(theirs) >= inner and all(
            torch.equal(a, b) for a, b in zip(mine[:inner], theirs[:inner], strict=False)
        )
        report.check(
            ok,
            f"{label}: in-loop states (ids [{','.join(layers[:-1])}]) == stock 0.24.0's, first call",
            "; ".join(
                f"id {i}: {_diff(a, b)}"
                for i, a, b in zip(layers, mine[:inner], theirs[:inner], strict=False)
            ),
        )
    if upstream is not None and upstream["calls"]:
        theirs_calls = upstream["calls"]
        same_count = len(theirs_calls) == len(calls)
        report.check(
            same_count, f"{label}: as many proposer calls as 0.25.0", f"{len(calls)} vs {len(theirs_calls)}"
        )
        worst = []
        for n, (a, b) in enumerate(zip(calls, theirs_calls, strict=False)):
            for layer, x, y in zip(layers, a["received"], b["received"], strict=False):
                if x.shape != y.shape or not torch.equal(x, y):
                    worst.append(f"call {n} id {layer}: {_diff(x, y)}")
        report.check(
            not worst,
            f"{label}: every state == vllm 0.25.0's, every call",
            "; ".join(worst[:6]) or "bitwise equal",
        )
        check_output_and_tokens(report, label, run, upstream, "vllm 0.25.0's")


def check_output_and_tokens(report: Report, label: str, run: dict, reference: dict, whose: str) -> None:
    """The model's output (the final norm's, every call) and the generated tokens equal `reference`'s:
    a fix that changes only the aux states leaves both bitwise as they were."""
    outputs = [
        _diff(a["oracle_norm_output"], b["oracle_norm_output"])
        for a, b in zip(run["calls"], reference["calls"], strict=False)
        if "oracle_norm_output" in a and "oracle_norm_output" in b
    ]
    report.check(
        bool(outputs) and all(o == "bitwise equal" for o in outputs),
        f"{label}: the model's output (final norm) == {whose}, every call",
        ", ".join(outputs),
    )
    tokens = (run["result"].get("tokens"), reference["result"].get("tokens"))
    report.check(
        tokens[0] == tokens[1], f"{label}: generated tokens == {whose}", f"{tokens[0]} vs {tokens[1]}"
    )


def compare(runs: dict[str, dict]) -> Report:
    """Every check of the GPU run from the recorded runs (pure: tests feed it recorded runs)."""
    import torch

    report = Report()
    stock = runs[BUG_LABEL]
    cause = stock["root_cause"] or stock["result"].get("error", "")
    first = stock["calls"][0]["received"] if stock["calls"] else []
    report.check(
        not stock["result"]["ok"] and len(first) == len(IDS.split(",")) - 1,
        f"{BUG_LABEL}: the bug (one state too few, then the engine fails)",
        f"{len(first)} states; {cause.splitlines()[0][:150] if cause else 'no error'}",
    )
    upstream = runs[UPSTREAM]
    up_calls = upstream["calls"] or []
    if report.check(bool(up_calls) and upstream["result"]["ok"], f"{UPSTREAM}: generated, proposer called"):
        report.check(
            all(
                torch.equal(c["received"][-1], c["oracle_pre_norm_sum"])
                for c in up_calls
                if "oracle_pre_norm_sum" in c
            )
            and all("oracle_pre_norm_sum" in c for c in up_calls),
            f"{UPSTREAM}: upstream's final state == the pre-hook oracle (the oracle agrees with upstream)",
        )
    for label in (PATCHED, WARM):
        run = runs[label]
        report.check(run["result"]["ok"], f"{label}: generated", run["result"].get("error", "")[:150])
        compare_states(report, label, run, stock, upstream)
    return report


def check_verdict(report: Report, label: str, document: dict, code: int, wanted: str, eager: bool) -> None:
    """One `vllm-hotfix verify --json` run: its verdict and exit code, every id compared, and the
    mode it says it ran (compiled with CUDA graphs off, or the user's --enforce-eager). Pure."""
    ranks = document.get("ranks") or []
    report.check(
        document.get("verdict") == wanted and code == EXIT[wanted],
        f"{label}: vllm-hotfix verify says {wanted} (exit {EXIT[wanted]})",
        f"{document.get('verdict')} (exit {code}): {str(document.get('reason'))[:200]}",
    )
    if wanted == "PASS":
        coverage = document.get("coverage") or {}
        report.check(bool(ranks) and coverage.get("ok") is True, f"{label}: every id compared", str(coverage))
    modes = document.get("compilation") or {}
    expected = "NONE" if eager else "not NONE"
    ran = modes.get("mode") == "NONE" if eager else modes.get("mode") not in (None, "NONE")
    report.check(
        ran and (eager or modes.get("cudagraph_mode") == "NONE"),
        f"{label}: compilation mode {expected}, CUDA graphs off",
        str(modes),
    )


def verify_runs(report: Report, testenv: Any, checkpoint: Path, work: Path, version: str, flags: list[str],
                runs: dict, logs: Path, env: dict[str, str]) -> None:  # fmt: skip
    """`vllm-hotfix verify` per VERIFY_RUNS, the hotfix as a plugin (as a user installs it)."""
    from harness.ways_in import install_plugin

    plugin = install_plugin(testenv, work / "verify-plugin")
    for n, (label, (extra, own_env, wanted)) in enumerate(runs.items()):
        start = time.monotonic()
        reports = work / f"verify-reports-{version}-{n}"
        command = ["-m", "vllm_hotfix", "verify", str(checkpoint), "--json", "--ids", IDS]
        command += ["--report-dir", str(reports), "--", *flags, *extra]
        done = testenv.run(command, version=version, paths=(plugin,), timeout=3600, **{**env, **own_env})
        (logs / f"{label.replace(' ', '_').replace(',', '')}.log").write_text(done.stdout + done.stderr)
        try:
            document = json.loads(done.stdout)
        except ValueError:
            document = {"verdict": None, "reason": (done.stderr or "no output")[-300:]}
        print(f"{label:40s} exit {done.returncode} ({time.monotonic() - start:.0f} s)", flush=True)
        check_verdict(report, label, document, done.returncode, wanted, "--enforce-eager" in extra)


def _compile_lines(log: str) -> str:
    """What vLLM said about its compile caches and CUDA graphs (to read, not a check)."""
    keys = (
        "compiled graph",
        "Directly load",
        "torch.compile takes",
        "Capturing CUDA graph",
        "Graph capturing",
    )
    lines = [line.strip() for line in log.splitlines() if any(k in line for k in keys)]
    norms = sorted(set(re.findall(r"IrOpPriorityConfig\([^)]*\)", log)))  # which norm kernels ran
    return "\n".join("    " + re.sub(r"^.*?\] ", "", line)[:160] for line in lines[:8] + norms)


def keep_run(runs: dict[str, dict], label: str, run: dict, log: Path, start: float) -> None:
    """Say how one engine run went (and what it compiled), keep its log in `log`, add it to `runs`."""
    cause = run["root_cause"] or run["result"].get("error", "")
    outcome = "generated" if run["result"]["ok"] else "FAILED: " + cause.splitlines()[0][:150]
    print(f"{label:32s} {outcome} ({time.monotonic() - start:.0f} s)", flush=True)
    print(_compile_lines(run["log"]), flush=True)
    log.write_text(run["log"])
    runs[label] = run


def finish(report: Report, logs: Path) -> int:
    """Say where the logs are; the exit status."""
    print(f"engine logs in {logs}; {report.failed} check(s) failed")
    return 1 if report.failed else 0


def main() -> int:
    import torch

    from harness.child.tiny_checkpoint import build as build_checkpoint
    from harness.testenv import BUG, FIXED, TestEnv
    from harness.ways_in import Ways

    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-gpu-"))
    logs = Path(os.environ.get("GPU_CHECK_LOGS") or work)  # the runbook sets it to the run's $OUT
    build_checkpoint(str(work / "tiny"), gpu_mla=True)
    print(
        f"GPU: {torch.cuda.get_device_name(0)}; DeepseekV2Model, ids [{IDS}], bfloat16, "
        "default compilation + CUDA graphs"
    )
    ways = Ways(testenv, work / "tiny", work)
    runs = {}
    shared = {"VLLM_CACHE_ROOT": str(work / "shared-vllm-cache")}
    for label, way, version, env, mode in (
        (BUG_LABEL, "import", BUG, {"VLLMHOTFIX_DISABLE": "deepseek-final-aux", **shared}, "compile"),
        (PATCHED, "plugin", BUG, shared, "compile"),
        (WARM, "plugin", BUG, shared, "compile"),
        (UPSTREAM, "stock", FIXED, {}, "compile"),
        (EAGER, "plugin", BUG, {}, "eager"),
    ):
        start = time.monotonic()
        run = ways.run(way, IDS, mode, version, extra_args=["--dtype", "bfloat16"], **{**GPU, **env})
        keep_run(runs, label, run, logs / f"v2-run{len(runs)}.log", start)
    report = compare(runs)
    eager = runs[EAGER]  # its own oracle only: eager states differ from compiled ones in bfloat16
    report.check(eager["result"]["ok"], f"{EAGER}: generated", eager["result"].get("error", "")[:150])
    compare_states(report, EAGER, eager, None, None)
    env = {"VLLM_MLA_DISABLE": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_CPU_KVCACHE_SPACE": ""}
    verify_runs(report, testenv, work / "tiny", work, BUG, ["--dtype", "bfloat16"], VERIFY_RUNS, logs, env)
    return finish(report, logs)


if __name__ == "__main__":
    sys.exit(main())
