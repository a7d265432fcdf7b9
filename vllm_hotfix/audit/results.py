"""The audit's judged files, taken as the engine's worker writes them (worker.py: one small JSON
per file, removed once read): counts per status, a summary per id, and the rows worth naming (a file
wrong or n/a; every file with --list-every-file). The command's memory and the report directory
hold one batch of results at a time, whatever the dataset's size.
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm_hotfix.judging.verdicts import STATUSES, take_largest


def result_path(out: str, index: int) -> str:
    """Where the worker writes the result of the audited file number `index`."""
    return os.path.join(out, f"{index}.json")


class Results:
    """What the audit has judged so far, folded file by file."""

    def __init__(self, ids: list[int], list_every_file: bool = False) -> None:
        self.list_every_file = list_every_file
        self.counts = dict.fromkeys(STATUSES, 0)
        self.per_id: dict[int, dict[str, Any]] = {
            layer_id: {"id": layer_id, **dict.fromkeys(STATUSES, 0), "max_rel_diff": None, "worst_file": None}
            | {"files_with_tokens_over": 0, "most_tokens_over": None}
            for layer_id in ids
        }
        self.rows: list[dict[str, Any]] = []  # rows worth naming
        self.not_preflighted = {"files": 0, "tokens": 0}
        self.taken: set[int] = set()  # the audited files' numbers whose result is taken

    def add(self, row: dict[str, Any], index: int | None = None) -> None:
        """One file's row: counted, summarised per id, kept when it is worth naming."""
        if index is not None:
            self.taken.add(index)
        self.counts[row["status"]] += 1
        if row.get("not_preflighted_tokens"):
            self.not_preflighted["files"] += 1
            self.not_preflighted["tokens"] += int(row["not_preflighted_tokens"])
        for entry in row.get("per_id") or []:
            if entry.get("id") not in self.per_id:
                continue
            over = entry.get("tokens_over") if entry.get("status") == "ok" else None
            fold(
                self.per_id[entry["id"]],
                {
                    **dict.fromkeys(STATUSES, 0),
                    entry.get("status", "n/a"): 1,
                    "max_rel_diff": entry.get("max_rel_diff"),
                    "worst_file": row["file"],
                    "files_with_tokens_over": 1 if over else 0,
                    "most_tokens_over": {"tokens": over, "of": entry.get("tokens")} if over else None,
                },
            )
        if row["status"] != "ok" or self.list_every_file:
            self.rows.append(row)

    def take(self, out: str, index: int, row: dict[str, Any]) -> None:
        """The worker's result of file `index` into `row` (already holding what the command knows of
        the file), folded; its file removed. No result: no forward carried the file's tokens whole."""
        path = result_path(out, index)
        try:
            with open(path, encoding="utf-8") as handle:
                row.update(json.load(handle))
        except (OSError, ValueError):
            row["why"] = "not recomputed: no forward of the engine carried its tokens whole"
        else:
            os.remove(path)
        self.add(row, index)

    def per_id_summary(self) -> list[dict[str, Any]]:
        """Per id over the judged files: how many were ok, wrong, n/a on it; the largest difference
        and its file; the ok files with tokens over the tolerance (a MoE model's allowance)."""
        return [dict(summary) for summary in self.per_id.values()]


def fold(held: dict[str, Any], summary: dict[str, Any]) -> None:
    """One id's summary over some files into `held`, its summary over others: counts summed, the
    largest difference and its file kept, the most tokens over the tolerance of an ok file kept. A
    file's entry folds in as the summary of one file; a shard's summary as that of its files."""
    for key in (*STATUSES, "files_with_tokens_over"):
        held[key] += summary[key]
    take_largest(held, summary.get("max_rel_diff"), worst_file=summary.get("worst_file"))
    most, theirs = held.get("most_tokens_over"), summary.get("most_tokens_over")
    if theirs is not None and (most is None or theirs["tokens"] > most["tokens"]):
        held["most_tokens_over"] = theirs


def merged_per_id(shards: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The shards' per-id summaries as one (audit-merge), by the fold of a run's files."""
    merged: dict[int, dict[str, Any]] = {}
    for entries in shards:
        for entry in entries:
            if entry["id"] in merged:
                fold(merged[entry["id"]], entry)
            else:
                merged[entry["id"]] = dict(entry)
    return list(merged.values())
