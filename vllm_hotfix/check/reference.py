"""Per id: the captured state against what the model's layer actually received (taps.py), judged.

The comparison is of fingerprints (K fixed random directions, linear): where a layer received a
per-rank partial `hidden_states` (the ranks' fingerprints of it differ), the stream is the ranks'
sum plus the residual; sequence-parallel shards are compared row by row with the rank that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_hotfix.judging.precision import relative_difference

# Fingerprint: each token's state projected on K = 8 fixed random directions (N(0, 1/hidden)
# entries): a real difference orthogonal to all of them is negligibly likely. Each row is compared
# relative to its own norm in fingerprint units (`scale`, ||row|| * sqrt(K/hidden)): dividing by the
# fingerprint's norm, a chi variable, gave the ratio a heavy tail (about 1 token in 100k of correct
# bf16 states over 2e-2 at TP=8; tests/test_verify_statistic.py, docs/verification.md).
K = 8
SEED = 20260119

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


CHUNK_ROWS = 1024  # rows made float32 at once: 29 MiB at hidden 7168, whatever the step's tokens


def project(rows: Any, matrix: Any, out: Any, norms: Any = None) -> Any:
    """`rows @ matrix` into `out` in float32, CHUNK_ROWS rows at a time (never a float32 copy of a
    whole state), each row's norm into `norms` if given; whether every row is finite (a bool tensor)."""
    import torch

    finite = torch.ones((), dtype=torch.bool, device=out.device)
    for start in range(0, int(rows.shape[0]), CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS].float()
        torch.matmul(chunk, matrix, out=out[start : start + CHUNK_ROWS])
        if norms is not None:
            # in float64: a float32 sum of squares overflows from about 1e19 per entry
            norms[start : start + CHUNK_ROWS] = torch.linalg.vector_norm(chunk, dim=-1, dtype=torch.float64)
            finite = finite & torch.isfinite(chunk).all()
    return finite


def tap_prints(taps: Any, ids: Sequence[int], tokens: int) -> tuple[Any, Any]:
    """This rank's taps for its first `tokens` tokens: per id (calls since the last record, rows the
    tap saw) [ids, 2] and the fingerprints of the layer's hidden_states and residual [ids, 2,
    tokens, K], NaN where there is no tap. Marks the taps' calls as seen."""
    import torch

    device = taps.meta.device if taps is not None else "cpu"
    seen = torch.full((len(ids), 2), float("nan"), device=device)
    prints = torch.full((len(ids), 2, tokens, K), float("nan"), device=device)
    if taps is None:
        return seen, prints
    rows = min(tokens, taps.max_tokens)
    for i, layer_id in enumerate(ids):
        site = taps.rows.get(layer_id)
        if site is not None:
            seen[i, 0], seen[i, 1] = taps.meta[site, 0] - taps.seen[site], taps.meta[site, 1]
            prints[i, 0, :rows] = taps.fp_hidden[site, :rows]
            prints[i, 1, :rows] = taps.fp_residual[site, :rows]
    taps.seen.copy_(taps.meta[:, 0])
    return seen, prints


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


def judge_ids(
    ids: Sequence[int],
    tokens: int,
    prints: Any,
    scales: Any,
    seen: Any,
    tapped: Any,
    tolerance: float,
    notes: Sequence[str | None],
    final_id: int | None,
    rows: int | None = None,
) -> list[dict[str, Any]]:
    """One entry per id (SCHEMA "per_id"). `prints`: [world, ids, tokens, K] captured fingerprints
    of the checked tokens, `scales`: [world, ids, tokens] their rows' norms (checks.fingerprints);
    `seen` [world, ids, 2] and `tapped` [world, ids, 2, tokens, K]: the ranks' `tap_prints`;
    `notes`: per id why it cannot be compared, or None; `rows`: the rows of the forward (the
    captured states', padding included), which tells sequence-parallel shards from whole tensors."""
    import torch

    world = prints.shape[0]
    entries = []
    for i, layer_id in enumerate(ids):
        entry: dict[str, Any] = {
            "id": layer_id,
            "status": "n/a",
            "max_rel_diff": None,
            "tolerance": tolerance,
        }
        entry.update(reference=describe(layer_id, final_id, False, world), why=None)
        entries.append(entry)
        hidden, residual = tapped[:, i, 0], tapped[:, i, 1]
        chunk = _shard_rows(seen[:, i, 1], residual, scales[0, i], rows, tolerance)
        why = notes[i] or _not_comparable(tokens, seen[:, i], prints[:, i], chunk)
        if why is not None:
            entry["why"] = why
            continue
        partial = False
        if chunk is not None:  # sequence-parallel shards: token t is row t % chunk of rank t // chunk
            owner = [t // chunk for t in range(tokens)]
            row = [t % chunk for t in range(tokens)]
            stream = (hidden[owner, row] + residual[owner, row]).expand(world, tokens, K)
        else:
            partial = not _spread(hidden, scales[0, i]) <= tolerance
            stream = (hidden.sum(dim=0, keepdim=True) if partial else hidden) + residual
        rel = torch.stack([relative_difference(prints[r, i], stream[r], scales[r, i]) for r in range(world)])
        worst = float(rel.max())
        entry["reference"] = describe(layer_id, final_id, partial, world) + (
            f" (assembled from the {world} ranks' sequence-parallel shards of {chunk} rows)" if chunk else ""
        )
        entry["max_rel_diff"] = worst
        if worst <= tolerance:
            entry["status"] = "ok"
        else:
            rank, token = divmod(int(torch.nan_to_num(rel, nan=float("inf")).flatten().argmax()), tokens)
            entry["status"] = "wrong"
            entry["why"] = f"differs from {entry['reference']} by {worst:.3g} (rank {rank}, token {token})"
    return entries


def _shard_rows(seen: Any, residual: Any, scale: Any, rows: int | None, tolerance: float) -> int | None:
    """The rows of each rank's shard when the layer ran on sequence-parallel shards (vLLM's
    sequence-parallel MoE: the forward's `rows` padded to a multiple of the ranks, rank r holding
    rows r * chunk ...), else None. `seen`: [world] rows each tap saw. Shards hold different tokens,
    so their residuals differ between ranks; a whole residual (or a dual-batch-overlap micro-batch,
    which no rank shards) is the same on every rank."""
    import torch

    world = int(seen.shape[0])
    if world < 2 or rows is None or rows < 1 or bool(torch.isnan(seen).any()):
        return None
    chunk = -(-rows // world)
    if any(int(value) != chunk for value in seen.tolist()):
        return None
    first = min(chunk, int(residual.shape[1]))
    return chunk if first >= 1 and not _spread(residual[:, :first], scale[:first]) <= tolerance else None


def _spread(prints: Any, scale: Any) -> float:
    """The largest relative difference of any rank's fingerprints ([world, ...]) from rank 0's."""
    return max((float(relative_difference(p, prints[0], scale).max()) for p in prints[1:]), default=0.0)


def notes(taps: Any, ids: Sequence[int]) -> list[str | None]:
    """Per id, why this rank's taps give nothing to compare it with (read after the forward: the
    op notes each layer's form as it runs), or None."""
    if taps is None:
        return ["no taps on this model (its decoder layers were not found)"] * len(ids)
    found: list[str | None] = []
    for layer_id in ids:
        site = taps.rows.get(layer_id)
        if site is None:
            last = taps.start + taps.sites - 1
            found.append(
                f"id {layer_id} is not tapped on this rank (its layers' boundaries {taps.start}..{last})"
            )
        else:
            found.append(taps.form(site))
    return found


def _not_comparable(tokens: int, block: Any, prints: Any, chunk: int | None = None) -> str | None:
    """Why there is nothing to compare an id with in this forward, or None. `block`: [world, 2],
    each rank's (calls, rows) of the id's tap."""
    import torch

    if bool(torch.isnan(block[:, 0]).any()):
        return "a rank has no tap for this id"
    if bool((block[:, 0] < 1).any()):
        ranks = [r for r in range(block.shape[0]) if block[r, 0] < 1]
        return (
            f"the tap did not run in this forward on rank(s) {ranks} (a compiled graph made without"
            " the taps, e.g. served from a cache)"
        )
    short = [r for r in range(block.shape[0]) if block[r, 1] < tokens]
    if short and chunk is None:
        return (
            f"the layer saw {int(block[short[0], 1])} rows for {tokens} tokens (micro-batches of"
            " dual-batch overlap, or shards of a layout the check does not know)"
        )
    if bool(torch.isnan(prints).any()):
        return "a rank has no well-formed state for this id (see count)"
    return None
