"""One file's stored states against the states recomputed for its tokens, per id and per token.

Per token, the relative difference is ||stored - recomputed|| over the larger of the two rows'
norms (a zero row against a real one reads 1, never infinity); an id is `ok` when every token is
within the tolerance of the engine's dtype, the one the pre-flight check uses. A `wrong` id gets
the likely cause where the difference has a shape: zeros, a scaled state, another requested id's
state (an alias), a neighbouring layer's state (an id off by one), or wrong on some tokens only
(a padding row's overwrite touches one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def relative(stored: Any, reference: Any) -> Any:
    """Per token: ||stored - reference|| / max(||stored||, ||reference||), 0 where both are zero."""
    import torch

    scale = torch.maximum(stored.norm(dim=-1), reference.norm(dim=-1))
    difference = (stored - reference).norm(dim=-1)
    return torch.where(scale > 0, difference / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def _within(stored: Any, reference: Any, tolerance: float) -> bool:
    return bool((relative(stored, reference) <= tolerance).all())


def likely_cause(
    layer_id: int,
    stored: Any,
    wrong: Any,
    references: Mapping[int, Any],
    tolerance: float,
    ids: Sequence[int] = (),
) -> str | None:
    """What the wrong tokens of `stored` are, where the pattern shows it; None when it does not
    (for instance a tensor-parallel rank's partial sum). Another of the file's `ids` is tried
    before a neighbouring layer: an alias is the likelier slip."""
    rows = stored[wrong]
    if not bool(rows.any()):
        return "zeros"
    reference = references[layer_id][wrong]
    squared = float((reference * reference).sum())
    if squared > 0:
        factor = float((rows * reference).sum()) / squared
        if abs(factor - 1) > tolerance and _within(rows, factor * reference, tolerance):
            return f"scaled by {factor:.3g}"
    others = sorted(references, key=lambda other: (other not in ids, other))
    for other in others:
        if other != layer_id and _within(rows, references[other][wrong], tolerance):
            if other in ids:
                return f"an alias of id {other}"
            return f"the state of layer {other}, a neighbouring layer (an id off by one)"
    return None


def judge(
    stored: Any, ids: Sequence[int], references: Mapping[int, Any], tolerance: float
) -> list[dict[str, Any]]:
    """One entry per id of the file: `stored` [tokens, ids, hidden] as read from the file,
    `references` the recomputed [tokens, hidden] state per layer id (the file's ids, and the
    neighbours the audit asked for too)."""
    import torch

    states = stored.to(torch.float32)
    recomputed = {k: v.to(torch.float32) for k, v in references.items()}
    tokens = states.shape[0]
    entries = []
    for column, layer_id in enumerate(ids):
        mine = states[:, column]
        rel = relative(mine, recomputed[layer_id])
        wrong = rel > tolerance
        wrong |= ~torch.isfinite(mine).all(dim=-1)
        entry: dict[str, Any] = {
            "id": layer_id,
            "status": "wrong" if bool(wrong.any()) else "ok",
            "max_rel_diff": float(rel.nan_to_num(nan=float("inf")).max()) if tokens else 0.0,
            "tolerance": tolerance,
            "tokens": tokens,
            "wrong_tokens": int(wrong.sum()),
        }
        if entry["status"] == "wrong":
            entry["first_wrong_token"] = int(wrong.nonzero()[0, 0])
            cause = likely_cause(layer_id, mine, wrong, recomputed, tolerance, ids)
            if entry["wrong_tokens"] < tokens:
                some = f"wrong on {entry['wrong_tokens']} of {tokens} tokens"
                cause = f"{some}: {cause}" if cause else some
            entry["cause"] = cause
        entries.append(entry)
    return entries
