"""One forward's checks, in two halves: `record` in each rank (count, shapes, finiteness, the
fingerprints of the states and of the taps, as small CPU tensors), and `judge_step` in the command,
over every rank's record of that forward (ranks agree, each rank's checks, the per-id comparison).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_hotfix.check import reference
from vllm_hotfix.check.reference import K, project, projection
from vllm_hotfix.judging.precision import CHECK_TOLERANCE_32BIT, check_tolerance, relative_difference
from vllm_hotfix.runtime.errors import one_line


@dataclass
class StepCheck:
    """What one forward showed, on one rank and on every rank of its tensor-parallel group."""

    tokens: int
    count_ok: bool
    count_detail: str
    finite_ok: bool = True
    ranks_rel_diff: float = 0.0  # the largest relative disagreement with the first rank, over ids and tokens
    ranks_worst_id: int | None = None
    tolerance: float = CHECK_TOLERANCE_32BIT
    failed_ranks: list[int] = field(default_factory=list)  # ranks whose own checks failed
    errors: list[dict[str, Any]] = field(default_factory=list)  # {"rank", "stage", "message"}
    missing_note: str | None = None  # why the ranks' records cannot be combined (missing, mismatch)
    per_id: list[dict[str, Any]] = field(default_factory=list)  # reference.judge_ids: SCHEMA "per_id"
    checked: int | None = None  # the tokens compared, the step's first ones (None: all `tokens`)

    @property
    def ranks_agree(self) -> bool:
        return self.ranks_rel_diff <= self.tolerance

    @property
    def failed(self) -> bool:
        """A real failure, seen in what the ranks that completed the step recorded."""
        failed_ids = any(entry["status"] == "wrong" for entry in self.per_id)
        return bool(self.failed_ranks) or not self.ranks_agree or failed_ids

    @property
    def complete(self) -> bool:
        """Every rank recorded its part of this forward."""
        return not self.errors and self.missing_note is None

    @property
    def ok(self) -> bool:
        """Complete and not failed: what the harness's state runs (MiniMax-M3, V3.2) assert per step."""
        return self.complete and not self.failed


def shapes(
    states: list[Any], ids: Sequence[int], tokens: int, hidden_size: int
) -> tuple[bool, str, list[bool]]:
    """The count and shape check: one [>= tokens, hidden] state per requested id."""
    import torch

    wanted = len(ids)
    shaped = [
        isinstance(s, torch.Tensor) and s.dim() == 2 and s.shape[0] >= tokens and s.shape[1] == hidden_size
        for s in states
    ]
    if len(states) != wanted:
        return False, f"{len(states)} state(s) for {wanted} id(s)", shaped
    if not all(shaped):
        bad = [tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__ for s in states]
        return False, f"shapes {bad}, expected [>={tokens}, {hidden_size}] each", shaped
    return True, "ok", shaped


def fingerprints(
    states: list[Any], shaped: list[bool], wanted: int, tokens: int, proj: Any
) -> tuple[Any, Any, Any]:
    """Each state projected on the K directions in float32 ([ids, tokens, K]; NaN where a state is
    missing or malformed; `reference.project`, a bounded float32 chunk at a time), each row's norm
    in fingerprint units ([ids, tokens]: the `scale` of precision.relative_difference), and whether
    every row is finite."""
    import torch

    prints = torch.full((wanted, tokens, K), float("nan"), device=proj.device)
    scales = torch.full((wanted, tokens), float("nan"), device=proj.device)
    finite = torch.ones((), dtype=torch.bool, device=proj.device)
    unit = (K / proj.shape[0]) ** 0.5
    for i, (state, good) in enumerate(zip(states[:wanted], shaped, strict=False)):
        if good:
            finite = finite & project(state[:tokens], proj, prints[i], scales[i])
            scales[i] *= unit
    return prints, scales, finite


def record(
    aux: Sequence[Any] | Any,
    hidden_states: Any,
    ids: Sequence[int],
    hidden_size: int,
    max_tokens: int,
    taps: Any = None,
) -> dict[str, Any]:
    """This rank's record of one forward: `aux`, what the model returned as aux states for `ids`;
    `hidden_states`, its output (its rows are the forward's tokens); a longer forward is recorded on
    its first `max_tokens` tokens. A stage that raises gives `error` {"stage", "message"}."""
    import torch

    tokens = int(hidden_states.shape[0]) if isinstance(hidden_states, torch.Tensor) else 0
    checked = min(tokens, max(int(max_tokens), 1))
    found: dict[str, Any] = {"tokens": tokens, "checked": checked, "rows": None, "count_ok": False}
    found.update(detail="not checked", tolerance=CHECK_TOLERANCE_32BIT)
    stage = "shapes"
    try:
        states = list(aux) if isinstance(aux, (list, tuple)) else []
        count_ok, detail, shaped = shapes(states, ids, tokens, hidden_size)
        found.update(
            count_ok=count_ok, detail=detail, rows=int(states[0].shape[0]) if count_ok and states else None
        )
        first = states[0] if states and isinstance(states[0], torch.Tensor) else hidden_states
        found["tolerance"] = check_tolerance(first.dtype)
        stage = "projection"
        proj = projection(hidden_size, first.device)
        stage = "float32"
        prints, scales, finite = fingerprints(states, shaped, len(ids), checked, proj)
        stage = "taps"
        seen, tapped = reference.tap_prints(taps, ids, checked)
        found.update(finite=bool(finite), prints=prints.cpu(), scales=scales.cpu())
        found.update(tap_seen=seen.cpu(), tap_prints=tapped.cpu(), notes=reference.notes(taps, ids))
    except Exception as raised:
        found["error"] = {"stage": stage, "message": one_line(raised)}
    return found


def judge_step(
    records: Sequence[dict[str, Any] | None], ids: Sequence[int], own_rank: int, final_id: int | None
) -> StepCheck:
    """One forward judged from every tensor-parallel rank's record (None: that rank has none), as
    rank `own_rank` reports it; every rank's report judges the same data alike. Ranks whose check
    raised are errors (not failures); the others are compared with the first of them."""
    import torch

    mine = records[own_rank] or {}
    limit = float(mine.get("tolerance", CHECK_TOLERANCE_32BIT))
    step = StepCheck(
        int(mine.get("tokens", 0)), bool(mine.get("count_ok")), str(mine.get("detail", "not recorded"))
    )
    step.tolerance, step.checked = limit, mine.get("checked")
    step.errors = [
        {"rank": r, **found["error"]} for r, found in enumerate(records) if found and "error" in found
    ]
    good = [r for r, found in enumerate(records) if found and "error" not in found]
    missing = [r for r, found in enumerate(records) if found is None]
    sizes = sorted({(records[r]["tokens"], records[r]["checked"]) for r in good})  # type: ignore[index]
    if missing:
        step.missing_note = f"no record of this forward from rank(s) {missing}"
    elif len(sizes) > 1:
        step.missing_note = f"the ranks recorded forwards of different sizes {sizes}"
    if step.missing_note is not None:
        return step
    found = [each or {} for each in records]
    try:
        for r in good[1:]:
            scale = torch.maximum(found[r]["scales"], found[good[0]]["scales"])
            rel = relative_difference(found[r]["prints"], found[good[0]]["prints"], scale)
            rel = rel.nan_to_num(nan=0.0, posinf=float("inf"))  # [ids, tokens]; NaN where a state was missing
            if rel.numel():
                value, index = rel.max(dim=1).values.max(dim=0)
                if float(value) > step.ranks_rel_diff:
                    step.ranks_rel_diff, step.ranks_worst_id = float(value), ids[int(index)]
        step.failed_ranks = [r for r in good if not (found[r]["count_ok"] and found[r]["finite"])]
        if own_rank in good:
            step.finite_ok = mine["finite"]
        if not step.errors:
            notes = next((f["notes"] for f in found if any(f["notes"])), [None] * len(ids))
            prints, scales, seen, tapped = (
                torch.stack([f[key] for f in found]) for key in ("prints", "scales", "tap_seen", "tap_prints")
            )
            checked, rows = step.checked or 0, mine.get("rows")
            step.per_id = reference.judge_ids(
                ids, checked, prints, scales, seen, tapped, limit, notes, final_id, rows
            )
        return step
    except Exception as raised:
        error = {"rank": own_rank, "stage": "judge", "message": one_line(raised)}
        return StepCheck(
            step.tokens,
            step.count_ok,
            step.count_detail,
            tolerance=limit,
            errors=[error],
            checked=step.checked,
        )
