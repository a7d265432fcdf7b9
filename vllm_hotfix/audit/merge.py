"""`vllm-hotfix audit-merge REPORT...`: the `--json` documents of one audit's shards (`--world-size W
--rank R`, one per rank) as one verdict and one estimate, by the rule of a single run (verdict.py).

Shards are one audit only when they list the same dataset (the sha256 of its files' relative
paths), model, ids and selection (sample, seed, --max-tokens, world size): anything else is
refused (exit 4). A rank missing leaves the verdict incomplete (exit 2) unless a file is wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vllm_hotfix.audit import verdict as verdict_mod
from vllm_hotfix.commands import output
from vllm_hotfix.commands.output import Parser, UsageError, exit_usage
from vllm_hotfix.judging import exit_codes
from vllm_hotfix.runtime.errors import one_line

SCHEMA = output.SCHEMAS["audit"]  # 3: counts and per_id over the files; the files worth naming
SAME = ("model", "ids", "precision")  # top-level keys every shard must share (precision: --tolerance)
SAME_SELECTION = ("sample", "seed", "max_tokens", "world_size", "files_in_data")


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError) as error:
        raise UsageError(f"REPORT {path}: not readable as JSON ({error})") from None
    if not isinstance(document, dict) or document.get("command") != "audit" or "selection" not in document:
        raise UsageError(f"REPORT {path}: not the --json document of a vllm-hotfix audit shard")
    if document.get("schema") != SCHEMA:
        raise UsageError(
            f"REPORT {path}: schema {document.get('schema')}, not {SCHEMA}: made by another"
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


def merge(given: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One document from the shards' documents, (REPORT path, document) each; UsageError where
    they are not the shards of one audit, each rank once."""
    paths = [path for path, _ in given]
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
    failed = [
        f"rank {d['selection']['rank']}: {d.get('reason')}"
        for d in documents.values()
        if d.get("exit_code") == exit_codes.ERROR
    ]
    counts = {s: sum(int(d["counts"][s]) for d in documents.values()) for s in verdict_mod.STATUSES}
    verdict, code, reason = verdict_mod.verdict(counts, rows, None, "; ".join(failed) or None)
    if missing and code in (exit_codes.OK, exit_codes.INCOMPLETE):
        verdict, code = verdict_mod.UNKNOWN, exit_codes.INCOMPLETE
        reason = f"ranks {missing} of {world} missing; {reason}"
    checks = {(d.get("check") or {}).get("verdict") for d in documents.values() if d.get("check")}
    if code == exit_codes.OK and checks - {verdict_mod.PASS}:
        verdict, code, reason = (
            verdict_mod.UNKNOWN,
            exit_codes.INCOMPLETE,
            f"a shard's check says {checks}; {reason}",
        )
    sample, total = first["sample"], int(first["files_in_data"])
    selection = {key: first[key] for key in SAME_SELECTION} | {
        "ranks": sorted(ranks),
        "missing_ranks": missing,
    }
    notes = sorted({note for d in documents.values() for note in d.get("notes") or []})
    return output.document(
        "audit-merge",
        code,
        reason,
        verdict=verdict,
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
        per_id=_per_id([d.get("per_id") or [] for d in documents.values()]),
        files_listed="every file"
        if all(d.get("files_listed") == "every file" for d in documents.values())
        else "wrong and n/a",
        files=rows,
    )


def _per_id(shards: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The shards' per-id summaries as one: counts summed, the largest difference and its file,
    the most tokens over the tolerance of an ok file."""
    merged: dict[int, dict[str, Any]] = {}
    for entries in shards:
        for entry in entries:
            if entry["id"] not in merged:
                merged[entry["id"]] = dict(entry)
                continue
            held = merged[entry["id"]]
            for key in (*verdict_mod.STATUSES, "files_with_tokens_over"):
                held[key] += entry[key]
            figure = entry.get("max_rel_diff")
            if figure is not None and (held["max_rel_diff"] is None or figure > held["max_rel_diff"]):
                held["max_rel_diff"], held["worst_file"] = figure, entry.get("worst_file")
            most, theirs = held.get("most_tokens_over"), entry.get("most_tokens_over")
            if theirs is not None and (most is None or theirs["tokens"] > most["tokens"]):
                held["most_tokens_over"] = theirs
    return list(merged.values())


def run(args: argparse.Namespace) -> int:
    try:
        merged = merge([(path, _read(path)) for path in args.reports])
    except UsageError as error:
        exit_usage("vllm-hotfix audit-merge", str(error), Parser.json_requested)
    except Exception as error:  # a document of another form: the command's own failure, exit 3
        reason = f"the merge failed: {one_line(error)}"
        print(f"vllm-hotfix audit-merge: {reason}", file=sys.stderr)
        if args.json:
            print(json.dumps(verdict_mod.failure(args, reason, "audit-merge"), indent=2))
        return exit_codes.ERROR
    print(json.dumps(merged, indent=2) if args.json else "\n".join(verdict_mod.text_lines(merged)))
    sys.stdout.flush()
    code: int = merged["exit_code"]
    return code


def add_parser(commands: Any) -> None:
    merge_cmd = commands.add_parser(
        "audit-merge",
        help="combine the --json documents of an audit's shards (--world-size, --rank) into one verdict",
        description="Reads the --json documents of one audit's shards, refuses documents of different"
        " datasets, models, ids or selections, and prints one verdict and one estimate for the"
        " dataset. Exit codes as the audit's: 0 ok, 1 a file wrong, 2 not everything audited (a rank"
        " missing), 3 a shard failed, 4 usage error.",
    )
    merge_cmd.add_argument("reports", nargs="+", metavar="REPORT", help="a shard's --json document")
    merge_cmd.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout, nothing else"
    )
    merge_cmd.set_defaults(run=run)
