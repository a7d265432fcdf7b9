"""The ranks' records of one run combined after it, one report per rank, and the run's verdict.

Forward n of every tensor-parallel rank is judged together (checks.judge_step). PASS only when
every worker the engine arguments imply reported and passed and every id was compared; a FAIL
anywhere is a FAIL; a missing rank or an error is UNKNOWN; another run's records never count.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

from vllm_hotfix import exit_codes
from vllm_hotfix.verify import checks as checks_mod
from vllm_hotfix.verify.checks import StepCheck

PASS, FAIL, UNKNOWN = "PASS", "FAIL", "UNKNOWN"  # a run's verdicts
COMPARED = ("ok", "wrong")  # an id's statuses when it was compared (else n/a)
RANK_KEYS = {
    "rank": "tp",
    "world": "tp_world",
    "pipeline_rank": "pp",
    "data_parallel_rank": "dp",
}  # report: facts


def read_run(report_dir: str, run_id: str) -> tuple[list[dict[str, Any]], int]:
    """Every rank's report of run `run_id` in `report_dir`, and how many other runs' were left there."""
    others = [p for p in glob.glob(os.path.join(report_dir, "*", "")) if os.path.basename(p[:-1]) != run_id]
    ranks = []
    for path in sorted(glob.glob(os.path.join(report_dir, run_id, "*", "facts.json"))):
        try:
            with open(path, encoding="utf-8") as handle:
                facts = json.load(handle)
        except (OSError, ValueError):
            continue
        if isinstance(facts, dict) and facts.get("run_id") == run_id:
            ranks.append(facts | {"_dir": os.path.dirname(path)})
    return combine(ranks), len(others)


def _records(directory: str) -> list[dict[str, Any]]:
    import torch

    found = []
    for path in sorted(glob.glob(os.path.join(directory, "step-*.pt"))):
        try:
            found.append(torch.load(path, weights_only=True))
        except Exception as error:
            message = f"unreadable {os.path.basename(path)}: {error}"
            found.append({"error": {"stage": "record", "message": message}})
    return found


def combine(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One report per rank from every rank's facts (`_dir`: where its records are). An earlier
    pipeline stage's model returns no aux states: only the last stage's ranks are judged."""
    groups: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for facts in ranks:
        if int(facts.get("pp", 0)) == int(facts.get("pp_world", 1)) - 1:
            groups.setdefault((facts.get("dp", 0), facts.get("pp", 0)), {})[int(facts.get("tp", 0))] = facts
    reports = []
    for _, members in sorted(groups.items()):
        world = max(int(f.get("tp_world", 1)) for f in members.values())
        records = {rank: _records(f["_dir"]) for rank, f in members.items()}
        longest = max((len(found) for found in records.values()), default=0)
        for rank, facts in sorted(members.items()):
            ids, checks = list(facts.get("ids") or []), []
            for n in range(longest):
                step = [records[r][n] if r in records and n < len(records[r]) else None for r in range(world)]
                checks.append(checks_mod.judge_step(step, ids, rank, facts.get("final_id")))
            reports.append(summary(facts, checks))
    return reports


def _over_forwards(checks: list[StepCheck], position: int, layer_id: int) -> dict[str, Any]:
    """An id over the forwards: wrong if one failed it, else ok if one compared it (the entry with
    the largest difference), else n/a (the first forward's why); `forwards` counts the forwards
    that judged it and those on which it was not compared, `gaps` names the forward sizes (tokens)
    on none of whose forwards it was compared."""
    steps = [(c.tokens, c.per_id[position]) for c in checks if len(c.per_id) > position]
    if not steps:
        return {"id": layer_id, "status": "n/a", "max_rel_diff": None, "tolerance": None, "reference": ""} | {
            "why": "no forward compared it",
            "forwards": {"checked": 0, "not_compared": 0},
            "gaps": [],
        }
    entries = [e for _, e in steps]
    compared = [e for e in entries if e["status"] == "wrong"] or [e for e in entries if e["status"] == "ok"]
    found = dict(max(compared, key=lambda e: float(e["max_rel_diff"] or 0.0)) if compared else entries[0])
    skipped = [e for e in entries if e["status"] not in COMPARED]
    sizes = {tokens for tokens, _ in steps}
    seen = {tokens for tokens, e in steps if e["status"] in COMPARED}
    found["forwards"] = {"checked": len(steps), "not_compared": len(skipped)}
    found["gaps"] = sorted(sizes - seen) if seen else []
    if skipped and compared:
        found["why"] = found.get("why") or skipped[0].get("why")
    return found


def summary(facts: dict[str, Any], checks: list[StepCheck]) -> dict[str, Any]:
    """One rank's report (docs/usage.md lists its keys)."""
    ids = list(facts.get("ids") or [])
    entries = [_over_forwards(checks, position, layer_id) for position, layer_id in enumerate(ids)]
    compared = [e["id"] for e in entries if e["status"] in COMPARED]
    missing = [{"id": e["id"], "why": e["why"]} for e in entries if e["status"] not in COMPARED]
    # an id compared on some forwards but on no forward of some size: that size is unproven for it
    missing += [
        {"id": e["id"], "why": e.get("why"), "tokens": e["gaps"]}
        for e in entries
        if e["status"] in COMPARED and e["gaps"]
    ]
    partly = [
        {"id": e["id"], **e["forwards"], "why": e.get("why")}
        for e in entries
        if e["status"] in COMPARED and not e["gaps"] and e["forwards"]["not_compared"]
    ]
    coverage = {
        "ok": bool(checks) and not missing,
        "ids": len(ids),
        "compared": compared,
        "not_compared": missing,
        "partly_compared": partly,
    }
    count_bad = next((c for c in checks if not c.count_ok), None)
    errors = [error for check in checks for error in check.errors]
    incomplete = next((c.missing_note for c in checks if c.missing_note), None)
    verdict = PASS if checks and all(c.complete for c in checks) and coverage["ok"] else UNKNOWN
    if any(c.failed and c.missing_note is None for c in checks):
        verdict = FAIL  # a real failure, seen in what the ranks that recorded the forward wrote
    said = "; ".join(f"rank {e['rank']} at {e['stage']}: {e['message']}" for e in errors[:3]) or incomplete
    note = f"the check could not complete: {said}" if said else None
    if not checks:
        note = "no forward with aux states was recorded"
    worst = max(checks, key=lambda c: c.ranks_rel_diff) if checks else None
    return {
        "verdict": verdict,
        **{key: facts.get(key) for key in ("run_id", "pid", "host")},
        **{name: facts.get(key) for name, key in RANK_KEYS.items()},
        **{key: facts.get(key) for key in ("model", "model_class")},
        "ids": ids,
        **{key: facts.get(key) for key in ("vllm_version", "compilation")},
        "steps": len(checks),
        "tokens": [c.tokens for c in checks],
        # the tokens compared per forward: its first ones, at most VLLMHOTFIX_VERIFY_TOKENS
        "checked_tokens": [c.tokens if c.checked is None else c.checked for c in checks],
        "count": {"ok": count_bad is None, "detail": count_bad.count_detail if count_bad else "ok"},
        "ranks_agree": {
            "ok": all(c.ranks_agree for c in checks),
            "max_rel_diff": worst.ranks_rel_diff if worst else None,
            "worst_id": worst.ranks_worst_id if worst else None,
            "tolerance": checks[0].tolerance if checks else None,
        },
        "finite": {"ok": all(c.finite_ok for c in checks)},
        "failed_ranks": sorted({r for c in checks for r in c.failed_ranks}),
        "per_id": entries,
        "coverage": coverage,
        "errors": errors,
        "note": note,
        "hint": facts.get("hint") if verdict == FAIL else None,
        "inductor_order": facts.get("inductor_order"),
    }


@dataclasses.dataclass(frozen=True)
class World:
    """The worker processes that must report, as the engine arguments imply: every tensor rank of
    the last pipeline stage (of each data-parallel engine); the other stages record nothing."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1

    @property
    def processes(self) -> int:
        return self.tensor_parallel * self.data_parallel

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self) | {"processes": self.processes}


@dataclasses.dataclass
class Outcome:
    verdict: str
    exit_code: int
    reason: str  # one line: why this verdict
    reports: list[dict[str, Any]]  # this run's reports, by rank
    ignored: int  # reports of other runs (stale files) left out
    problems: list[str] = dataclasses.field(default_factory=list)  # what keeps a PASS from being one
    error: str | None = None  # vLLM's or the command's error, one line


def _name(report: dict[str, Any]) -> str:
    return f"rank {report.get('rank')} (pid {report.get('pid')})"


def _problems_of(report: dict[str, Any]) -> list[str]:
    """What in one report keeps the run from passing (empty: it passed in full)."""
    name = _name(report)
    found = []
    coverage = report.get("coverage")
    missing = (coverage.get("not_compared") or []) if isinstance(coverage, dict) else []
    note = report.get("note")
    sizes = [f" of {m['tokens']} tokens" if m.get("tokens") else "" for m in missing]
    said = [f"id {m.get('id')} not compared on any forward{n}" for m, n in zip(missing, sizes, strict=True)]
    if report.get("verdict") != PASS:
        if not note and missing:
            note = "; ".join(said)
        found.append(f"{name}: {report.get('verdict')}" + (f" ({note})" if note else ""))
    elif not isinstance(coverage, dict) or (not coverage.get("ok") and not missing):
        found.append(f"{name}: its report does not say that every requested id was compared")
    if not report.get("note"):  # coverage is the reason: say why each id was not compared
        found += [f"{name}: {what}: {m.get('why')}" for m, what in zip(missing, said, strict=True)]
    return found


def judge(
    reports: list[dict[str, Any]], run_id: str, world: World, error: str | None = None, ignored: int = 0
) -> Outcome:
    """The run's verdict and exit code, from every report found and vLLM's error, if any;
    `ignored`: other runs' reports found beside them (never counted)."""
    ours = [r for r in reports if r.get("run_id") == run_id]
    ours.sort(
        key=lambda r: (
            r.get("data_parallel_rank") or 0,
            r.get("rank") or 0,
            str(r.get("host")),
            r.get("pid") or 0,
        )
    )
    ignored += len(reports) - len(ours)
    failed = [_name(r) for r in ours if r.get("verdict") == FAIL]
    if failed:
        reason = f"a check failed on {', '.join(failed)}" + (f"; then vLLM stopped: {error}" if error else "")
        return Outcome(FAIL, exit_codes.WRONG, reason, ours, ignored, error=error)
    problems = []
    processes = {(r.get("host"), r.get("pid")) for r in ours}
    if len(processes) < world.processes and (ours or error is None):  # else vLLM's error says why
        problems.append(
            f"{len(processes)} of the {world.processes} worker process(es) that"
            f" {world.tensor_parallel} tensor x {world.data_parallel} data parallel imply (the last"
            f" of {world.pipeline_parallel} pipeline stage(s)) reported"
        )
    missing = sorted(set(range(world.tensor_parallel)) - {r.get("rank") for r in ours})
    if ours and missing:
        problems.append(f"no report from tensor-parallel rank(s) {missing}")
    for r in ours:
        if r.get("world") not in (None, world.tensor_parallel):
            problems.append(
                f"{_name(r)}: a tensor-parallel group of {r.get('world')}, not {world.tensor_parallel}"
            )
        problems += _problems_of(r)
    if error is not None:
        return Outcome(UNKNOWN, exit_codes.ERROR, error, ours, ignored, problems, error)
    if not ours:
        reason = "no worker recorded a forward of this run"
        reason += f" ({ignored} report(s) of other runs ignored)" if ignored else ""
        return Outcome(UNKNOWN, exit_codes.INCOMPLETE, reason, ours, ignored, problems)
    if problems:
        return Outcome(UNKNOWN, exit_codes.INCOMPLETE, problems[0], ours, ignored, problems)
    reason = f"every forward of the {world.processes} worker process(es) was checked and passed"
    partly = {
        (p["id"], p["not_compared"], p["checked"], p["why"])
        for r in ours
        for p in (r.get("coverage") or {}).get("partly_compared") or []
    }
    if partly:
        counted = "; ".join(
            f"id {i} on {n} of {of} forwards ({why})" for i, n, of, why in sorted(partly, key=repr)
        )
        reason = f"every forward checked passed; not every id was compared on every forward: {counted}"
    return Outcome(PASS, exit_codes.OK, reason, ours, ignored, problems)


def coverage(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every report of the run: `ok` when each says every requested id was compared on at
    least one checked forward of every size; `not_compared`: per id, the ranks that did not and why;
    `partly_compared`: per id, the ranks that skipped it on some forwards, how many, and why."""
    missing: dict[Any, dict[str, Any]] = {}
    partly: dict[Any, dict[str, Any]] = {}
    ok = bool(reports)
    for report in reports:
        found = report.get("coverage")
        ok = ok and isinstance(found, dict) and bool(found.get("ok"))
        for key, rows in (("not_compared", missing), ("partly_compared", partly)):
            for entry in (found.get(key) or []) if isinstance(found, dict) else []:
                row = rows.setdefault(entry.get("id"), {**entry, "ranks": []})
                row["ranks"].append(report.get("rank"))
    return {"ok": ok, "not_compared": list(missing.values()), "partly_compared": list(partly.values())}


def per_id(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per requested id over every rank: the worst status and the largest figure (empty when the
    workers' reports carry no per-id figures)."""
    order = {"wrong": 2, "n/a": 1, "ok": 0}
    merged: dict[int, dict[str, Any]] = {}
    for report in reports:
        for entry in report.get("per_id") or []:
            first = {key: entry.get(key) for key in ("id", "tolerance", "reference")}
            row = merged.setdefault(
                entry.get("id"), first | {"status": "ok", "max_rel_diff": None, "why": None, "ranks": {}}
            )
            status, figure = entry.get("status", "n/a"), entry.get("max_rel_diff")
            row["ranks"][str(report.get("rank"))] = status
            if order.get(status, 1) > order.get(row["status"], 1):
                row["status"], row["why"] = status, entry.get("why")
            if figure is not None and (row["max_rel_diff"] is None or figure > row["max_rel_diff"]):
                row["max_rel_diff"] = figure
    return list(merged.values())
