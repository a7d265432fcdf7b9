"""Hybrid models save zeros through ExampleHiddenStatesConnector (`extract_hidden_states`).

Why: the connector rebuilds a finished request's slots as `block_id * self._block_size + offset`,
with `self._block_size = vllm_config.cache_config.block_size`. For a hybrid model (Mamba or linear
attention beside attention) vLLM raises that block size to a common multiple (e.g. 528) while the
hidden-states KV-cache group keeps its own (e.g. 22): the connector reads slots never written and
saves zeros (at scale, reads out of bounds).

How: right after the installed `__init__`'s own lookup of the hidden-states group
(`self._hs_group_idx`), the block size is read from that group's spec
(`kv_cache_groups[self._hs_group_idx].kv_cache_spec.block_size`): upstream's value, derived from the
installed code instead of carrying upstream's two helpers, and no refusal added (upstream's
`ValueError` in `register_kv_caches` is not made).

Affected releases: vLLM 0.24.0.

Upstream: vLLM PR #46301, released in 0.25.0.

When to drop: when the project no longer supports vLLM 0.24.0.
"""

from __future__ import annotations

import ast
import itertools
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.base import Fix, Probe, contains_code, parse_function, parse_or_unknown, same_code
from vllm_hotfix.runtime.decisions import Decision

BUGGY = "self._block_size = vllm_config.cache_config.block_size"
# 0.24.0 finds the hidden-states KV-cache group (by its layer's name): `_hs_group_idx` starts at 0 and
# the next statement, `if self._kv_cache_config is not None:`, searches the groups. Earlier connectors
# read group 0 (0.22.0-0.23.0) or run without the hybrid KV-cache manager (0.17.0-0.21.0).
GROUP_LOOKUP = "self._hs_group_idx: int = 0"
HAS_CONFIG = "self._kv_cache_config is not None"
GROUP_SPEC_BLOCK = "self._kv_cache_config.kv_cache_groups[self._hs_group_idx].kv_cache_spec.block_size"
DERIVED = (
    "# The hidden-states group's own block size, read from its spec as vLLM 0.25.0\n"
    "# does (vLLM PR #46301): cache_config.block_size is raised for hybrid models.\n"
    f"if {HAS_CONFIG}:\n"
    "    self._block_size = self._kv_cache_config.kv_cache_groups[\n"
    "        self._hs_group_idx\n"
    "    ].kv_cache_spec.block_size\n"
)
FIXED_SHAPES = (  # upstream's (0.25.0) and this fix's
    "self._block_size = self._get_cache_block_size(vllm_config, kv_cache_config, self._cache_kv_group_id)",
    f"self._block_size = {GROUP_SPEC_BLOCK}",
)


def _buggy_statements(function: ast.FunctionDef) -> list[ast.stmt]:
    return [stmt for stmt in function.body if same_code(stmt, BUGGY)]


def _group_lookup(function: ast.FunctionDef) -> ast.If | None:
    """0.24.0's search of the hidden-states group: the `if` right after `_hs_group_idx: int = 0`
    that assigns `self._hs_group_idx`; None if the function has no such lookup."""
    body = function.body
    for stmt, after in itertools.pairwise(body):
        if (
            same_code(stmt, GROUP_LOOKUP)
            and isinstance(after, ast.If)
            and same_code(after.test, HAS_CONFIG)
            and contains_code(after, "self._hs_group_idx = i")
        ):
            return after
    return None


class HiddenStatesHybridBlock(Fix):
    """ExampleHiddenStatesConnector.__init__: slots rebuilt with the hidden-states group's block size."""

    fix_id = "hidden-states-hybrid-block"
    title = "ExampleHiddenStatesConnector reads hybrid models' states with their group's block size"
    module = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
    owner = "ExampleHiddenStatesConnector"
    attribute = "__init__"
    affected = ("0.24.0", "0.24.0")
    fixed_in = "0.25.0"
    upstream = "vLLM PR #46301, released in 0.25.0"
    absent = Decision.NOT_AFFECTED  # releases before the connector have nothing to read back

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if any(contains_code(function, shape) for shape in FIXED_SHAPES):
            return Probe(Decision.FIXED_UPSTREAM, "the block size is the hidden-states group's (its spec's)")
        missing = []
        names = [a.arg for a in function.args.args]
        if "vllm_config" not in names or "kv_cache_config" not in names:
            missing.append(f"the parameters vllm_config and kv_cache_config (found {', '.join(names)})")
        if len(_buggy_statements(function)) != 1:
            missing.append(f"one top-level `{BUGGY}`")
        if missing:
            return Probe(
                Decision.UNKNOWN,
                "not the known shape of the connector's __init__; missing: " + "; ".join(missing),
            )
        if not any(same_code(stmt, GROUP_LOOKUP) for stmt in function.body):
            return Probe(
                Decision.NOT_AFFECTED,
                "a connector from before the hidden-states group lookup (vLLM 0.24.0), so no block size"
                " of that group to read: 0.17.0-0.21.0's runs without the hybrid KV-cache manager;"
                " 0.22.0-0.23.0's saves from the step's slot mapping, whose own defect (rows lost under"
                " prefix caching, vLLM issue #44485) is the fix hidden-states-prefix-cache's",
            )
        if _group_lookup(function) is None:
            return Probe(
                Decision.UNKNOWN,
                "not the known shape of the connector's __init__; missing: right after"
                f" `{GROUP_LOOKUP}`, an `if {HAS_CONFIG}:` that sets `self._hs_group_idx = i`",
            )
        return Probe(
            Decision.PATCHED,
            "slots are rebuilt with the global cache_config.block_size, which hybrid models raise above"
            " the hidden-states group's: the connector saves slots never written (zeros);"
            f" fixed: after the group lookup, `self._block_size = {GROUP_SPEC_BLOCK}`",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        lookup = _group_lookup(parse_function(text))
        assert lookup is not None and lookup.end_lineno is not None
        lines = text.splitlines(keepends=True)
        addition = textwrap.indent(DERIVED, " " * lookup.col_offset)
        return "".join(lines[: lookup.end_lineno]) + addition + "".join(lines[lookup.end_lineno :])
