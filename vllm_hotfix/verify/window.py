"""The checked steps of one process together: the verdict, the one log line, the JSON report.

A verdict is PASS (every checked step passed every check, on every rank, and every requested id
was compared with its layer's stream on at least one of them), FAIL (a check failed on some rank
at some step; the window ends there, on every rank at once), or UNKNOWN (not everything asked
could be checked: the seam was not recognised, or no step carried aux states; the check could not
complete on some rank: its error, an exchange past its deadline, ranks armed differently, and the
window then ends there, the note saying which rank and why; or some id was `n/a` on every checked
step, and `coverage` names it and why).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from vllm_hotfix.verify import inductor_order
from vllm_hotfix.verify import settings as verify_settings
from vllm_hotfix.verify.checks import StepCheck
from vllm_hotfix.verify.outcome import coverage_text

PASS, FAIL, UNKNOWN, SKIPPED = "PASS", "FAIL", "UNKNOWN", "SKIPPED"


@dataclass
class Context:
    """What the process checks: fixed at its first step."""

    model: str
    model_class: str  # the module that holds the aux layer ids, e.g. deepseek_v2.DeepseekV2Model
    model_module: str
    ids: list[int]
    rank: int
    world: int
    seam: str
    final_note: str  # how the final id is checked, or why it is not
    vllm_version: str | None = None


@dataclass
class Window:
    """The first `wanted` steps that carry aux states, or fewer if a check fails first."""

    wanted: int
    context: Context | None = None
    checks: list[StepCheck] = field(default_factory=list)
    note: str | None = None  # why nothing was checked (UNKNOWN or SKIPPED), or an error
    hint: str | None = None
    removed: bool = False  # the wrapper was taken out of the runner after the window
    taps_after_window: str | None = None  # taps.REMOVED, RETURNING or NO_TAPS, once the window ends
    stops_run: bool = False  # strict mode raises VerifyError into vLLM after this report
    capture_paused: bool = False  # vLLM captured CUDA graphs here with the taps paused (seam.py)
    eager_steps: int = 0  # checked steps vLLM dispatched with force_eager: no CUDA-graph replay

    def add(self, check: StepCheck) -> bool:
        """Record a step; True when the window is over (enough steps, a failure, or a step that
        could not complete)."""
        self.checks.append(check)
        if not check.complete and self.note is None:
            self.note = incomplete_note(check)
        return not check.ok or len(self.checks) >= self.wanted

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [error for check in self.checks for error in check.errors]

    @property
    def exchange_note(self) -> str | None:
        return next((c.exchange_note for c in self.checks if c.exchange_note), None)

    @property
    def verdict(self) -> str:
        if any(c.failed and c.exchange_note is None for c in self.checks):
            return FAIL  # a real failure, seen in what the ranks that completed the step sent
        if any(not c.complete for c in self.checks):
            return UNKNOWN
        if (
            self.note is not None
            and self.note.startswith("error")
            and self.checks
            and all(c.ok for c in self.checks)
        ):
            return UNKNOWN  # the window did not finish: its passing steps prove less than asked
        if self.note is not None and not self.checks:
            return SKIPPED if self.note.startswith("skipped") else UNKNOWN
        if not self.checks:
            return UNKNOWN
        if not all(check.ok for check in self.checks):
            return FAIL
        return PASS if self.coverage()["ok"] else UNKNOWN  # an id never compared proves nothing

    def coverage(self, entries: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Which requested ids were compared with their layer's stream (`ok` or `FAIL`) on at least
        one checked step; `ok` only when all were (the condition of a PASS). `entries`: the
        window's `per_id`, when the caller has it already."""
        ids = self.context.ids if self.context else []
        entries = per_id(self.checks, ids) if entries is None else entries
        missing = [{"id": e["id"], "why": e["why"]} for e in entries if e["status"] not in ("ok", "FAIL")]
        return {
            "ok": bool(self.checks) and not missing,
            "ids": len(ids),
            "compared": [e["id"] for e in entries if e["status"] in ("ok", "FAIL")],
            "not_compared": missing,
        }

    def summary(self) -> dict[str, Any]:
        checks = self.checks
        ctx = self.context
        count_bad = next((c for c in checks if not c.count_ok), None)
        final = [c for c in checks if c.final_ok is not None]
        failed_ranks = sorted({r for c in checks for r in c.failed_ranks})
        entries = per_id(checks, ctx.ids if ctx else [])
        return {
            "verdict": self.verdict,
            "run_id": verify_settings.read().run_id,  # the `vllm-hotfix verify` run, if one started us
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "rank": ctx.rank if ctx else None,
            "world": ctx.world if ctx else None,
            "model": ctx.model if ctx else None,
            "model_class": ctx.model_class if ctx else None,
            "ids": ctx.ids if ctx else None,
            "vllm_version": ctx.vllm_version if ctx else None,
            "seam": ctx.seam if ctx else None,
            "steps": len(checks),
            "steps_wanted": self.wanted,
            "tokens": [c.tokens for c in checks],
            # the tokens compared per step: its first ones, at most VLLMHOTFIX_VERIFY_TOKENS
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
                "note": next(
                    (c.final_error for c in checks if c.final_error), ctx.final_note if ctx else None
                ),
            },
            "failed_ranks": failed_ranks,
            "per_id": entries,
            "coverage": self.coverage(entries),
            "errors": self.errors,
            "exchange": {"ok": self.exchange_note is None, "note": self.exchange_note},
            "note": self.note,
            "hint": self.hint,
            "removed_after_window": self.removed,
            "taps_after_window": self.taps_after_window,
            "inductor_order": dict(inductor_order.outcome) or None,
            "stops_run": self.stops_run,
            "cuda_graphs": {"capture_paused": self.capture_paused, "eager_steps": self.eager_steps},
        }

    def line(self) -> str:
        s = self.summary()
        head = f"vllm-hotfix verify pid={s['pid']}"
        why = f" ({self.note})" if self.note else ""
        if self.context is None:  # nothing reached a model step (or a harness made the window)
            return f"{head} verdict={s['verdict']}{why}"
        ctx = self.context
        ids = "[" + ",".join(map(str, ctx.ids)) + "]"
        parts = [head, f"rank={ctx.rank}/{ctx.world}", f"model={ctx.model}", f"ids={ids}"]
        if not self.checks:
            parts.append(f"verdict={s['verdict']}{why}")
            return " ".join(parts)
        if s["verdict"] == UNKNOWN and not all(c.complete for c in self.checks):
            parts += [f"steps={s['steps']}", f"verdict={s['verdict']}{why}"]
            return " ".join(parts)
        agree = s["ranks_agree"]
        where = f" at id {agree['worst_id']}" if not agree["ok"] and agree["worst_id"] is not None else ""
        final = s["final"]
        if final["ok"] is None:
            errors = [c.final_error for c in self.checks if c.final_error]
            final_text = f"n/a ({errors[0] if errors else ctx.final_note})"
        else:
            final_text = f"{'ok' if final['ok'] else 'FAIL'} (max rel diff {final['max_rel_diff']:.3g})"
        cut = [(c.checked, c.tokens) for c in self.checks if c.checked is not None and c.checked < c.tokens]
        parts.append(f"steps={s['steps']}")
        if cut:  # never a PASS that reads as if every token had been compared
            parts.append(
                f"compared-first-tokens={sum(c for c, _ in cut)}/{sum(t for _, t in cut)}"
                f" in {len(cut)} long step(s) ({verify_settings.TOKENS_VAR})"
            )
        parts += [
            f"count={'ok' if s['count']['ok'] else 'FAIL (' + s['count']['detail'] + ')'}",
            f"ranks-agree={'ok' if agree['ok'] else 'no'} (max rel diff {agree['max_rel_diff']:.3g}{where};"
            f" tolerance {agree['tolerance']:.0e})",
            f"finite={'ok' if s['finite']['ok'] else 'FAIL'}",
            f"final={final_text}",
            "per-id=[" + ", ".join(_id_text(entry) for entry in s["per_id"]) + "]",
        ]
        if s["failed_ranks"]:
            parts.append("failed-on-ranks=[" + ",".join(map(str, s["failed_ranks"])) + "]")
        parts.append("coverage=" + coverage_text(s["coverage"]))
        parts.append(f"verdict={s['verdict']}")
        text = " ".join(parts)
        if self.hint:
            text += f". {self.hint}"
        return text

    def write_report(self, directory: str) -> str:
        """One JSON file per process, named by host and pid; written atomically."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"verify-{socket.gethostname()}-{os.getpid()}.json")
        temporary = f"{path}.tmp"
        with open(temporary, "w", encoding="utf-8") as out:
            json.dump(self.summary(), out, indent=2)
        os.replace(temporary, path)
        return path


def per_id(checks: list[StepCheck], ids: list[int]) -> list[dict[str, Any]]:
    """SCHEMA "per_id" over the window: FAIL if some step failed the id (its largest difference),
    else ok if some step compared it (the largest difference), else n/a (the first step's why)."""
    out = []
    for position, layer_id in enumerate(ids):
        steps = [c.per_id[position] for c in checks if len(c.per_id) > position]
        if not steps:
            out.append(
                {
                    "id": layer_id,
                    "status": "n/a",
                    "max_rel_diff": None,
                    "tolerance": None,
                    "reference": "",
                    "why": "no step compared it",
                }
            )
            continue
        failed = [e for e in steps if e["status"] == "FAIL"]
        compared = failed or [e for e in steps if e["status"] == "ok"]
        if not compared:
            out.append(dict(steps[0]))
            continue
        worst = max(compared, key=lambda e: e["max_rel_diff"] or 0.0)
        out.append(dict(worst))
    return out


def _id_text(entry: dict[str, Any]) -> str:
    if entry["status"] == "ok":
        return f"{entry['id']}:ok"
    if entry["status"] == "FAIL":
        return f"{entry['id']}:FAIL ({entry['max_rel_diff']:.3g})"
    return f"{entry['id']}:n/a ({entry['why']})"


def incomplete_note(check: StepCheck) -> str:
    """Why a step could not complete, naming the rank(s) and the stage."""
    if check.errors:
        said = "; ".join(f"rank {e['rank']} at {e['stage']}: {e['message']}" for e in check.errors)
        return f"the check could not complete: {said}"
    return f"the check could not complete: {check.exchange_note}"


def _inherits(fix: Any, model_class: type | None) -> bool:
    """The model class runs the fix's method as inherited, not overridden: vLLM's shared capture
    helper (EagleModelMixin._maybe_add_hidden_state) in Llama's, Qwen's, gpt-oss's backbone."""
    if model_class is None or not getattr(fix, "owner", None):
        return False
    for klass in getattr(model_class, "__mro__", ()):
        if fix.attribute in vars(klass):
            return klass.__module__ == fix.module and klass.__name__ == fix.owner
    return False


def hint(model_module: str, records: dict[str, Any], fixes: Any, model_class: type | None = None) -> str:
    """What to do after a FAIL: the fix that covers the model's module (or a method the model's class
    inherits, `model_class`: the class that holds the aux ids), or how to report it."""
    report = (
        "please report it to the vllm-hotfix maintainers with this line and the output of"
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
