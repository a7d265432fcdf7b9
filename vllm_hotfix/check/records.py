"""The ranks' records of one run, judged as they arrive: forward n of every tensor-parallel rank
together (checks.judge_step), folded into one tally per rank (outcome.Tally). One forward's records
are held at a time, so the command's memory does not grow with the forwards; the audit also removes
each record once judged, so its report directory does not either (verify keeps them).

hook.py writes a rank's records as `step-000001.pt`, `step-000002.pt`, ... (each whole: written
aside, then renamed) beside its `facts.json`. Mid-run, a forward is judged once every rank of its
group has recorded it; at the end, whatever is left, a rank without a record of it named.
"""

from __future__ import annotations

import glob
import json
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from vllm_hotfix.check import checks as checks_mod
from vllm_hotfix.check import outcome

_STEP = re.compile(r"step-(\d+)\.pt$")


def step_path(directory: str, number: int) -> str:
    return os.path.join(directory, f"step-{number:06d}.pt")


def _numbers(directory: str) -> set[int]:
    found = (_STEP.search(name) for name in os.listdir(directory)) if os.path.isdir(directory) else ()
    return {int(match.group(1)) for match in found if match}


def _load(path: str) -> dict[str, Any]:
    import torch

    try:
        found: dict[str, Any] = torch.load(path, weights_only=True)
        return found
    except Exception as error:
        message = f"unreadable {os.path.basename(path)}: {error}"
        return {"error": {"stage": "record", "message": message}}


@dataclass
class _Group:
    """The tensor-parallel ranks of one data-parallel engine's last pipeline stage."""

    members: dict[int, dict[str, Any]] = field(default_factory=dict)  # tp rank -> its facts
    tallies: dict[int, outcome.Tally] = field(default_factory=dict)
    judged: int = 0  # forwards judged so far (records 1..judged)

    def consume(self, final: bool, remove: bool) -> None:
        world = max(int(f.get("tp_world", 1)) for f in self.members.values())
        directories = {rank: str(f["_dir"]) for rank, f in self.members.items()}
        numbers = {rank: _numbers(directories.get(rank, "")) for rank in range(world)}
        if final:
            last = max((max(found, default=0) for found in numbers.values()), default=0)
        else:  # every rank's records, with no gap, up to `last`
            last = self.judged
            while all(last + 1 in found for found in numbers.values()):
                last += 1
        for number in range(self.judged + 1, last + 1):
            paths = [
                step_path(directories[r], number) if number in numbers[r] else None for r in range(world)
            ]
            step = [_load(path) if path else None for path in paths]
            for rank, facts in self.members.items():
                ids = list(facts.get("ids") or [])
                check = checks_mod.judge_step(step, ids, rank, facts.get("final_id"))
                self.tallies.setdefault(rank, outcome.Tally(ids)).add(check)
            if remove:
                for path in paths:
                    if path:
                        os.remove(path)
        self.judged = max(self.judged, last)

    def reports(self) -> list[dict[str, Any]]:
        return [
            self.tallies.get(rank, outcome.Tally(list(facts.get("ids") or []))).report(facts)
            for rank, facts in sorted(self.members.items())
        ]


class RunRecords:
    """The records of run `run_id` in `report_dir`: `consume` judges what has arrived (the audit
    calls it after each batch), `consume(final=True)` the rest once the engine has stopped."""

    def __init__(self, report_dir: str, run_id: str, remove: bool = False) -> None:
        self.report_dir, self.run_id, self.remove = report_dir, run_id, remove
        self.groups: dict[tuple[int, int], _Group] = {}
        self.lock = threading.Lock()  # the watchdog's end may race the main thread's

    def consume(self, final: bool = False) -> None:
        with self.lock:
            self._read_facts()
            for group in self.groups.values():
                group.consume(final, self.remove)

    def _read_facts(self) -> None:
        """Every rank's facts (re-read: a rank adds its hint after its first forward). An earlier
        pipeline stage's model returns no aux states: only the last stage's ranks are judged."""
        for path in sorted(glob.glob(os.path.join(self.report_dir, self.run_id, "*", "facts.json"))):
            try:
                with open(path, encoding="utf-8") as handle:
                    facts = json.load(handle)
            except (OSError, ValueError):
                continue
            if not isinstance(facts, dict) or facts.get("run_id") != self.run_id:
                continue
            if int(facts.get("pp", 0)) == int(facts.get("pp_world", 1)) - 1:
                group = self.groups.setdefault((facts.get("dp", 0), facts.get("pp", 0)), _Group())
                group.members[int(facts.get("tp", 0))] = facts | {"_dir": os.path.dirname(path)}

    def reports(self) -> list[dict[str, Any]]:
        with self.lock:
            return [report for _, group in sorted(self.groups.items()) for report in group.reports()]

    def other_runs(self) -> int:
        """Other runs' directories in `report_dir` (never counted)."""
        found = glob.glob(os.path.join(self.report_dir, "*", ""))
        return sum(os.path.basename(p[:-1]) != self.run_id for p in found)
