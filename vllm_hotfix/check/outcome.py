"""One report per rank, folded from its forwards' checks (records.py feeds them as they arrive),
and the run's verdict.

PASS only when every worker the engine arguments imply reported and passed and every id was
compared; a FAIL anywhere is a FAIL; a missing rank or an error is UNKNOWN; another run's records
never count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_hotfix.check.checks import StepCheck
from vllm_hotfix.judging import verdicts
from vllm_hotfix.judging.verdicts import COMPARED, FAIL, PASS, UNKNOWN

RANK_KEYS = {
    "rank": "tp",
    "world": "tp_world",
    "pipeline_rank": "pp",
    "data_parallel_rank": "dp",
}  # report: facts


class _IdTally:
    """One id over the forwards, folded: wrong if one failed it, else ok if one compared it (the
    entry with the largest difference), else n/a (the first forward's why); the forwards that
    judged it and those on which it was not compared; the forward sizes (tokens) seen and those on
    which it was compared (`gaps`: sizes on none of whose forwards it was)."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id
        self.first: dict[str, Any] | None = None
        self.worst: dict[str, dict[str, Any]] = {}  # status ("wrong", "ok") -> its largest entry
        self.checked = 0
        self.skipped = 0
        self.skipped_why: Any = None
        self.sizes: set[int] = set()
        self.seen: set[int] = set()

    def add(self, tokens: int, entry: dict[str, Any]) -> None:
        self.first = self.first or entry
        self.checked += 1
        self.sizes.add(tokens)
        status = entry["status"]
        if status in COMPARED:
            self.seen.add(tokens)
            held = self.worst.get(status)
            if held is None or float(entry["max_rel_diff"] or 0.0) > float(held["max_rel_diff"] or 0.0):
                self.worst[status] = entry
        else:
            self.skipped_why = self.skipped_why if self.skipped else entry.get("why")
            self.skipped += 1

    def report(self) -> dict[str, Any]:
        if self.first is None:
            return {"id": self.layer_id, "status": "n/a", "max_rel_diff": None, "tolerance": None} | {
                "reference": "",
                "why": "no forward compared it",
                "forwards": {"checked": 0, "not_compared": 0},
                "gaps": [],
            }
        compared = self.worst.get("wrong") or self.worst.get("ok")
        found = dict(compared or self.first)
        found["forwards"] = {"checked": self.checked, "not_compared": self.skipped}
        found["gaps"] = sorted(self.sizes - self.seen) if self.seen else []
        if self.skipped and compared:
            found["why"] = found.get("why") or self.skipped_why
        return found


class Tally:
    """One rank's forwards folded as they are judged (checks.judge_step, one forward at a time):
    what its report says, held in memory that grows with the ids and the distinct forward sizes,
    never with the number of forwards."""

    MAX_ERRORS = 20  # errors listed in a report; `errors_total` counts them all

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.per_id = [_IdTally(layer_id) for layer_id in ids]
        self.steps = 0
        self.tolerance: float | None = None  # the first forward's (its dtype's)
        self.tokens: dict[str, int] = {}  # total, smallest, largest: the forwards' sizes
        self.checked = {"total": 0, "cut_forwards": 0}  # cut: compared on their first tokens only
        self.count_detail: str | None = None  # the first forward whose count or shapes were wrong
        self.errors: list[dict[str, Any]] = []
        self.errors_total = 0
        self.incomplete: str | None = None
        self.complete = True
        self.failed = False
        self.worst: StepCheck | None = None  # the largest disagreement between ranks
        self.agree = True
        self.finite = True
        self.failed_ranks: set[int] = set()

    def add(self, check: StepCheck) -> None:
        self.steps += 1
        if self.tolerance is None:
            self.tolerance = check.tolerance
        size, tokens = check.tokens, self.tokens
        tokens["total"] = tokens.get("total", 0) + size
        tokens["smallest"] = min(tokens.get("smallest", size), size)
        tokens["largest"] = max(tokens.get("largest", size), size)
        compared = check.tokens if check.checked is None else check.checked
        self.checked["total"] += compared
        self.checked["cut_forwards"] += compared < check.tokens
        for position, layer in enumerate(self.per_id):
            if len(check.per_id) > position:
                layer.add(check.tokens, check.per_id[position])
        if not check.count_ok and self.count_detail is None:
            self.count_detail = check.count_detail
        self.errors += check.errors[: max(0, self.MAX_ERRORS - len(self.errors))]
        self.errors_total += len(check.errors)
        self.incomplete = self.incomplete or check.missing_note
        self.complete = self.complete and check.complete
        self.failed = self.failed or (check.failed and check.missing_note is None)
        if self.worst is None or check.ranks_rel_diff > self.worst.ranks_rel_diff:
            self.worst = check
        self.agree = self.agree and check.ranks_agree
        self.finite = self.finite and check.finite_ok
        self.failed_ranks.update(check.failed_ranks)

    def report(self, facts: dict[str, Any]) -> dict[str, Any]:
        """This rank's report (docs/usage.md lists its keys)."""
        entries = [layer.report() for layer in self.per_id]
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
            "ok": bool(self.steps) and not missing,
            "ids": len(self.ids),
            "compared": compared,
            "not_compared": missing,
            "partly_compared": partly,
        }
        verdict = PASS if self.steps and self.complete and coverage["ok"] else UNKNOWN
        if self.failed:
            verdict = FAIL  # a real failure, seen in what the ranks that recorded the forward wrote
        said = "; ".join(f"rank {e['rank']} at {e['stage']}: {e['message']}" for e in self.errors[:3])
        said = said or self.incomplete or ""
        note = f"the check could not complete: {said}" if said else None
        if not self.steps:
            note = "no forward with aux states was recorded"
        worst = self.worst
        return {
            "verdict": verdict,
            **{key: facts.get(key) for key in ("run_id", "pid", "host")},
            **{name: facts.get(key) for name, key in RANK_KEYS.items()},
            **{key: facts.get(key) for key in ("model", "model_class")},
            "ids": self.ids,
            **{key: facts.get(key) for key in ("vllm_version", "compilation")},
            "steps": self.steps,
            "tokens": {"total": 0, "smallest": None, "largest": None} | self.tokens,
            # the tokens compared: each forward's first ones, at most VLLMHOTFIX_VERIFY_TOKENS
            "checked_tokens": dict(self.checked),
            "count": {"ok": self.count_detail is None, "detail": self.count_detail or "ok"},
            "ranks_agree": {
                "ok": self.agree,
                "max_rel_diff": worst.ranks_rel_diff if worst else None,
                "worst_id": worst.ranks_worst_id if worst else None,
                "tolerance": self.tolerance,
            },
            "finite": {"ok": self.finite},
            "failed_ranks": sorted(self.failed_ranks),
            "per_id": entries,
            "coverage": coverage,
            "errors": self.errors,
            "errors_total": self.errors_total,
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


def verdict_of_run(
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
        return Outcome(FAIL, verdicts.WRONG, reason, ours, ignored, error=error)
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
        return Outcome(UNKNOWN, verdicts.ERROR, error, ours, ignored, problems, error)
    if not ours:
        reason = "no worker recorded a forward of this run"
        reason += f" ({ignored} report(s) of other runs ignored)" if ignored else ""
        return Outcome(UNKNOWN, verdicts.INCOMPLETE, reason, ours, ignored, problems)
    if problems:
        return Outcome(UNKNOWN, verdicts.INCOMPLETE, problems[0], ours, ignored, problems)
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
    return Outcome(PASS, verdicts.OK, reason, ours, ignored, problems)


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
            verdicts.take_largest(row, figure)
    return list(merged.values())
