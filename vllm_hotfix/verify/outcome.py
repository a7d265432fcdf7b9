"""The ranks' records of one `vllm-hotfix verify` run combined after the run, and its verdict.

Each process of the engine wrote, under `<report dir>/<run id>/`, a directory with its facts and
one record per forward (hook.py). The tensor-parallel ranks of one pipeline stage and data-parallel
engine ran the same forwards in the same order, so forward n of every rank is judged together
(checks.judge_step), and each rank's report says PASS (every forward passed and every requested id
was compared on at least one), FAIL or UNKNOWN. The run PASSes only when every worker process the
engine arguments imply reported for this run and each report passed; another run's records never
count; a missing rank, an error in a record or an id not compared make it UNKNOWN (exit 2); a FAIL
anywhere is a FAIL (exit 1), even if vLLM stopped afterwards (the bug's own crash). Otherwise,
when vLLM or the command failed, the exit code is 3.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, cast

from vllm_hotfix import exit_codes
from vllm_hotfix.verify import checks as checks_mod
from vllm_hotfix.verify.checks import StepCheck

EXIT_PASS, EXIT_FAIL, EXIT_UNKNOWN = exit_codes.OK, exit_codes.WRONG, exit_codes.INCOMPLETE
EXIT_ERROR, EXIT_USAGE = exit_codes.ERROR, exit_codes.USAGE
PASS, FAIL, UNKNOWN = "PASS", "FAIL", "UNKNOWN"


def read_run(report_dir: str, run_id: str) -> tuple[list[dict[str, Any]], int]:
    """Every rank's report of run `run_id` in `report_dir`, and how many other runs' were left there."""
    others = [
        path
        for path in glob.glob(os.path.join(report_dir, "*"))
        if os.path.isdir(path) and os.path.basename(path) != run_id
    ]
    ranks = []
    for path in sorted(glob.glob(os.path.join(report_dir, run_id, "*", "facts.json"))):
        try:
            with open(path, encoding="utf-8") as handle:
                facts = json.load(handle)
        except (OSError, ValueError):
            continue
        if isinstance(facts, dict) and facts.get("run_id") == run_id:
            facts["_dir"] = os.path.dirname(path)
            ranks.append(facts)
    return combine(ranks), len(others)


def _records(directory: str) -> list[dict[str, Any]]:
    import torch

    found = []
    for path in sorted(glob.glob(os.path.join(directory, "step-*.pt"))):
        try:
            found.append(torch.load(path, weights_only=True))
        except Exception as error:
            found.append(
                {"error": {"stage": "record", "message": f"unreadable {os.path.basename(path)}: {error}"}}
            )
    return found


def combine(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One report per rank from every rank's facts (`_dir`: where its records are)."""
    groups: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for facts in ranks:
        if int(facts.get("pp", 0)) != int(facts.get("pp_world", 1)) - 1:
            continue  # an earlier pipeline stage: its model returns no aux states
        groups.setdefault((facts.get("dp", 0), facts.get("pp", 0)), {})[int(facts.get("tp", 0))] = facts
    reports = []
    for (_dp, _pp), members in sorted(groups.items()):
        world = max(int(f.get("tp_world", 1)) for f in members.values())
        records = {rank: _records(f["_dir"]) for rank, f in members.items()}
        longest = max((len(found) for found in records.values()), default=0)
        for rank, facts in sorted(members.items()):
            ids = list(facts.get("ids") or [])
            checks = []
            for n in range(longest):
                step = [records[r][n] if r in records and n < len(records[r]) else None for r in range(world)]
                checks.append(checks_mod.judge_step(step, ids, rank, facts.get("final_id")))
            reports.append(summary(facts, checks))
    return reports


def rank_verdict(checks: list[StepCheck], covered: bool) -> str:
    if any(c.failed and c.missing_note is None for c in checks):
        return FAIL  # a real failure, seen in what the ranks that recorded the forward wrote
    if not checks or any(not c.complete for c in checks) or not covered:
        return UNKNOWN
    return PASS


def per_id_over_forwards(checks: list[StepCheck], ids: list[int]) -> list[dict[str, Any]]:
    """Per id over the forwards: FAIL if one failed it (its largest difference), else ok if one
    compared it (the largest difference), else n/a (the first forward's why)."""
    out = []
    for position, layer_id in enumerate(ids):
        steps = [c.per_id[position] for c in checks if len(c.per_id) > position]
        if not steps:
            out.append(
                {"id": layer_id, "status": "n/a", "max_rel_diff": None, "tolerance": None}
                | {"reference": "", "why": "no forward compared it"}
            )
            continue
        compared = [e for e in steps if e["status"] == "FAIL"] or [e for e in steps if e["status"] == "ok"]
        out.append(
            dict(
                max(compared, key=lambda e: float(cast(float, e["max_rel_diff"]) or 0.0))
                if compared
                else steps[0]
            )
        )
    return out


def summary(facts: dict[str, Any], checks: list[StepCheck]) -> dict[str, Any]:
    """One rank's report (docs/usage.md lists its keys)."""
    ids = list(facts.get("ids") or [])
    entries = per_id_over_forwards(checks, ids)
    missing = [{"id": e["id"], "why": e["why"]} for e in entries if e["status"] not in ("ok", "FAIL")]
    coverage = {
        "ok": bool(checks) and not missing,
        "ids": len(ids),
        "compared": [e["id"] for e in entries if e["status"] in ("ok", "FAIL")],
        "not_compared": missing,
    }
    count_bad = next((c for c in checks if not c.count_ok), None)
    final = [c for c in checks if c.final_ok is not None]
    errors = [error for check in checks for error in check.errors]
    incomplete = next((c.missing_note for c in checks if c.missing_note), None)
    found = rank_verdict(checks, bool(coverage["ok"]))
    note = None
    if errors:
        note = "the check could not complete: " + "; ".join(
            f"rank {e['rank']} at {e['stage']}: {e['message']}" for e in errors[:3]
        )
    elif incomplete:
        note = f"the check could not complete: {incomplete}"
    elif not checks:
        note = "no forward with aux states was recorded"
    return {
        "verdict": found,
        "run_id": facts.get("run_id"),
        "pid": facts.get("pid"),
        "host": facts.get("host"),
        "rank": facts.get("tp"),
        "world": facts.get("tp_world"),
        "pipeline_rank": facts.get("pp"),
        "data_parallel_rank": facts.get("dp"),
        "model": facts.get("model"),
        "model_class": facts.get("model_class"),
        "ids": ids,
        "vllm_version": facts.get("vllm_version"),
        "compilation": facts.get("compilation"),
        "steps": len(checks),
        "tokens": [c.tokens for c in checks],
        # the tokens compared per forward: its first ones, at most VLLMHOTFIX_VERIFY_TOKENS
        "checked_tokens": [c.tokens if c.checked is None else c.checked for c in checks],
        "count": {"ok": count_bad is None, "detail": count_bad.count_detail if count_bad else "ok"},
        "ranks_agree": {
            "ok": all(c.ranks_agree for c in checks),
            "max_rel_diff": max((c.ranks_rel_diff for c in checks), default=None),
            "worst_id": max(checks, key=lambda c: c.ranks_rel_diff).ranks_worst_id if checks else None,
            "tolerance": checks[0].tolerance if checks else None,
        },
        "finite": {"ok": all(c.finite_ok for c in checks)},
        "final": {
            "ok": None if not final else all(c.final_ok for c in final),
            "max_rel_diff": max((c.final_rel_diff or 0.0 for c in final), default=None),
            "note": next((c.final_error for c in checks if c.final_error), facts.get("final_note")),
        },
        "failed_ranks": sorted({r for c in checks for r in c.failed_ranks}),
        "per_id": entries,
        "coverage": coverage,
        "errors": errors,
        "note": note,
        "hint": facts.get("hint") if found == FAIL else None,
        "inductor_order": facts.get("inductor_order"),
    }


def _inherits(fix: Any, model_class: type | None) -> bool:
    """The model class runs the fix's method as inherited, not overridden: vLLM's shared capture
    helper (EagleModelMixin._maybe_add_hidden_state) in Llama's, Qwen's, gpt-oss's backbone."""
    if model_class is None or not getattr(fix, "owner", None):
        return False
    for klass in getattr(model_class, "__mro__", ()):
        if fix.attribute in vars(klass):
            return bool(klass.__module__ == fix.module and klass.__name__ == fix.owner)
    return False


def hint(model_module: str, records: dict[str, Any], fixes: Any, model_class: type | None = None) -> str:
    """What to do after a FAIL: the fix that covers the model's module (or a method the model's class
    inherits, `model_class`: the class that holds the aux ids), or how to report it."""
    report = (
        "please report it to the vllm-hotfix maintainers with this output and that of"
        " `vllm-hotfix status --json`"
    )
    for fix in fixes:
        if fix.module != model_module and not _inherits(fix, model_class):
            continue
        record = records.get(fix.fix_id)
        decision = getattr(getattr(record, "decision", None), "value", "pending")
        if decision == "patched":
            return f"fix {fix.fix_id} is applied here and the states are still wrong: not covered; {report}"
        return (
            f"fix {fix.fix_id} covers {model_module} and its decision here is {decision!r}: see"
            f" `vllm-hotfix status` (VLLMHOTFIX_DISABLE, VLLMHOTFIX_FORCE); otherwise {report}"
        )
    return f"not covered by any vllm-hotfix fix: {report}"


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
