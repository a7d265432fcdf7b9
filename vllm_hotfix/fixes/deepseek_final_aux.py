"""DeepseekV2Model never returns the final layer's aux hidden state.

Why: the forward captures the *input* of each requested decoder layer, so the id num_hidden_layers
(the last layer's output, before the final norm) is never captured: EAGLE3 and
`extract_hidden_states` get one state too few (a crash), or another layer's state with no error.

How: upstream's statement, `if self.end_layer in self.aux_hidden_state_layers:
aux_hidden_states.append(hidden_states + residual)`, inserted into the installed forward right before
the final norm call, after the non-last-rank return; nothing else changes.

Affected releases: vLLM 0.18.0 to 0.24.0 (one forward in all of them); before 0.18.0 there is no
aux capture.

Upstream: vLLM PR #46973, released in 0.25.0.

When to drop: when the project no longer supports vLLM 0.18.0 to 0.24.0 (most of the test suite is
built on this fix's bug: move those tests first).
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.aux_capture import FINAL_TEST, verdict_from_checks, verdict_without_shape
from vllm_hotfix.fixes.base import Fix, Probe, parse_function, same_code

NORM_CALL = "hidden_states, _ = self.norm(hidden_states, residual)"
CAPTURE = "aux_hidden_states.append(hidden_states + residual)"
LOOP_TEST = "idx in self.aux_hidden_state_layers"
INIT = "aux_hidden_states = []"
NOT_LAST_RANK = "not get_pp_group().is_last_rank"
HAS_AUX = "len(aux_hidden_states) > 0"

# The statement upstream added, inserted before the final norm call with the call's indentation.
UPSTREAM_STATEMENT = f"if {FINAL_TEST}:\n    {CAPTURE}\n"


def _if(stmt: ast.stmt) -> ast.If:
    assert isinstance(stmt, ast.If)  # what _top_level_if found
    return stmt


def _top_level_if(body: list[ast.stmt], test: str) -> list[int]:
    return [i for i, stmt in enumerate(body) if isinstance(stmt, ast.If) and same_code(stmt.test, test)]


def _loop_captures_inputs(body: list[ast.stmt]) -> bool:
    for stmt in body:
        if isinstance(stmt, ast.For):
            for inner in ast.walk(stmt):
                if (
                    isinstance(inner, ast.If)
                    and same_code(inner.test, LOOP_TEST)
                    and len(inner.body) == 1
                    and same_code(inner.body[0], CAPTURE)
                ):
                    return True
    return False


class DeepseekFinalAux(Fix):
    fix_id = "deepseek-final-aux"
    title = "DeepseekV2Model returns the final layer's aux hidden state"
    module = "vllm.model_executor.models.deepseek_v2"
    owner = "DeepseekV2Model"
    attribute = "forward"
    affected = ("0.18.0", "0.24.0")
    fixed_in = "0.25.0"
    upstream = "vLLM PR #46973, released in 0.25.0"

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = verdict_without_shape(source)
        if isinstance(function, Probe):
            return function

        body = function.body
        norm_all = [node for node in ast.walk(function) if same_code(node, NORM_CALL)]
        norm_top = [i for i, stmt in enumerate(body) if same_code(stmt, NORM_CALL)]
        norm_at = norm_top[0] if len(norm_top) == 1 and len(norm_all) == 1 else None
        checks = {
            f"one top-level `{NORM_CALL}`": norm_at is not None,
            f"top-level `{INIT}`": any(same_code(stmt, INIT) for stmt in body),
            f"a layer loop with `if {LOOP_TEST}: {CAPTURE}`": _loop_captures_inputs(body),
            f"`if {NOT_LAST_RANK}: return ...` before the norm": norm_at is not None
            and any(
                i < norm_at and isinstance(_if(body[i]).body[-1], ast.Return)
                for i in _top_level_if(body, NOT_LAST_RANK)
            ),
            f"`if {HAS_AUX}: return ...` after the norm": norm_at is not None
            and any(i > norm_at for i in _top_level_if(body, HAS_AUX)),
        }
        return verdict_from_checks(
            checks, "forward captures the inputs of the requested layers and never the final layer's output"
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        function = parse_function(text)
        (norm,) = [stmt for stmt in function.body if same_code(stmt, NORM_CALL)]
        lines = text.splitlines(keepends=True)
        indent = " " * norm.col_offset
        insert = textwrap.indent(UPSTREAM_STATEMENT, indent)
        at = norm.lineno - 1
        return "".join(lines[:at]) + insert + "".join(lines[at:])
