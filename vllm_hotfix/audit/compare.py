"""One file's stored states against the states recomputed for its tokens, per id and per token.

Per token, the relative difference is precision.relative_difference (||stored - recomputed||
over the larger of the two rows' norms: a zero row against a real one reads 1, never infinity); an
id is `ok` when its tokens are within the file's rule (judging/precision.py: the tolerance of the coarser
of the stored and the engine's precision, and the tokens a MoE model may have over it). A stored
state that is not finite is `wrong`; a recomputed one that is not finite is the run's error, never
`ok`. A `wrong` id gets the likely cause where the difference has a shape: zeros, a scaled state,
another requested id's state (an alias), a neighbouring layer's state (an id off by one), or wrong
on some tokens only (a padding row's overwrite touches one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_hotfix.judging import precision
from vllm_hotfix.judging.precision import relative_difference


def stored_precision(stored: Any) -> str:
    """The precision `stored` holds its values at: its dtype's, or a coarser one where every value
    is exact in it (float32 files of a bfloat16 engine's states, upcast when saved, hold bfloat16
    values and are judged as such)."""
    import torch

    name = precision.precision_of(stored.dtype)
    if name == "float32":
        for coarse in (torch.bfloat16, torch.float16):
            if torch.equal(stored, stored.to(coarse).to(stored.dtype)):
                return precision.precision_of(coarse)
    return name


def _within(stored: Any, reference: Any, tolerance: float) -> bool:
    return bool((relative_difference(stored, reference) <= tolerance).all())


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


def judge_file(
    stored: Any, ids: Sequence[int], references: Mapping[int, Any], rule: precision.Rule
) -> list[dict[str, Any]]:
    """One entry per id of the file: `stored` [tokens, ids, hidden] as read from the file (any
    floating dtype, fp8 too), `references` the recomputed [tokens, hidden] state per layer id (the
    file's ids, and the neighbours the audit asked for too). An id whose reference is not finite
    is `n/a` with `error` set: the run failed there, and the file is not judged on it."""
    import torch

    states = stored.to(torch.float32)
    recomputed = {k: v.to(torch.float32) for k, v in references.items()}
    tokens = states.shape[0]
    entries = []
    for column, layer_id in enumerate(ids):
        mine = states[:, column]
        entry: dict[str, Any] = {"id": layer_id, "tolerance": rule.tolerance, "tokens": tokens}
        broken = ~torch.isfinite(recomputed[layer_id]).all(dim=-1)
        if bool(broken.any()):
            said = f"{int(broken.sum())} of {tokens} tokens (first {int(broken.nonzero()[0, 0])})"
            entries.append(
                entry
                | {"status": "n/a", "max_rel_diff": None, "error": True}
                | {"why": f"the recomputed reference is not finite on {said}: an error of the run"}
            )
            continue
        rel = relative_difference(mine, recomputed[layer_id])
        not_finite = ~torch.isfinite(mine).all(dim=-1)
        over = (rel > rule.tolerance) | not_finite
        count = int(over.sum())
        wrong = bool(not_finite.any()) or count > rule.allowed_tokens
        entry |= {
            "status": "wrong" if wrong else "ok",
            "max_rel_diff": float(rel.nan_to_num(nan=float("inf")).max()) if tokens else 0.0,
            "tokens_over": count,
            "allowed_tokens": rule.allowed_tokens,
        }
        if wrong:
            entry["wrong_tokens"] = count
            entry["first_wrong_token"] = int(over.nonzero()[0, 0])
            if bool(not_finite.any()):
                cause: str | None = (
                    f"not finite (NaN or infinity) on {int(not_finite.sum())} of {tokens} tokens"
                )
            else:
                cause = likely_cause(layer_id, mine, over, recomputed, rule.tolerance, ids)
                if count < tokens:
                    some = f"wrong on {count} of {tokens} tokens"
                    cause = f"{some}: {cause}" if cause else some
            entry["cause"] = cause
        elif count:
            entry["note"] = (
                f"{count} of {tokens} tokens over the tolerance, within the {rule.allowed_tokens}"
                " a MoE model's routing may move (judging/precision.py)"
            )
        entries.append(entry)
    return entries
