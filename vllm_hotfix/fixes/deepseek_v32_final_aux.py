"""DeepseekV32Model's aux hidden states (vllm/models/deepseek_v32/{nvidia,amd}/model.py, vLLM 0.25.0+).

Two defects, neither fixed upstream:
- The forward captures the *input* of each requested layer and never the final layer's output (id
  num_hidden_layers), as DeepseekV2Model did before vLLM PR #46973.
- Under tensor parallelism the decoder layers leave their attention and MLP/MoE outputs un-reduced
  and fuse the all-reduce into the next norm (`fused_allreduce_rms_norm`), so the `hidden_states`
  that the loop adds to `residual` is each rank's partial sum: every captured state is wrong at
  TP > 1, and differs between ranks.

The fix, derived from the installed source:
- In the loop's capture, `hidden_states + residual` becomes
  `(all_reduce(hidden_states.clone()) if <the next norm reduces> else hidden_states) + residual`:
  the value that the following fused norm computes as its new residual. "The next norm reduces" is
  `TP > 1 and not COND`, where COND is read from vLLM's own final-norm statement
  (`if COND: <sequence-parallel norm> else: fused_allreduce_rms_norm(...)`; no COND where the norm
  is unconditional). Only the known CONDs are accepted; each was checked against its release's
  decoder layer, which reduces its input under exactly the same condition. At TP = 1 the condition
  is False when traced: the graph is stock's, with no collective. `.clone()`: some communicators
  (vLLM's CPU one) reduce in place, and the un-reduced value must still reach the next layer.
- The loop's capture block, with `idx` replaced by `self.end_layer`, is inserted just before the
  final norm statement, after the non-last-pipeline-rank return: the final layer's output is
  captured as upstream captures it for DeepseekV2Model, and on the sequence-parallel path it joins
  the packed all-gather with the other states.
"""

from __future__ import annotations

import ast
import copy
import textwrap
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from vllm_hotfix.decisions import Decision
from vllm_hotfix.fixes.aux_capture import FINAL_TEST
from vllm_hotfix.fixes.base import Fix, Probe, contains_code, same_code

INIT = "aux_hidden_states = []"
LOOP_TEST = "idx in self.aux_hidden_state_layers"
NOT_LAST_RANK = "not get_pp_group().is_last_rank"
HAS_AUX = "len(aux_hidden_states) > 0"
FUSED_NORM = "hidden_states, _ = fused_allreduce_rms_norm(hidden_states, residual, self.norm)"
APPEND = "aux_hidden_states.append"
LAYER_INPUT = "hidden_states + residual"  # what the stock loop captures: a per-rank partial at TP > 1
LAYER_CALL = "layer"  # the loop's decoder-layer call, `... = layer(positions, hidden_states, ...)`
FIRST_AFFECTED = {"nvidia": "0.25.0", "amd": "0.27.0"}  # the first releases with these files
LAST_CHECKED = "0.33.0"  # the newest release whose source was read

# The conditions under which vLLM's final norm takes its sequence-parallel (already reduced) branch,
# each checked against the decoder layer of the releases that use it (module docstring).
SEQUENCE_PARALLEL = {
    "self.use_sequence_parallel": "vLLM 0.28+: one model-wide sequence-parallel switch",
    "hidden_states.shape[0] != full_num_tokens": "vLLM 0.26-0.27: per-layer sequence-parallel MoE",
}
# The names the fixed source uses that the model module does not import.
REDUCE = "tensor_model_parallel_all_reduce"
WORLD_SIZE = "get_tensor_model_parallel_world_size"
REDUCED_TEMPLATE = f"({REDUCE}(hidden_states.clone()) if {{condition}} else hidden_states)"


def reduced_expression(sequence_parallel: str | None) -> str:
    """The capture's left operand: reduced exactly where vLLM's next norm reduces."""
    condition = f"{WORLD_SIZE}() > 1"
    if sequence_parallel is not None:
        condition += f" and not ({sequence_parallel})"
    return REDUCED_TEMPLATE.format(condition=condition)


def _has_init(body: list[ast.stmt]) -> bool:
    """`aux_hidden_states = []`, with or without a type annotation."""
    for stmt in body:
        if same_code(stmt, INIT):
            return True
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and stmt.target.id == "aux_hidden_states"
            and isinstance(stmt.value, ast.List)
            and not stmt.value.elts
        ):
            return True
    return False


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _layer_sums(node: ast.AST) -> list[ast.BinOp]:
    """Every `<x> + residual` under node whose left operand is hidden_states, plain or reduced."""
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.BinOp)
        and isinstance(n.op, ast.Add)
        and isinstance(n.right, ast.Name)
        and n.right.id == "residual"
        and "hidden_states" in _names(n.left)
    ]


def _is_plain(node: ast.BinOp) -> bool:
    return same_code(node, LAYER_INPUT)


def _capture_blocks(function: ast.FunctionDef) -> list[ast.If]:
    """`if <id> in self.aux_hidden_state_layers:` blocks that append to aux_hidden_states."""
    return [
        n
        for n in ast.walk(function)
        if isinstance(n, ast.If)
        and isinstance(n.test, ast.Compare)
        and same_code(n.test.comparators[0], "self.aux_hidden_state_layers")
        and contains_code(ast.Module(body=n.body, type_ignores=[]), APPEND)
    ]


class Shape:
    """Where the parts of a known buggy forward are, or what is missing."""

    def __init__(self, function: ast.FunctionDef) -> None:
        body = function.body
        self.missing: list[str] = []
        self.capture: ast.If | None = None
        self.sum: ast.BinOp | None = None
        self.norm: ast.stmt | None = None
        self.sequence_parallel: str | None = None

        loops = [(i, s) for i, s in enumerate(body) if isinstance(s, ast.For)]
        for i, loop in loops:
            for position, stmt in enumerate(loop.body):
                if isinstance(stmt, ast.If) and same_code(stmt.test, LOOP_TEST) and not stmt.orelse:
                    later = loop.body[position + 1 :]
                    if any(_calls_layer(s) for s in later):
                        self.capture, loop_at = stmt, i
        norms = [
            (i, s)
            for i, s in enumerate(body)
            if contains_code(s, FUSED_NORM) and (same_code(s, FUSED_NORM) or isinstance(s, ast.If))
        ]
        norm_at = None
        if len(norms) == 1:
            norm_at, self.norm = norms[0]
            if isinstance(self.norm, ast.If):
                test = ast.unparse(self.norm.test)
                else_is_fused = len(self.norm.orelse) == 1 and same_code(self.norm.orelse[0], FUSED_NORM)
                then_has_fused = contains_code(ast.Module(body=self.norm.body, type_ignores=[]), FUSED_NORM)
                if test in SEQUENCE_PARALLEL and else_is_fused and not then_has_fused:
                    self.sequence_parallel = test
                else:
                    self.missing.append(
                        f"the final norm statement is `if {test}: ... else: {FUSED_NORM}` with a condition"
                        f" this fix does not know (known: {', '.join(SEQUENCE_PARALLEL)})"
                    )
        else:
            self.missing.append(f"one top-level statement that is or branches to `{FUSED_NORM}`")
        if self.capture is None:
            self.missing.append(
                f"a layer loop with `if {LOOP_TEST}: ... {APPEND}(... {LAYER_INPUT} ...)`"
                " before the layer call"
            )
        else:
            sums = _layer_sums(self.capture)
            if len(sums) == 1 and _is_plain(sums[0]):
                self.sum = sums[0]
            else:
                self.missing.append(f"exactly one `{LAYER_INPUT}` in the loop's capture block")
            if "layer" in _names(self.capture):
                self.missing.append("a capture block that does not read the loop's `layer`")
            if norm_at is not None and loop_at > norm_at:
                self.missing.append("the layer loop before the final norm")
        if not _has_init(body):
            self.missing.append(f"top-level `{INIT}`")
        if norm_at is not None:
            if not any(
                i < norm_at
                and isinstance(s, ast.If)
                and same_code(s.test, NOT_LAST_RANK)
                and isinstance(s.body[-1], ast.Return)
                for i, s in enumerate(body)
            ):
                self.missing.append(f"`if {NOT_LAST_RANK}: ... return` before the final norm")
            if not any(
                i > norm_at and isinstance(s, ast.If) and same_code(s.test, HAS_AUX)
                for i, s in enumerate(body)
            ):
                self.missing.append(f"`if {HAS_AUX}: return ...` after the final norm")


def _calls_layer(stmt: ast.stmt) -> bool:
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == LAYER_CALL
        for node in ast.walk(stmt)
    )


class _ReduceSums(ast.NodeTransformer):
    """Replace the left operand of every `hidden_states + residual` with the reduced expression."""

    def __init__(self, reduced: str) -> None:
        self.reduced = reduced

    def visit_BinOp(self, node: ast.BinOp) -> ast.BinOp:
        self.generic_visit(node)
        if same_code(node, LAYER_INPUT):
            node.left = ast.parse(self.reduced, mode="eval").body
        return node


class DeepseekV32FinalAux(Fix):
    """One vendor's DeepseekV32Model.forward (nvidia or amd file)."""

    owner = "DeepseekV32Model"
    attribute = "forward"
    fixed_in = None
    upstream = f"not fixed upstream as of vLLM {LAST_CHECKED}"
    absent = Decision.NOT_AFFECTED  # before vLLM 0.25.0 (amd: 0.27.0) V3.2 ran on DeepseekV2Model
    architectures = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")  # DeepSeek V3.2, GLM-5.x

    def __init__(self, vendor: str) -> None:
        self.vendor = vendor
        self.fix_id = f"deepseek-v32-final-aux-{vendor}"
        self.title = (
            f"DeepseekV32Model ({vendor}) returns the final layer's aux hidden state, and all-reduced"
            " states under tensor parallelism"
        )
        self.module = f"vllm.models.deepseek_v32.{vendor}.model"
        self.affected = (FIRST_AFFECTED[vendor], LAST_CHECKED)

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        try:
            function = self.parse_function(source)
        except (SyntaxError, ValueError) as error:
            return Probe(Decision.UNKNOWN, f"source could not be parsed: {error}")
        if not any(
            isinstance(n, ast.Attribute) and n.attr == "aux_hidden_state_layers" for n in ast.walk(function)
        ):
            return Probe(Decision.NOT_AFFECTED, "forward collects no aux hidden states")
        sums = [s for block in _capture_blocks(function) for s in _layer_sums(block)]
        plain = [s for s in sums if _is_plain(s)]
        if contains_code(function, FINAL_TEST):
            if sums and not plain:
                return Probe(
                    Decision.FIXED_UPSTREAM,
                    f"forward captures the final layer ({FINAL_TEST}) and reduces every captured sum",
                )
            return Probe(
                Decision.UNKNOWN,
                f"forward captures the final layer ({FINAL_TEST}) but adds un-reduced per-rank"
                f" `{LAYER_INPUT}` (or no sum this fix knows): a shape this fix does not know",
            )
        shape = Shape(function)
        if shape.missing:
            return Probe(
                Decision.UNKNOWN,
                "forward reads self.aux_hidden_state_layers but is not a known buggy shape; missing: "
                + "; ".join(shape.missing),
            )
        where = SEQUENCE_PARALLEL.get(shape.sequence_parallel or "", "no sequence parallelism")
        return Probe(
            Decision.PATCHED,
            "forward captures per-rank partial sums under tensor parallelism and never the final"
            f" layer's output ({where})",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        function = self.parse_function(text)
        shape = Shape(function)
        assert shape.capture is not None and shape.sum is not None and shape.norm is not None
        reduced = reduced_expression(shape.sequence_parallel)

        # The final capture: the loop's block with the reduced sum, for self.end_layer.
        final = _ReduceSums(reduced).visit(copy.deepcopy(shape.capture))
        final.test = ast.parse(FINAL_TEST, mode="eval").body
        final_text = textwrap.indent(ast.unparse(final) + "\n", " " * shape.norm.col_offset)

        lines = text.splitlines(keepends=True)
        # Bottom-up: the insertion before the final norm, then the edit inside the loop.
        at = shape.norm.lineno - 1
        lines[at:at] = [final_text]
        left = shape.sum.left
        line = lines[left.lineno - 1]
        lines[left.lineno - 1] = line[: left.col_offset] + reduced + line[left.end_col_offset :]
        return "".join(lines)

    def bindings(self, module: ModuleType) -> dict[str, Any]:
        from vllm import distributed

        return {
            REDUCE: distributed.tensor_model_parallel_all_reduce,
            WORLD_SIZE: distributed.get_tensor_model_parallel_world_size,
        }


DEEPSEEK_V32_FIXES: tuple[DeepseekV32FinalAux, ...] = (
    DeepseekV32FinalAux("nvidia"),
    DeepseekV32FinalAux("amd"),
)
