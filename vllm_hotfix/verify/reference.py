"""Per id: the captured state against what the model's layer actually received (taps.py), judged.

Each rank puts into the step's one exchange, per requested id, a block of `block_size(capacity)`
floats (capacity: the rows the exchange's body holds per id, at least the checked tokens):
[calls since the last check, rows the tap saw, fingerprint of the layer's `hidden_states`
(capacity x K), fingerprint of its `residual` (capacity x K)], NaN beyond the checked tokens.
After the exchange every rank judges every rank's states the same way:

- the layer's `hidden_states` is a per-rank partial when the ranks' fingerprints of it differ by
  more than the tolerance (a replicated tensor is bit-identical on the ranks of a correct group;
  a row-parallel partial left for the next norm's fused all-reduce is not). The stream's
  fingerprint is then the sum of the ranks' (the projection is linear), plus the residual's;
  otherwise the rank's own two fingerprints summed;
- the id is `ok` when every rank's captured fingerprint is within the tolerance of that stream
  (per token: |difference| / |stream|), `FAIL` with the largest relative difference otherwise,
  and `n/a` with the reason when there is nothing to compare with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_hotfix.verify.checks import K, rel_rows

HEAD = 2  # calls, rows


def block_size(capacity: int) -> int:
    return HEAD + 2 * capacity * K


def blocks(taps: Any, ids: Sequence[int], tokens: int, device: Any, capacity: int | None = None) -> Any:
    """This rank's per-id blocks for its first `tokens` tokens, flattened ([len(ids) *
    block_size(capacity)] float32, on `device`); NaN blocks where there is no tap. Marks the taps'
    calls as seen."""
    import torch

    capacity = tokens if capacity is None else capacity
    out = torch.full((len(ids), block_size(capacity)), float("nan"), dtype=torch.float32, device=device)
    if taps is None:
        return out.flatten()
    calls = taps.meta[:, 0] - taps.seen
    rows = min(tokens, capacity, taps.max_tokens)
    for i, layer_id in enumerate(ids):
        site = taps.site(layer_id)
        if site is None:
            continue
        out[i, 0] = calls[site].float()
        out[i, 1] = taps.meta[site, 1].float()
        prints = out[i, HEAD:].view(2, capacity, K)
        prints[0, :rows] = taps.fp_hidden[site, :rows]
        prints[1, :rows] = taps.fp_residual[site, :rows]
    taps.seen.copy_(taps.meta[:, 0])
    return out.flatten()


def describe(layer_id: int, final_id: int | None, partial: bool, world: int) -> str:
    if layer_id == 0:
        what = "the embeddings entering layer 0"
    elif final_id is not None and layer_id == final_id:
        what = f"the final norm's input (the stream layer {layer_id - 1} returns)"
    else:
        what = f"the stream entering layer {layer_id}"
    return what + (
        f" (reduced: the sum of {world} ranks' partial hidden_states, plus residual)" if partial else ""
    )


def judge(
    ids: Sequence[int],
    tokens: int,
    prints: Any,
    tap_blocks: Any,
    tolerance: float,
    taps: Any,
    final_id: int | None,
    capacity: int | None = None,
) -> list[dict[str, Any]]:
    """One entry per id (SCHEMA "per_id"). `prints`: [world, ids, tokens, K] captured fingerprints
    of the checked tokens; `tap_blocks`: [world, ids, block_size(capacity)], both from the exchange
    (CPU)."""
    import torch

    world = prints.shape[0]
    capacity = tokens if capacity is None else capacity
    entries = []
    for i, layer_id in enumerate(ids):
        entry: dict[str, Any] = {
            "id": layer_id,
            "status": "n/a",
            "max_rel_diff": None,
            "tolerance": tolerance,
            "reference": describe(layer_id, final_id, False, world),
            "why": None,
        }
        entries.append(entry)
        site = taps.site(layer_id) if taps is not None else None
        why = _not_comparable(taps, site, layer_id, tokens, tap_blocks[:, i], prints[:, i])
        if why is not None:
            entry["why"] = why
            continue
        body = tap_blocks[:, i, HEAD:].reshape(world, 2, capacity, K)[:, :, :tokens]
        hidden, residual = body[:, 0], body[:, 1]
        partial = False
        if world > 1:
            spread = max(float(rel_rows(hidden[r], hidden[0]).max()) for r in range(1, world))
            partial = not spread <= tolerance
        stream = (hidden.sum(dim=0, keepdim=True) if partial else hidden) + residual
        rel = torch.stack([rel_rows(prints[r, i], stream[r]) for r in range(world)])
        worst = float(rel.max())
        entry["reference"] = describe(layer_id, final_id, partial, world)
        entry["max_rel_diff"] = worst
        if worst <= tolerance:
            entry["status"] = "ok"
        else:
            rank, token = divmod(int(torch.nan_to_num(rel, nan=float("inf")).flatten().argmax()), tokens)
            entry["status"] = "FAIL"
            entry["why"] = f"differs from {entry['reference']} by {worst:.3g} (rank {rank}, token {token})"
    return entries


def _not_comparable(
    taps: Any, site: int | None, layer_id: int, tokens: int, block: Any, prints: Any
) -> str | None:
    """Why there is nothing to compare id `layer_id` with, or None. `block`: [world, block_size]."""
    import torch

    if taps is None:
        return "no taps on this model (its decoder layers were not found at load, or not tapped)"
    if site is None:
        last = taps.start + taps.sites - 1
        return f"id {layer_id} is not tapped on this rank (its layers' boundaries {taps.start}..{last})"
    form = taps.form(site)
    if form is not None:
        return form
    if bool(torch.isnan(block[:, 0]).any()):
        return "a rank has no tap for this id"
    if bool((block[:, 0] < 1).any()):
        ranks = [r for r in range(block.shape[0]) if block[r, 0] < 1]
        return (
            f"the tap did not run in this step on rank(s) {ranks} (a compiled graph or CUDA graph"
            " made without the taps, e.g. served from a cache)"
        )
    short = [r for r in range(block.shape[0]) if block[r, 1] < tokens]
    if short:
        return f"the layer saw {int(block[short[0], 1])} rows for {tokens} tokens (sequence-parallel shards?)"
    if tokens > taps.max_tokens:
        return f"{tokens} tokens is more than the taps' buffers hold ({taps.max_tokens})"
    if bool(torch.isnan(prints).any()):
        return "a rank has no well-formed state for this id (see count)"
    return None
