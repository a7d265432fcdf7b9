"""How exact aux states must be, in one place for the pre-flight check and the audit: the one
relative-difference statistic both use, the check's tolerances, and the audit's precision model.

The statistic, per token: ||a - b|| over the larger of the two rows' norms (0 where they are equal,
1 for a zero row against a real one, never infinity). The check applies it to fingerprints (the
rows projected on a few fixed directions, check/reference.py), the audit to the states themselves.

The check's tolerance: CHECK_TOLERANCE_16BIT for 16-bit states (about five bfloat16 rounding steps;
a tensor-parallel group's states agree to a few rounding steps where kernels reduce in another
order), CHECK_TOLERANCE_32BIT for float32 (docs/verification.md has the figures).

The audit's precision model says how far a file's stored states may lie from the audit's
recomputation and still be right.

A file is judged at the coarser of its stored precision and the engine's: right data stored in
bfloat16 and audited on a float32 engine is as exact as bfloat16 allows, never more. A right stored
row differs from the audit's recomputed one by two things: the recomputation's own spread (another
tensor-parallel size, other prompts in the same forwards, other kernels), measured on the real
engine as SPREAD per engine precision, and the rounding of storage, at most the stored precision's
unit roundoff relative to the row's norm (each element is within that of its value; the
measurement's cast-alone figures confirm it). The tolerance on the per-token relative difference
(relative_difference) at a judged precision is its unit roundoff plus HEADROOM times the spread of the
coarsest engine precision it covers, rounded up to two significant digits, and never below the
pre-flight check's own tolerance for that precision (the check proves the reference to within it).

A MoE model's tokens may differ by more than that for numeric reasons (a routing flip: two
experts' scores within rounding of each other); the measurement says how many tokens of a file,
and each id of a MoE model's file may have up to `allowed_tokens` over the tolerance and still be
ok (the output says "k of T tokens"); a dense model's may have none.

The figures, their runs and the table: benchmarks/results/precision/audit_precision.json
(benchmarks/audit_precision.py), docs/verification.md ("The audit's precision model").
`--tolerance` replaces the rule: that tolerance for every file and id, no token allowed over.

No torch here: dtypes are named by their safetensors name (`BF16`), torch's (`torch.bfloat16`) or
the plain name (`bfloat16`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

CHECK_TOLERANCE_16BIT = 2e-2  # about five bfloat16 steps
CHECK_TOLERANCE_32BIT = 1e-4


def check_tolerance(dtype: object) -> float:
    """The pre-flight check's tolerance for states of `dtype`."""
    wide = str(dtype).removeprefix("torch.") in ("float32", "float64", "float", "double")
    return CHECK_TOLERANCE_32BIT if wide else CHECK_TOLERANCE_16BIT


def relative_difference(a: Any, b: Any, scale: Any = None) -> Any:
    """Per row (the last dimension): ||a - b|| over the larger of a's norm (or `scale`, a's norm
    known otherwise: a fingerprint's state's true norm) and b's; 0 where a equals b, never infinity;
    NaN (a missing or non-finite row) stays NaN. In float64: a float32 sum of squares overflows
    from about 1e19 per entry."""
    import torch

    difference = torch.linalg.vector_norm(a - b, dim=-1, dtype=torch.float64)
    own = torch.linalg.vector_norm(a, dim=-1, dtype=torch.float64) if scale is None else scale.double()
    larger = torch.maximum(own, torch.linalg.vector_norm(b, dim=-1, dtype=torch.float64))
    return torch.where(difference == 0, torch.zeros_like(difference), difference / larger).float()


PRECISIONS = ("float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2")  # finest first
_ALIASES = {
    "F64": "float32",  # finer than any engine's: judged at the engine's
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3",
    "F8_E5M2": "float8_e5m2",
    "float64": "float32",
    "double": "float32",
    "float": "float32",
    "half": "float16",
    "float8_e4m3fn": "float8_e4m3",
}

UNIT_ROUNDOFF = {  # half the distance between 1 and the next number: 2**-(mantissa bits + 1)
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8_e4m3": 2.0**-4,
    "float8_e5m2": 2.0**-3,
}
# The largest per-token relative difference measured between right recomputations of the same
# prompts, over a dense and a MoE model, TP=1 and 2, alone and in mixed batches, outside the MoE
# model's routing flips (benchmarks/results/precision/audit_precision.json): float32, the dense
# model at TP=1 against TP=2; bfloat16, the dense model made in bfloat16 and recomputed in float32.
# A float16 engine was not measured: bfloat16's spread (three fewer mantissa bits) stands for it.
SPREAD = {"float32": 8.6e-7, "bfloat16": 1.77e-2}
HEADROOM = 4.0  # for models deeper and wider than the measured ones: their spread grows with depth
# A MoE model's tokens over the tolerance, per file and id, where a 16-bit or coarser precision
# is involved (none were at float32): the measured largest fraction of a file's tokens times
# FLIP_HEADROOM, and at least MIN_ALLOWED_TOKENS.
MEASURED_FLIP_FRACTION = 0.076  # Qwen3-MoE: 11 of 145 tokens on one id (made bfloat16, engine float32)
FLIP_HEADROOM = 1.5
MOE_OVER_FRACTION = round(MEASURED_FLIP_FRACTION * FLIP_HEADROOM, 3)
MIN_ALLOWED_TOKENS = 1


def _round_up(value: float) -> float:
    """`value` rounded up to two significant digits."""
    scale = 10.0 ** (math.floor(math.log10(value)) - 1)
    return float(f"{math.ceil(value / scale - 1e-9) * scale:.2g}")


def _tolerance(judged: str) -> float:
    """Never below the pre-flight check's tolerance: the check proves the audit's reference to
    within it, and no finer."""
    spread = SPREAD["float32" if judged == "float32" else "bfloat16"]
    floor = CHECK_TOLERANCE_32BIT if judged == "float32" else CHECK_TOLERANCE_16BIT
    return max(floor, _round_up(UNIT_ROUNDOFF[judged] + HEADROOM * spread))


TOLERANCES = {name: _tolerance(name) for name in PRECISIONS}


def precision_of(dtype: object) -> str:
    """The precision a dtype stores at: one of PRECISIONS; ValueError for one the audit cannot
    judge (an integer type, an unknown name)."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in PRECISIONS:
        raise ValueError(
            f"dtype {dtype}: not a floating-point type the audit reads ({', '.join(PRECISIONS)})"
        )
    return name


def coarser(first: object, second: object) -> str:
    """The coarser of two dtypes' precisions: the one a file is judged at."""
    return max(precision_of(first), precision_of(second), key=PRECISIONS.index)


@dataclass(frozen=True)
class Rule:
    """How one file is judged: at which precision, the per-token tolerance, how many tokens of
    each id may lie over it, and where the figures come from."""

    stored: str
    engine: str
    judged_at: str
    tolerance: float
    allowed_tokens: int
    source: str  # "measured" (this module's rule) or "--tolerance"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def allowed_tokens(tokens: int, moe: bool, judged: str) -> int:
    """How many of a file's `tokens` may lie over the tolerance on one id for numeric reasons."""
    if not moe or judged == "float32":
        return 0
    return max(MIN_ALLOWED_TOKENS, math.ceil(MOE_OVER_FRACTION * tokens))


def rule(stored: object, engine: object, tokens: int, moe: bool, tolerance: float | None = None) -> Rule:
    """The rule for a file stored as `stored`, recomputed as `engine` (dtypes), of `tokens`
    tokens, on a MoE model or not; `tolerance` (the user's `--tolerance`) replaces the rule."""
    stored_name, engine_name = precision_of(stored), precision_of(engine)
    judged = coarser(stored_name, engine_name)
    if tolerance is not None:
        return Rule(stored_name, engine_name, judged, tolerance, 0, "--tolerance")
    return Rule(
        stored_name, engine_name, judged, TOLERANCES[judged], allowed_tokens(tokens, moe, judged), "measured"
    )


def for_the_run(tolerance: float | None) -> dict[str, Any]:
    """What the run's document records of the rule: the user's `--tolerance`, or the measured
    rule's figures (each file's `precision` then says which applied to it)."""
    if tolerance is not None:
        return {"source": "--tolerance", "tolerance": tolerance, "allowed_tokens": 0}
    return {
        "source": "measured",
        "tolerances": dict(TOLERANCES),
        "headroom": HEADROOM,
        "moe_over_fraction": MOE_OVER_FRACTION,
        "min_allowed_tokens_moe": MIN_ALLOWED_TOKENS,
    }
