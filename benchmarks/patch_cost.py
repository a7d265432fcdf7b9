"""Time to patch at module import: read the source, probe it, derive and compile the fixed
function, write its file, install it. Run: bash scripts/bench.sh patch_cost
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def ms(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=4)
    return f"median {statistics.median(samples):.3f} ms (IQR {q[0]:.3f}-{q[2]:.3f})"


def main(runs: int = 200) -> None:
    import vllm_hotfix  # armed before vLLM, as the plugin or site hook would be

    t0 = time.perf_counter()
    from vllm.model_executor.models import deepseek_v2  # the hook patches during this import

    print(
        f"vLLM {sys.modules['vllm'].__version__}: importing deepseek_v2 took {time.perf_counter() - t0:.2f} s"
    )
    from vllm_hotfix import codegen, decide, patching, settings
    from vllm_hotfix.fixes import ALL_FIXES

    fix = ALL_FIXES[0]
    found = settings.read_settings(())
    installed = vars(deepseek_v2.DeepseekV2Model)["forward"]
    original = installed.__wrapped__
    print(f"fix {fix.fix_id}: {vllm_hotfix.status()['fixes'][0]['decision']}")

    whole: list[float] = []
    for _ in range(runs):  # what the import hook does: decide, derive, compile, write, install
        fix.put(deepseek_v2, original, replacing=installed)
        t = time.perf_counter()
        record = decide.decide(fix, deepseek_v2, found, None)
        installed = patching.patch(
            fix, deepseek_v2, original, record.fixed_source, record.vllm_version
        ).function
        whole.append((time.perf_counter() - t) * 1e3)
    print(f"  whole decision + patch: {ms(whole)}  ({runs} runs)")

    steps: dict[str, list[float]] = {k: [] for k in ("getsource", "probe", "transform", "build")}
    for _ in range(runs):
        t0 = time.perf_counter()
        source = inspect.getsource(original)
        t1 = time.perf_counter()
        fix.probe_source(source)
        t2 = time.perf_counter()
        fixed = fix.transform_source(source)
        fix.probe_source(fixed)  # the self-check the engine runs
        t3 = time.perf_counter()
        codegen.build_function(
            fix_id=fix.fix_id,
            original=original,
            namespace=original.__globals__,
            source=fixed,
            qualname_base=original.__qualname__,
            provenance="benchmark",
            directories=patching.generated_dirs(),
        )
        t4 = time.perf_counter()
        for key, seconds in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            steps[key].append(seconds * 1e3)
    for key, samples in steps.items():
        print(f"    {key:10s} {ms(samples)}")


if __name__ == "__main__":
    main()
