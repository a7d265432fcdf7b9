"""Id 0 (the embeddings) in vLLM's shared capture helper, `EagleModelMixin._maybe_add_hidden_state`.

Why: the helper (vllm/model_executor/models/interfaces.py) appends `hidden_states + residual if
residual is not None else hidden_states`: with `residual` None it appends the tensor itself. The
models that use it (Llama and the models built on it, Qwen2/3, Qwen3-MoE, gpt-oss and about twenty
more) capture id 0 with `residual` None, so id 0 is the embedding tensor that layer 0 keeps as its
residual; where a later norm adds into it in place (CUDA's `fused_add_rms_norm`), id 0 holds a later
layer's running sum, with no error.

How: derived from the installed helper, that branch becomes a copy (`... else
hidden_states.clone()`), inside the helper's own membership test, so the copy is made only for a
requested id; a helper that already copies is `fixed upstream`. Models that override the helper
without calling the mixin's are not touched.

Affected releases: vLLM 0.18.0 (the first with the helper) to 0.34.0 and later.

Upstream: not fixed as of vLLM 0.34.0; the patch offered is in upstream/shared-capture-id0/.

When to drop: when upstream's helper copies the state and the project stops supporting the releases
before that.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.base import Fix, Probe, contains_code, parse_function, parse_or_unknown, same_code
from vllm_hotfix.runtime.decisions import Decision

MEMBERSHIP = "layer_idx in self.aux_hidden_state_layers"
VALUE = "value = hidden_states + residual if residual is not None else hidden_states"
APPEND = "aux_hidden_states.append(value)"
RETURN = "return aux_hidden_states"
COPY = "hidden_states.clone()"
PARAMETERS = ("self", "aux_hidden_states", "layer_idx", "hidden_states", "residual")
FIRST_AFFECTED = "0.18.0"  # the first release with the helper (tests/sources)
LAST_AFFECTED = "0.34.0"


class Shape:
    """Where the known aliasing shape's parts are, or what is missing."""

    def __init__(self, function: ast.FunctionDef) -> None:
        self.missing: list[str] = []
        self.value: ast.Assign | None = None
        names = tuple(a.arg for a in function.args.args)
        if names != PARAMETERS:
            self.missing.append(f"the parameters {', '.join(PARAMETERS)} (found {', '.join(names)})")
        body = function.body
        tests = [s for s in body if isinstance(s, ast.If) and same_code(s.test, MEMBERSHIP)]
        if len(tests) != 1 or tests[0].orelse:
            self.missing.append(f"one `if {MEMBERSHIP}:` without an else")
        else:
            inner = tests[0].body
            if len(inner) == 2 and same_code(inner[0], VALUE) and same_code(inner[1], APPEND):
                self.value = inner[0]  # type: ignore[assignment]
            else:
                self.missing.append(f"`{VALUE}` then `{APPEND}` as that test's whole body")
        if not body or not same_code(body[-1], RETURN):
            self.missing.append(f"`{RETURN}` last")


class SharedCaptureId0(Fix):
    """EagleModelMixin._maybe_add_hidden_state: a requested state captured without a residual is a copy."""

    fix_id = "shared-capture-id0"
    title = "vLLM's shared capture helper returns id 0 (the embeddings) as a copy"
    module = "vllm.model_executor.models.interfaces"
    owner = "EagleModelMixin"
    attribute = "_maybe_add_hidden_state"
    affected = (FIRST_AFFECTED, LAST_AFFECTED)
    fixed_in = None
    upstream = "none yet (Qwen3.5's own override in vLLM 0.34.0 copies id 0; the shared helper does not)"
    absent = Decision.NOT_AFFECTED  # releases before the helper capture no aux states through it

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if contains_code(function, COPY):
            return Probe(
                Decision.FIXED_UPSTREAM, f"the helper copies a state captured without a residual (`{COPY}`)"
            )
        shape = Shape(function)
        if shape.missing:
            return Probe(
                Decision.UNKNOWN,
                "not the known shape of the shared capture helper; missing: " + "; ".join(shape.missing),
            )
        return Probe(
            Decision.PATCHED,
            "with residual None the helper appends hidden_states itself: id 0 is the embedding tensor"
            " layer 0 keeps as its residual, which an in-place fused add-RMSNorm (CUDA) overwrites;"
            f" fixed: `{COPY}` for a requested id",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        shape = Shape(parse_function(text))
        assert shape.value is not None and isinstance(shape.value.value, ast.IfExp)
        alias = shape.value.value.orelse  # the bare `hidden_states` of the None branch
        assert alias.end_lineno is not None and alias.end_col_offset is not None
        lines = text.splitlines(keepends=True)
        # One name on one line: replace it in place, every other character as it was.
        assert alias.lineno == alias.end_lineno
        line = lines[alias.lineno - 1].encode("utf-8")
        start, end = alias.col_offset, alias.end_col_offset
        lines[alias.lineno - 1] = (line[:start] + COPY.encode("utf-8") + line[end:]).decode("utf-8")
        return "".join(lines)
