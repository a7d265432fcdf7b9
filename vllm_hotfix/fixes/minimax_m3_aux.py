"""MiniMaxM3Model's aux hidden states under tensor parallelism (vllm/models/minimax_m3/nvidia/model.py).

Why: the nvidia file (vLLM's choice on every platform but ROCm) leaves each decoder layer's FFN
output un-reduced at pipeline-parallel size 1 and fuses its all-reduce into the next norm, but the
loop captures `hidden_states + residual` with the rank's *partial* FFN output: at TP > 1 every such
state is wrong and the ranks disagree. Id 0 is the embedding tensor that layer 0's in-place Gemma
norms later overwrite.

How: derived from the installed forward, every captured state becomes the all-reduced pre-norm sum
exactly where vLLM's next norm reduces (an all-reduce of a copy per requested id at TP > 1, none at
TP = 1), the final id the final fused norm's second output (0.25.0+), id 0 a copy; nothing else,
and the model's output is never touched. The steps are below.

Affected releases: vLLM 0.24.0 to 0.33.0.

Upstream: fixed in vLLM 0.34.0 (captures after the layers' input norms; the probe says `fixed
upstream` there).

When to drop: when the project stops supporting vLLM 0.24.0 to 0.33.0.

The fix, derived from the installed forward, makes every captured state the all-reduced pre-norm sum
exactly where vLLM's next norm reduces, and nothing else:
- In the loop, the capture's `hidden_states` becomes
  `tensor_model_parallel_all_reduce(hidden_states.clone()) if <id requested and the next norm
  reduces> else hidden_states`, one all-reduce per requested id at TP > 1 (the membership test is
  needed: `_maybe_add_hidden_state` takes the value for every layer and tests the id itself).
  "The next norm reduces" is `TP > 1 and layer.ffn_all_reduce_deferred` in 0.25.0+ (vLLM sets the next layer's
  `fuse_input_allreduce` and the model's `fuse_final_norm_allreduce` from exactly that property),
  and `TP > 1 and idx + 1 < self.end_layer and self.layers[idx + 1].fuse_input_allreduce` in 0.24.0
  (no such property; its final norm never reduces, so the final id is what that norm reads).
  `.clone()`: vLLM's CPU communicator reduces in place, and the un-reduced value must still reach
  the next layer's own fused norm. At TP = 1 the condition is False: stock's values, no collective.
  The layer call takes no pre-normed input, so the next norm's all-reduce cannot be reused here.
- 0.25.0+: the final layer's state (id `self.end_layer`) is no longer captured in the loop when
  `self.fuse_final_norm_allreduce`; it is the second output of the final fused norm (the
  all-reduced pre-norm sum vLLM computes anyway): no added collective.
- Id 0 (the embeddings, captured before the loop, 0.24.0-0.31.0: `aux_hidden_states =
  self._maybe_add_hidden_state([], 0, hidden_states, residual)`) is the embedding tensor itself,
  which layer 0 keeps as its `residual`; the Gemma norms (flashinfer's `gemma_fused_add_rmsnorm`) add
  into `residual` in place, so id 0 ends up holding a later layer's stream. The fix follows that
  statement with the copy vLLM 0.32.0 added itself (`if aux_hidden_states: aux_hidden_states[0] =
  aux_hidden_states[0].clone()`): made only when id 0 is requested (else the list is empty). Where
  stock makes that copy (0.32.0+), id 0 is left as it is.
Where vLLM already reduced (pipeline parallelism > 1: `reduce_results=True`, nothing deferred) both
conditions are False and the states are stock's. The model's output is never touched.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.aux_capture import REDUCE, WORLD_SIZE, TensorParallelCapture
from vllm_hotfix.fixes.base import Probe, contains_code, parse_function, parse_or_unknown, same_code
from vllm_hotfix.runtime.decisions import Decision

CAPTURE = "self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)"
LAYER_CALL = "hidden_states, residual = layer(positions, hidden_states, residual)"
FUSED_FINAL_TEST = "self.fuse_final_norm_allreduce"
FUSED_NORM = "hidden_states, _ = fused_allreduce_gemma_rms_norm(hidden_states, residual, self.norm)"
PLAIN_NORM = "hidden_states, _ = self.norm(hidden_states, residual)"
HAS_AUX = "len(aux_hidden_states) > 0"
ADD_STATE = "self._maybe_add_hidden_state"
# The decoder layer's fused input norm (read in the module's source): the next norm that reduces.
FUSED_INPUT = "self.fuse_input_allreduce and residual is not None"
FINAL_STATE = "final_state"  # the final fused norm's second output, kept instead of `_`
# Id 0, captured before the loop (0.24.0-0.31.0), and the copy vLLM 0.32.0 makes of it itself.
ENTRY = "aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual)"
ENTRY_COPY = "if aux_hidden_states:\n    aux_hidden_states[0] = aux_hidden_states[0].clone()"
ENTRY_REASON = (
    "; id 0 (the embeddings) captured as a copy (stock's is the tensor layer 0 keeps as residual, which"
    " the in-place Gemma norms overwrite)"
)
FIRST_AFFECTED = "0.24.0"
LAST_AFFECTED = "0.33.0"
FIXED_IN = "0.34.0"
# vLLM 0.34.0's fixed shape: id k read from the residual that layer k's input norm returns (the norm
# that completes the deferred all-reduce), the final id from the final norm's second output, cloned.
INPUT_NORM = "hidden_states, residual = layer.forward_input_norm(hidden_states, residual)"
CLONED_CAPTURE = "aux_hidden_states.append(residual.clone())"
LOOP_CAPTURE_TEST = "idx in self.aux_hidden_state_layers"
FINAL_CAPTURE_TEST = "self.end_layer in self.aux_hidden_state_layers"
FINAL_NORMS = (
    "hidden_states, residual = fused_allreduce_gemma_rms_norm(hidden_states, residual, self.norm)",
    "hidden_states, residual = self.norm(hidden_states, residual)",
)

# The condition under which the next norm all-reduces the layer's output, per known shape.
NEXT_NORM_REDUCES = {
    "fused-final": "layer.ffn_all_reduce_deferred",
    "plain-final": "idx + 1 < self.end_layer and self.layers[idx + 1].fuse_input_allreduce",
}


def reduced_expression(shape: str) -> str:
    """The capture's `hidden_states`: reduced exactly where vLLM's next norm reduces."""
    # the membership test first: _maybe_add_hidden_state evaluates its argument for every layer
    condition = (
        f"{WORLD_SIZE}() > 1 and idx + 1 in self.aux_hidden_state_layers and {NEXT_NORM_REDUCES[shape]}"
    )
    return f"({REDUCE}(hidden_states.clone()) if {condition} else hidden_states)"


def _calls(node: ast.AST, name: str) -> bool:
    """Whether any call under node is to `name` (a dotted name as written)."""
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) == name for n in ast.walk(node))


def _add_state_calls(function: ast.FunctionDef) -> list[ast.Call]:
    return [n for n in ast.walk(function) if isinstance(n, ast.Call) and ast.unparse(n.func) == ADD_STATE]


def captures_reduced(function: ast.FunctionDef) -> bool:
    """The fixed shape: every per-layer capture reduces its `hidden_states` (where the next norm
    does), and a forward with a fused final norm captures the final id from that norm."""
    per_layer = [
        c for c in _add_state_calls(function) if len(c.args) == 4 and same_code(c.args[1], "idx + 1")
    ]
    final = [
        c for c in _add_state_calls(function) if len(c.args) == 4 and same_code(c.args[1], "self.end_layer")
    ]
    if not per_layer or not all(_calls(c.args[2], REDUCE) for c in per_layer):
        return False
    return bool(final) or not contains_code(function, FUSED_FINAL_TEST)


def _captures_cloned_residual(node: ast.stmt, test: str) -> bool:
    """`if <test ...>: aux_hidden_states.append(residual.clone())` (the test may add more clauses)."""
    return (
        isinstance(node, ast.If)
        and contains_code(node.test, test)
        and len(node.body) == 1
        and same_code(node.body[0], CLONED_CAPTURE)
        and not node.orelse
    )


def _is_final_norm(node: ast.stmt) -> bool:
    """The final norm keeping its second output (`hidden_states, residual = ...`), fused or not."""
    if any(same_code(node, norm) for norm in FINAL_NORMS):
        return True
    return (
        isinstance(node, ast.If)
        and same_code(node.test, FUSED_FINAL_TEST)
        and len(node.body) == 1
        and len(node.orelse) == 1
        and same_code(node.body[0], FINAL_NORMS[0])
        and same_code(node.orelse[0], FINAL_NORMS[1])
    )


def captures_after_norms(function: ast.FunctionDef) -> bool:
    """vLLM 0.34.0's fixed shape: in the layer loop, `layer.forward_input_norm(...)` then the cloned
    residual it returns captured for id `idx`, and no other capture in the loop; after the loop, the
    final norm keeping its second output, then that output cloned for id `self.end_layer`."""
    loops = [s for s in function.body if isinstance(s, ast.For)]
    in_loop = False
    for loop in loops:
        norms = [j for j, s in enumerate(loop.body) if same_code(s, INPUT_NORM)]
        captures = [j for j, s in enumerate(loop.body) if _captures_cloned_residual(s, LOOP_CAPTURE_TEST)]
        stale = _calls(loop, ADD_STATE)  # no per-layer capture of the old kind left in the loop
        if len(norms) == 1 and len(captures) == 1 and captures[0] == norms[0] + 1 and not stale:
            in_loop = True
    body = function.body
    final = any(
        _is_final_norm(body[i]) and _captures_cloned_residual(body[i + 1], FINAL_CAPTURE_TEST)
        for i in range(len(body) - 1)
    )
    return in_loop and final


class Shape:
    """Where the parts of a known buggy forward are, or what is missing."""

    def __init__(self, function: ast.FunctionDef) -> None:
        body = function.body
        self.missing: list[str] = []
        self.kind: str | None = None
        self.capture: ast.stmt | None = None
        self.norm: ast.stmt | None = None
        # id 0's capture, where no copy of it follows (vLLM 0.32.0+ copies it itself)
        entries = [i for i, s in enumerate(body) if same_code(s, ENTRY)]
        self.entry: ast.stmt | None = None
        if len(entries) == 1 and not (
            entries[0] + 1 < len(body) and same_code(body[entries[0] + 1], ENTRY_COPY)
        ):
            self.entry = body[entries[0]]
        loop_at = norm_at = None
        for i, stmt in enumerate(body):
            if not isinstance(stmt, ast.For):
                continue
            calls = [j for j, s in enumerate(stmt.body) if same_code(s, LAYER_CALL)]
            captures = [j for j, s in enumerate(stmt.body) if same_code(s, CAPTURE)]
            if len(calls) == 1 and len(captures) == 1 and captures[0] > calls[0]:
                self.capture, loop_at = stmt.body[captures[0]], i
        fused = [
            (i, s)
            for i, s in enumerate(body)
            if isinstance(s, ast.If)
            and same_code(s.test, FUSED_FINAL_TEST)
            and len(s.body) == 1
            and same_code(s.body[0], FUSED_NORM)
            and len(s.orelse) == 1
            and same_code(s.orelse[0], PLAIN_NORM)
        ]
        plain = [(i, s) for i, s in enumerate(body) if same_code(s, PLAIN_NORM)]
        if len(fused) == 1 and not plain:
            self.kind = "fused-final"
            norm_at, self.norm = fused[0]
        elif len(plain) == 1 and not fused and not contains_code(function, FUSED_FINAL_TEST):
            self.kind = "plain-final"
            norm_at, self.norm = plain[0]
        else:
            self.missing.append(
                f"one top-level final norm: `if {FUSED_FINAL_TEST}: {FUSED_NORM} else: {PLAIN_NORM}`"
                f" or `{PLAIN_NORM}`"
            )
        if self.capture is None:
            self.missing.append(f"a layer loop with `{LAYER_CALL}` then `{CAPTURE}`")
        elif norm_at is not None and loop_at is not None and loop_at > norm_at:
            self.missing.append("the layer loop before the final norm")
        if norm_at is not None and not any(
            i > norm_at and isinstance(s, ast.If) and same_code(s.test, HAS_AUX) for i, s in enumerate(body)
        ):
            self.missing.append(f"`if {HAS_AUX}: return ...` after the final norm")
        if _calls(function, REDUCE):
            self.missing.append(f"a forward that does not call `{REDUCE}` itself")


class MiniMaxM3Aux(TensorParallelCapture):
    """MiniMaxM3Model.forward of the nvidia file (the amd file reduces each FFN output first)."""

    fix_id = "minimax-m3-aux-nvidia"
    title = "MiniMaxM3Model (nvidia) returns all-reduced aux hidden states under tensor parallelism"
    module = "vllm.models.minimax_m3.nvidia.model"
    owner = "MiniMaxM3Model"
    attribute = "forward"
    affected = (FIRST_AFFECTED, LAST_AFFECTED)
    fixed_in = FIXED_IN
    upstream = (
        f"vLLM {FIXED_IN} (each id captured as the cloned residual its layer's input norm returns,"
        " after the deferred all-reduce)"
    )
    related = (module,)  # the decoder layer's input norm, read to confirm which norm reduces
    absent = Decision.NOT_AFFECTED  # before vLLM 0.24.0 there is no MiniMax-M3 file
    architectures = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if captures_after_norms(function):
            return Probe(
                Decision.FIXED_UPSTREAM,
                "forward captures each id as the cloned residual its layer's input norm (or the final"
                " norm) returns, where the deferred all-reduce completes",
            )
        if not _calls(function, ADD_STATE):
            return Probe(Decision.NOT_AFFECTED, "forward collects no aux hidden states")
        if captures_reduced(function):
            return Probe(
                Decision.FIXED_UPSTREAM,
                "forward all-reduces each captured layer output where the next norm reduces",
            )
        module_source = (related or {}).get(self.module)
        if module_source is None:
            return Probe(Decision.UNKNOWN, f"the source of {self.module} could not be read")
        try:
            module_tree = ast.parse(module_source)
        except SyntaxError as error:
            return Probe(Decision.UNKNOWN, f"{self.module} could not be parsed: {error}")
        fuses_input = contains_code(module_tree, FUSED_INPUT)
        if not fuses_input and not contains_code(function, FUSED_FINAL_TEST):
            return Probe(
                Decision.NOT_AFFECTED,
                "no norm of this file completes a deferred FFN all-reduce: the captured sums are reduced",
            )
        shape = Shape(function)
        if not fuses_input:
            shape.missing.append(f"a decoder layer that fuses its input all-reduce (`if {FUSED_INPUT}:`)")
        if shape.missing:
            return Probe(
                Decision.UNKNOWN,
                "forward captures aux hidden states but is not a known buggy shape; missing: "
                + "; ".join(shape.missing),
            )
        final = (
            "; the final state is the final fused norm's second output"
            if shape.kind == "fused-final"
            else " (vLLM 0.24.0: the final norm does not reduce)"
        )
        entry = ENTRY_REASON if shape.entry is not None else ""
        return Probe(
            Decision.PATCHED,
            "forward captures per-rank partial sums where the next norm completes a deferred FFN"
            f" all-reduce (TP > 1, PP = 1); fixed: one all-reduce per requested layer{final}{entry}",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        shape = Shape(parse_function(text))
        assert shape.kind is not None and shape.capture is not None and shape.norm is not None
        lines = text.splitlines(keepends=True)
        # Bottom-up: the final norm first (0.25.0+), then the loop's capture.
        if shape.kind == "fused-final":
            fused = shape.norm.body[0]  # type: ignore[attr-defined]
            pad = " " * fused.col_offset
            replacement = (
                f"{pad}hidden_states, {FINAL_STATE} = fused_allreduce_gemma_rms_norm("
                "hidden_states, residual, self.norm)\n"
                f"{pad}{ADD_STATE}(aux_hidden_states, self.end_layer, {FINAL_STATE}, None)\n"
            )
            lines[fused.lineno - 1 : fused.end_lineno] = [replacement]
        capture = shape.capture
        pad = " " * capture.col_offset
        call = f"{ADD_STATE}(aux_hidden_states, idx + 1, {reduced_expression(shape.kind)}, residual)"
        if shape.kind == "fused-final":
            block = f"{pad}if not (idx + 1 == self.end_layer and {FUSED_FINAL_TEST}):\n{pad}    {call}\n"
        else:
            block = f"{pad}{call}\n"
        lines[capture.lineno - 1 : capture.end_lineno] = [block]
        if shape.entry is not None:  # above the loop: its lines are still where they were
            pad = " " * shape.entry.col_offset
            entry_copy = textwrap.indent(ENTRY_COPY + "\n", pad)
            end = shape.entry.end_lineno or shape.entry.lineno
            lines[end:end] = [entry_copy]
        return "".join(lines)
