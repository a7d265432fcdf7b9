"""Prefix caching drops and misaligns the rows of ExampleHiddenStatesConnector's files.

Why: that connector saves each new request of a step in `save_kv_layer`, slicing the step's slot
mapping by the request's whole prompt length: a request with a cached prefix (prefix caching is on
by default) has only its uncached tokens in the step, so its file gets fewer state rows than
`token_ids`, and every later new request of the same step gets rows of another request (vLLM issue
#44485), with no error.

How: the smallest change that makes every file's rows its tokens' states: in
`VllmConfig._post_init_kv_transfer_config`, right after vLLM's chunked-prefill guard for this
connector, prefix caching is turned off for an engine that runs it, with one WARNING that says why.
The function runs once per config (never traced), so the log line and the write are no trace-time
side effects.

Affected releases: vLLM 0.22.0 to 0.23.0.

Upstream: none for these releases (issue #44485 open); vLLM 0.24.0 rewrote the connector (PR
#43805), too large to carry, and removed the cause.

When to drop: when the project no longer supports vLLM 0.22.0 to 0.23.0.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.base import Fix, Probe, contains_code, parse_function, parse_or_unknown
from vllm_hotfix.runtime.decisions import Decision

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
CONNECTOR = "ExampleHiddenStatesConnector"
GUARD = f'self.kv_transfer_config.kv_connector == "{CONNECTOR}"'
CHUNKED = "self.scheduler_config.enable_chunked_prefill"
OFF = "self.cache_config.enable_prefix_caching = False"
# The buggy save: each new request's rows are the next `len(prompt)` entries of the step's slots.
PER_STEP_SAVE = (
    "num_tokens = request.token_ids.shape[0]",
    "req_slot_mapping_gpu = slot_mapping[offset : offset + num_tokens]",
)
TURN_OFF = (
    "# ExampleHiddenStatesConnector saves each new request's rows from this step's\n"
    "# slots by the whole prompt's length: a cached prefix would shorten that file\n"
    "# and shift the rows of the step's later requests (vLLM issue #44485).\n"
    "if (\n"
    "    self.kv_transfer_config is not None\n"
    f'    and self.kv_transfer_config.kv_connector == "{CONNECTOR}"\n'
    "    and self.cache_config.enable_prefix_caching\n"
    "):\n"
    "    logger.warning(\n"
    '        "Prefix caching is disabled: %s saves a request with a cached prefix "\n'
    '        "with too few and with other requests\' hidden-state rows (vLLM issue "\n'
    '        "#44485; vllm-hotfix hidden-states-prefix-cache).",\n'
    f'        "{CONNECTOR}",\n'
    "    )\n"
    f"    {OFF}\n"
)


def _chunked_prefill_guards(function: ast.FunctionDef) -> list[ast.If]:
    """The top-level `if`s that refuse chunked prefill for this connector (0.22.0-0.23.0)."""
    return [
        stmt
        for stmt in function.body
        if isinstance(stmt, ast.If)
        and contains_code(stmt.test, GUARD)
        and contains_code(stmt.test, CHUNKED)
        and any(isinstance(node, ast.Raise) for node in ast.walk(stmt))
    ]


def _save_kv_layer(module_source: str) -> ast.FunctionDef | None:
    for node in ast.parse(module_source).body:
        if isinstance(node, ast.ClassDef) and node.name == CONNECTOR:
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "save_kv_layer"]
            return methods[-1] if methods else None
    return None


def _missing_in_connector(module_source: str | None) -> list[str]:
    """What the connector's save lacks of the per-step shape (nothing: it has the bug)."""
    if module_source is None:
        return [f"the module {CONNECTOR_MODULE}"]
    try:
        save = _save_kv_layer(module_source)
    except SyntaxError as error:
        return [f"a parsable {CONNECTOR_MODULE} ({error})"]
    if save is None:
        return [f"{CONNECTOR}.save_kv_layer"]
    where = f"{CONNECTOR}.save_kv_layer"
    return [f"`{code}` in {where}" for code in PER_STEP_SAVE if not contains_code(save, code)]


class HiddenStatesPrefixCache(Fix):
    """VllmConfig: prefix caching off where ExampleHiddenStatesConnector saves by the step's slots."""

    fix_id = "hidden-states-prefix-cache"
    title = "ExampleHiddenStatesConnector's files keep every row under prefix caching (caching off)"
    module = "vllm.config.vllm"
    owner = "VllmConfig"
    attribute = "_post_init_kv_transfer_config"
    related = (CONNECTOR_MODULE,)
    affected = ("0.22.0", "0.23.0")
    # Upstream never changed the 0.22-0.23 connector (vLLM issue #44485 is open); 0.24.0's rewrite
    # (vLLM PR #43805) has no such save, and the probe calls it `not affected`.
    fixed_in = None
    upstream = "none for the 0.22-0.23 connector (vLLM issue #44485); 0.24.0 rewrote it (vLLM PR #43805)"
    absent = Decision.NOT_AFFECTED  # releases before this config hook have no per-step save either

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if contains_code(function, OFF):
            return Probe(Decision.FIXED_UPSTREAM, f"prefix caching is off for {CONNECTOR} (`{OFF}`)")
        guards = _chunked_prefill_guards(function)
        if not guards:
            return Probe(
                Decision.NOT_AFFECTED,
                f"no chunked-prefill guard for {CONNECTOR}: its connector is not the one that saves by"
                " the step's slot mapping (0.22.0-0.23.0); before it, the connector read a request's"
                " blocks, and 0.24.0's rewrite (vLLM PR #43805) reads them when the request finishes",
            )
        missing = [] if len(guards) == 1 else [f"one chunked-prefill guard for {CONNECTOR}"]
        missing += _missing_in_connector((related or {}).get(CONNECTOR_MODULE))
        if missing:
            return Probe(
                Decision.UNKNOWN,
                f"not the known shape of {CONNECTOR}'s per-step save; missing: " + "; ".join(missing),
            )
        return Probe(
            Decision.PATCHED,
            f"{CONNECTOR} slices the step's slots by each new request's whole prompt: a cached prefix"
            " shortens its file and shifts the step's later requests' rows (vLLM issue #44485);"
            " fixed: prefix caching off for this connector, with a WARNING",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        (guard,) = _chunked_prefill_guards(parse_function(text))
        assert guard.end_lineno is not None
        lines = text.splitlines(keepends=True)
        addition = "\n" + textwrap.indent(TURN_OFF, " " * guard.col_offset)
        return "".join(lines[: guard.end_lineno]) + addition + "".join(lines[guard.end_lineno :])
