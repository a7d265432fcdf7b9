"""The ranks' records of one run combined, after the run: one report per rank, judged alike.

Each process of the engine wrote, under `<report dir>/<run id>/`, a directory with its facts and one
record per forward (hook.py). The tensor-parallel ranks of one pipeline stage and data-parallel
engine ran the same forwards in the same order, so forward n of every rank is judged together
(checks.judge_step): count, finiteness, the final id, ranks agree and the per-id comparison. A rank
whose record of a forward is missing or failed makes that forward incomplete. Each rank's report
then says PASS (every forward passed and every requested id was compared on at least one), FAIL, or
UNKNOWN (outcome.py gives the run's verdict from them). Directories of other runs never count.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, cast

from vllm_hotfix.verify.checks import StepCheck

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
            message = f"unreadable {os.path.basename(path)}: {error}"
            found.append({"error": {"stage": "record", "message": message}})
    return found


def combine(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One report per rank from every rank's facts (`_dir`: where its records are)."""
    from vllm_hotfix.verify.checks import judge_step

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
                checks.append(judge_step(step, ids, rank, facts.get("final_id")))
            reports.append(summary(facts, checks))
    return reports


def verdict(checks: list[StepCheck], covered: bool) -> str:
    if any(c.failed and c.missing_note is None for c in checks):
        return FAIL  # a real failure, seen in what the ranks that recorded the forward wrote
    if not checks or any(not c.complete for c in checks) or not covered:
        return UNKNOWN
    return PASS


def per_id(checks: list[StepCheck], ids: list[int]) -> list[dict[str, Any]]:
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
    entries = per_id(checks, ids)
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
    found = verdict(checks, bool(coverage["ok"]))
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
