"""The `--json` documents of one audit's shards (`--world-size W --rank R`, one per rank) as one
verdict and one estimate, by the rule of a single run (verdict.py); `vllm-hotfix audit-merge`
(commands/audit_merge.py) reads them and prints the result.

Shards are one audit only when they list the same dataset (the sha256 of its files' relative
paths), model, ids and selection (sample, seed, --max-tokens, world size): anything else is
refused (exit 4). A rank missing leaves the verdict incomplete (exit 2) unless a file is wrong.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_hotfix.audit import verdict as verdict_mod
from vllm_hotfix.audit.results import merged_per_id
from vllm_hotfix.judging import verdicts
from vllm_hotfix.judging.verdicts import PASS, STATUSES, UNKNOWN, UsageError

SAME = ("model", "ids", "precision")  # top-level keys every shard must share (precision: --tolerance)
SAME_SELECTION = ("sample", "seed", "max_tokens", "world_size", "files_in_data")


def check(path: str, document: Any, schema: int) -> dict[str, Any]:
    """`document`, read from REPORT `path`, if it is an audit shard's of this `schema`; else UsageError."""
    if not isinstance(document, dict) or document.get("command") != "audit" or "selection" not in document:
        raise UsageError(f"REPORT {path}: not the --json document of a vllm-hotfix audit shard")
    if document.get("schema") != schema:
        raise UsageError(
            f"REPORT {path}: schema {document.get('schema')}, not {schema}: made by another"
            " version of vllm-hotfix; audit the shard again with this one"
        )
    return document


def _key(document: dict[str, Any]) -> dict[str, Any]:
    selection = document["selection"]
    return {
        "dataset": (document.get("dataset") or {}).get("listing_sha256"),
        **{key: document.get(key) for key in SAME},
        **{key: selection.get(key) for key in SAME_SELECTION},
    }


def _without_counts(document: dict[str, Any]) -> str:
    """A shard's reason without the counts verdict.py appends to it."""
    return str(document.get("reason")).removesuffix("; " + verdict_mod.summary(document["counts"]))


def merge(given: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One document's `verdict`, `exit_code`, `reason` and own keys from the shards' documents,
    (REPORT path, document) each; UsageError where they are not the shards of one audit, each
    rank once."""
    paths = [path for path, _ in given]
    seen: set[str] = set()
    for path in paths:
        if os.path.realpath(path) in seen:
            raise UsageError(f"REPORT {path} given twice")
        seen.add(os.path.realpath(path))
    first = _key(given[0][1])
    for path, document in given[1:]:
        other = _key(document)
        differ = [key for key in first if first[key] != other[key]]
        if differ:
            said = "; ".join(f"{key} {first[key]!r} against {other[key]!r}" for key in differ)
            raise UsageError(f"REPORT {path} is not a shard of the same audit as {paths[0]}: {said}")
    ranks: dict[int, str] = {}
    for path, document in given:
        rank = int(document["selection"]["rank"])
        if rank in ranks:
            raise UsageError(f"REPORTS {ranks[rank]} and {path} are both rank {rank}")
        ranks[rank] = path
    documents = {path: document for path, document in given}
    world = int(first["world_size"])
    missing = [rank for rank in range(world) if rank not in ranks]
    rows = sorted((row for d in documents.values() for row in d.get("files") or []), key=lambda r: r["file"])
    failed = [  # each failed shard's reason, without its own counts: the merged counts follow
        f"rank {d['selection']['rank']}: {_without_counts(d)}"
        for d in documents.values()
        if d.get("exit_code") == verdicts.ERROR
    ]
    counts = {s: sum(int(d["counts"][s]) for d in documents.values()) for s in STATUSES}
    verdict, code, reason = verdict_mod.verdict(counts, rows, None, "; ".join(failed) or None)
    if missing and code in (verdicts.OK, verdicts.INCOMPLETE):
        verdict, code = UNKNOWN, verdicts.INCOMPLETE
        reason = f"ranks {missing} of {world} missing; {reason}"
    checks = {(d.get("check") or {}).get("verdict") for d in documents.values() if d.get("check")}
    if code == verdicts.OK and checks - {PASS}:
        verdict, code, reason = (
            UNKNOWN,
            verdicts.INCOMPLETE,
            f"a shard's check says {checks}; {reason}",
        )
    sample, total = first["sample"], int(first["files_in_data"])
    selection = {key: first[key] for key in SAME_SELECTION} | {
        "ranks": sorted(ranks),
        "missing_ranks": missing,
    }
    notes = sorted({note for d in documents.values() for note in d.get("notes") or []})
    return dict(
        verdict=verdict,
        exit_code=code,
        reason=reason,
        data=documents[paths[0]].get("data"),
        dataset=documents[paths[0]].get("dataset"),
        model=first["model"],
        ids=first["ids"],
        notes=notes,
        selection=selection,
        estimate=None if missing else verdict_mod.estimate(counts, total, sample, int(first["seed"] or 0)),
        shards=[
            {
                "report": path,
                "rank": documents[path]["selection"]["rank"],
                "verdict": documents[path].get("verdict"),
                "exit_code": documents[path].get("exit_code"),
                "check": (documents[path].get("check") or {}).get("verdict"),
            }
            for path in sorted(paths, key=lambda p: documents[p]["selection"]["rank"])
        ],
        counts=counts,
        per_id=merged_per_id([d.get("per_id") or [] for d in documents.values()]),
        files_listed="every file"
        if all(d.get("files_listed") == "every file" for d in documents.values())
        else "wrong and n/a",
        files=rows,
    )
