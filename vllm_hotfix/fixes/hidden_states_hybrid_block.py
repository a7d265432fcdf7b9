"""Hybrid models save zeros through ExampleHiddenStatesConnector (vLLM 0.24.0, `extract_hidden_states`).

The connector rebuilds a finished request's slots as `block_id * self._block_size + offset`, with
`self._block_size = vllm_config.cache_config.block_size` set in `__init__`. For a hybrid model
(Mamba or linear attention beside attention) vLLM raises `cache_config.block_size` to a common
multiple (e.g. 528) while the hidden-states KV-cache group keeps its own, smaller block size (e.g.
22): the connector reads slots that were never written and saves zeros (at scale, reads out of
bounds). Upstream (vLLM PR #46301, released in 0.25.0) finds the hidden-states group by its spec
(`HiddenStateCacheSpec`) and reads the block size from that group's spec. This fix replaces the one
assignment in the installed `__init__` with upstream's two, and gives them upstream's two helpers
(`_find_cache_kv_group_id`, `_get_cache_block_size`, added to the class upstream; bound here as
plain functions, since the installed class has no such methods). Upstream's other part, a
`ValueError` in `register_kv_caches` when that block size differs from the buffer's, is not made.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from vllm_hotfix.decisions import Decision
from vllm_hotfix.fixes.base import Fix, Probe, same_code

BUGGY = "self._block_size = vllm_config.cache_config.block_size"
# 0.24.0 reads the blocks of the hidden-states KV-cache group (found by its layer's name); earlier
# connectors read group 0 (0.22.0-0.23.0) or run without the hybrid KV-cache manager (0.17.0-0.21.0).
GROUP_LOOKUP = "self._hs_group_idx: int = 0"
FIND = "_find_cache_kv_group_id"
GET = "_get_cache_block_size"
# Upstream's statements, with the helpers it added to the class called as bound names.
UPSTREAM_STATEMENTS = (
    "# Read the hidden-states group and its block size from the group spec;\n"
    "# cache_config.block_size is bumped (wrong) for hybrid verifiers.\n"
    f"self._cache_kv_group_id = {FIND}(kv_cache_config)\n"
    f"self._block_size = {GET}(\n"
    "    vllm_config, kv_cache_config, self._cache_kv_group_id\n"
    ")\n"
)
FIXED_SHAPES = (  # upstream's (methods of the class) and this fix's (bound names)
    f"self._block_size = self.{GET}(vllm_config, kv_cache_config, self._cache_kv_group_id)",
    f"self._block_size = {GET}(vllm_config, kv_cache_config, self._cache_kv_group_id)",
)


def _find_cache_kv_group_id(kv_cache_config: Any) -> int:
    """Index of the KV cache group holding the extracted hidden states (upstream's, vLLM 0.25.0)."""
    if kv_cache_config is None:
        return 0

    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    group_ids = [
        gid for gid, group in enumerate(groups) if isinstance(group.kv_cache_spec, HiddenStateCacheSpec)
    ]
    if len(group_ids) == 1:
        return group_ids[0]
    if not group_ids and len(groups) == 1:
        return 0
    raise ValueError(
        "Could not uniquely identify the extract-hidden-states KV cache "
        f"group among {len(groups)} groups; the hidden-states layer must be "
        "isolated in its own group (MLA verifiers are unsupported)."
    )


def _get_cache_block_size(vllm_config: Any, kv_cache_config: Any, cache_kv_group_id: int) -> int:
    """Block size of the hidden-states group, read from its own spec (upstream's, vLLM 0.25.0)."""
    if kv_cache_config is None:
        return vllm_config.cache_config.block_size
    cache_group = kv_cache_config.kv_cache_groups[cache_kv_group_id]
    return cache_group.kv_cache_spec.block_size


def _buggy_statements(function: ast.FunctionDef) -> list[ast.stmt]:
    return [stmt for stmt in function.body if same_code(stmt, BUGGY)]


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
        try:
            function = self.parse_function(source)
        except (SyntaxError, ValueError) as error:
            return Probe(Decision.UNKNOWN, f"source could not be parsed: {error}")
        if any(same_code(stmt, shape) for stmt in function.body for shape in FIXED_SHAPES):
            return Probe(Decision.FIXED_UPSTREAM, f"the block size is the hidden-states group's (`{GET}`)")
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
                "a connector from before the hidden-states group lookup (vLLM 0.24.0): it reads group 0"
                " or runs without the hybrid KV-cache manager; this fix repairs the block size of the"
                " 0.24.0 lookup only (hybrid models: use vLLM 0.25.0 or newer)",
            )
        return Probe(
            Decision.PATCHED,
            "slots are rebuilt with the global cache_config.block_size, which hybrid models raise above"
            " the hidden-states group's: the connector saves slots never written (zeros);"
            f" fixed: the group's own block size (`{GET}`)",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        (statement,) = _buggy_statements(self.parse_function(text))
        assert statement.end_lineno is not None
        lines = text.splitlines(keepends=True)
        replacement = textwrap.indent(UPSTREAM_STATEMENTS, " " * statement.col_offset)
        return "".join(lines[: statement.lineno - 1]) + replacement + "".join(lines[statement.end_lineno :])

    def bindings(self, module: ModuleType) -> dict[str, Any]:
        return {FIND: _find_cache_kv_group_id, GET: _get_cache_block_size}
