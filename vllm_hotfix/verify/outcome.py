"""The verdict of one `vllm-hotfix verify` run, from the ranks' combined reports (combine.py): pure,
no vLLM, no torch.

A run PASSes only when every worker process the engine arguments imply reported for this run,
every forward it recorded passed on every rank, and every requested id was compared with its
layer's stream on at least one forward (the report's `coverage`). Another run's records never
count; a missing rank, an error in a rank's record or an id not compared make the run UNKNOWN
(exit 2); a FAIL anywhere is a FAIL (exit 1), even if vLLM stopped afterwards (the bug's own crash).
Otherwise, when vLLM or the command failed and no FAIL was seen, the exit code is 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_hotfix import exit_codes

EXIT_PASS, EXIT_FAIL, EXIT_UNKNOWN = exit_codes.OK, exit_codes.WRONG, exit_codes.INCOMPLETE
EXIT_ERROR, EXIT_USAGE = exit_codes.ERROR, exit_codes.USAGE
PASS, FAIL, UNKNOWN = "PASS", "FAIL", "UNKNOWN"


@dataclass(frozen=True)
class World:
    """The worker processes that must report, as the engine arguments imply: every tensor rank of
    the last pipeline stage (of each data-parallel engine). The other stages' models return
    intermediate tensors, never aux states, so they record nothing to judge."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1

    @property
    def processes(self) -> int:
        return self.tensor_parallel * self.data_parallel

    def as_dict(self) -> dict[str, int]:
        return {
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "data_parallel": self.data_parallel,
            "processes": self.processes,
        }


@dataclass
class Outcome:
    verdict: str
    exit_code: int
    reason: str  # one line: why this verdict
    reports: list[dict[str, Any]]  # this run's reports, by rank
    ignored: int  # reports of other runs (stale files) left out
    problems: list[str] = field(default_factory=list)  # what keeps a PASS from being one
    error: str | None = None  # vLLM's or the command's error, one line


def _rank_name(report: dict[str, Any]) -> str:
    return f"rank {report.get('rank')} (pid {report.get('pid')})"


def _problems_of(report: dict[str, Any]) -> list[str]:
    """What in one report keeps the run from passing (empty: it passed in full)."""
    name = _rank_name(report)
    found = []
    coverage = report.get("coverage")
    missing = (coverage.get("not_compared") or []) if isinstance(coverage, dict) else []
    note = report.get("note")
    if report.get("verdict") != PASS:
        if not note and missing:
            note = "ids " + ", ".join(str(m.get("id")) for m in missing) + " not compared on any forward"
        found.append(f"{name}: {report.get('verdict')}" + (f" ({note})" if note else ""))
    elif not isinstance(coverage, dict) or (not coverage.get("ok") and not missing):
        found.append(f"{name}: its report does not say that every requested id was compared")
    if not report.get("note"):  # coverage is the reason: say why each id was not compared
        found += [f"{name}: id {m.get('id')} not compared on any forward: {m.get('why')}" for m in missing]
    return found


def judge(
    reports: list[dict[str, Any]], run_id: str, world: World, error: str | None = None, ignored: int = 0
) -> Outcome:
    """The run's verdict and exit code, from every report found and vLLM's error, if any;
    `ignored`: other runs' reports found beside them (never counted)."""
    ours = sorted(
        (r for r in reports if r.get("run_id") == run_id),
        key=lambda r: (
            r.get("data_parallel_rank") or 0,
            r.get("rank") or 0,
            str(r.get("host")),
            r.get("pid") or 0,
        ),
    )
    ignored += len(reports) - len(ours)
    failed = [r for r in ours if r.get("verdict") == FAIL]
    if failed:
        ranks = ", ".join(_rank_name(r) for r in failed)
        reason = f"a check failed on {ranks}" + (f"; then vLLM stopped: {error}" if error else "")
        return Outcome(FAIL, EXIT_FAIL, reason, ours, ignored, error=error)
    problems = []
    processes = {(r.get("host"), r.get("pid")) for r in ours}
    if len(processes) < world.processes:
        problems.append(
            f"{len(processes)} of the {world.processes} worker process(es) that"
            f" {world.tensor_parallel} tensor x {world.data_parallel} data parallel imply (the last"
            f" of {world.pipeline_parallel} pipeline stage(s)) reported"
        )
    seen = {r.get("rank") for r in ours}
    missing = [rank for rank in range(world.tensor_parallel) if rank not in seen]
    if ours and missing:
        problems.append(f"no report from tensor-parallel rank(s) {missing}")
    for report in ours:
        if report.get("world") not in (None, world.tensor_parallel):
            problems.append(
                f"{_rank_name(report)}: a tensor-parallel group of {report.get('world')},"
                f" not {world.tensor_parallel}"
            )
        problems += _problems_of(report)
    if error is not None:
        return Outcome(UNKNOWN, EXIT_ERROR, error, ours, ignored, problems, error)
    if not ours:
        reason = "no worker recorded a forward of this run" + (
            f" ({ignored} report(s) of other runs ignored)" if ignored else ""
        )
        return Outcome(UNKNOWN, EXIT_UNKNOWN, reason, ours, ignored, problems)
    if problems:
        return Outcome(UNKNOWN, EXIT_UNKNOWN, problems[0], ours, ignored, problems)
    reason = f"every forward of the {world.processes} worker process(es) was checked and passed"
    return Outcome(PASS, EXIT_PASS, reason, ours, ignored, problems)


def coverage_text(coverage: dict[str, Any]) -> str:
    """`all 3 ids compared`, or `1 of 3 ids compared; not compared: 2, 4` (the line's part)."""
    done, total = len(coverage["compared"]), coverage["ids"]
    if not coverage["not_compared"]:
        return f"all {total} ids compared"
    missing = ", ".join(str(entry["id"]) for entry in coverage["not_compared"])
    return f"{done} of {total} ids compared; not compared: {missing} (per-id says why)"


def coverage(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every report of the run: `ok` when each says every requested id was compared on at
    least one of its checked steps; `not_compared`: per id, the ranks that did not and why."""
    missing: dict[Any, dict[str, Any]] = {}
    ok = bool(reports)
    for report in reports:
        found = report.get("coverage")
        if not isinstance(found, dict):
            ok = False
            continue
        ok = ok and bool(found.get("ok"))
        for entry in found.get("not_compared") or []:
            key = entry.get("id")
            row = missing.setdefault(key, {"id": key, "ranks": [], "why": entry.get("why")})
            row["ranks"].append(report.get("rank"))
    return {"ok": ok, "not_compared": list(missing.values())}


def per_id(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per requested id over every rank: the worst status and the largest figure (empty when the
    workers' reports carry no per-id figures)."""
    order = {FAIL: 2, "n/a": 1, "ok": 0}
    merged: dict[int, dict[str, Any]] = {}
    for report in reports:
        for entry in report.get("per_id") or []:
            key = entry.get("id")
            row = merged.setdefault(
                key,
                {
                    "id": key,
                    "status": "ok",
                    "max_rel_diff": None,
                    "tolerance": entry.get("tolerance"),
                    "reference": entry.get("reference"),
                    "why": None,
                    "ranks": {},
                },
            )
            status = entry.get("status", "n/a")
            row["ranks"][str(report.get("rank"))] = status
            if order.get(status, 1) > order.get(row["status"], 1):
                row["status"], row["why"] = status, entry.get("why")
            figure = entry.get("max_rel_diff")
            if figure is not None and (row["max_rel_diff"] is None or figure > row["max_rel_diff"]):
                row["max_rel_diff"] = figure
    return list(merged.values())
