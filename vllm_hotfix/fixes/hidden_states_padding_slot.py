"""CUDA-graph padding overwrites a stored hidden state (`extract_hidden_states`).

Why: `basic_cache` (vllm/model_executor/models/extract_hidden_states.py) scatters each token's
hidden states into the cache-only KV cache at slot `slot_mapping[i]`; under CUDA graphs the proposer
pads the batch with slot -1, which indexes the *last* slot of the *last* block: every padded row
overwrites a real request's stored state, saved later to its file without a word (vLLM issue #43810).

How: upstream's statement and comment, `slot_mapping = slot_mapping.clamp_min(0)` before the
scatter (padding lands in the null block 0, never allocated to a request): where upstream put it
(after `block_size = ...`) in the 0.22.0 shape, which then equals 0.25.0's function character for
character, and right before the scatter in the older flat-view shape.

Affected releases: vLLM 0.17.0 to 0.24.0.

Upstream: vLLM PR #46301, released in 0.25.0.

When to drop: when the project no longer supports vLLM 0.17.0 to 0.24.0.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.base import Fix, Probe, contains_code, parse_function, parse_or_unknown, same_code
from vllm_hotfix.runtime.decisions import Decision

PARAMETERS = ("to_cache", "kv_cache", "slot_mapping")
BLOCK_SIZE = "block_size = kv_cache.shape[1]"
SCATTER = "kv_cache[slot_mapping // block_size, slot_mapping % block_size] = to_cache"
# The shape of 0.17.0-0.21.0: the same scatter through a flat view of the cache's slots.
FLAT_SHAPE = "num_blocks, block_size, num_heads, head_size = kv_cache.shape"
FLAT_VIEW = "token_kv_cache = kv_cache.view(num_blocks * block_size, num_heads, head_size)"
FLAT_SCATTER = "token_kv_cache[slot_mapping] = to_cache"
SHAPES = ((BLOCK_SIZE, SCATTER), (FLAT_SHAPE, FLAT_VIEW, FLAT_SCATTER))
CLAMP = "slot_mapping = slot_mapping.clamp_min(0)"
# Upstream's change: its comment goes above `block_size = ...`, the clamp right after it.
UPSTREAM_COMMENT = (
    "# Padding slots are -1; redirect them to the null block (block 0, never\n"
    "# allocated to a request) so the scatter stays branch-free and sync-free.\n"
)


def _buggy_shape(function: ast.FunctionDef) -> list[str]:
    """What the known buggy shapes lack (nothing: it is one of them)."""
    missing = []
    names = tuple(a.arg for a in function.args.args)
    if names != PARAMETERS:
        missing.append(f"the parameters {', '.join(PARAMETERS)} (found {', '.join(names)})")
    if _shape(function) is None:
        missing.append(" or ".join("`" + "` then `".join(shape) + "` as the whole body" for shape in SHAPES))
    return missing


def _shape(function: ast.FunctionDef) -> tuple[str, ...] | None:
    body = function.body
    for shape in SHAPES:
        if len(body) == len(shape) and all(
            same_code(stmt, code) for stmt, code in zip(body, shape, strict=True)
        ):
            return shape
    return None


class HiddenStatesPaddingSlot(Fix):
    """basic_cache: a padded row (slot -1) goes to the null block, not onto a stored state."""

    fix_id = "hidden-states-padding-slot"
    title = "extract_hidden_states keeps padded rows (slot -1) off the stored states"
    module = "vllm.model_executor.models.extract_hidden_states"
    owner = None
    attribute = "basic_cache"
    affected = ("0.17.0", "0.24.0")
    fixed_in = "0.25.0"
    upstream = "vLLM PR #46301, released in 0.25.0"
    absent = Decision.NOT_AFFECTED  # releases before extract_hidden_states have no such cache

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if contains_code(function, CLAMP):
            return Probe(Decision.FIXED_UPSTREAM, f"padding slots go to the null block (`{CLAMP}`)")
        missing = _buggy_shape(function)
        if missing:
            return Probe(
                Decision.UNKNOWN,
                "not the known shape of the hidden-states cache write; missing: " + "; ".join(missing),
            )
        return Probe(
            Decision.PATCHED,
            "padding slots (-1) scatter onto the last slot of the last block, over a stored state;"
            f" fixed: `{CLAMP}` before the scatter",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        function = parse_function(text)
        lines = text.splitlines(keepends=True)
        first, scatter = function.body[0], function.body[-1]
        indent = " " * scatter.col_offset
        comment = textwrap.indent(UPSTREAM_COMMENT, indent)
        clamp = f"{indent}{CLAMP}\n"
        if _shape(function) == SHAPES[0]:  # upstream's place: comment above, clamp below `block_size`
            at, after = first.lineno - 1, scatter.lineno - 1
            return "".join(lines[:at]) + comment + "".join(lines[at:after]) + clamp + "".join(lines[after:])
        at = scatter.lineno - 1  # the flat shape: both right before the scatter
        return "".join(lines[:at]) + comment + clamp + "".join(lines[at:])
