"""DeepseekV32Model's aux hidden states: the final layer never captured, every state wrong under TP.

Why: the forward (vllm/models/deepseek_v32/{nvidia,amd}/model.py) captures the *input* of each
requested layer, never the final layer's output (id num_hidden_layers), as DeepseekV2Model did; and
under tensor parallelism the decoder layers leave their outputs un-reduced for the next fused norm
(`fused_allreduce_rms_norm`), so each captured `hidden_states + residual` is a rank's partial sum:
wrong at TP > 1, and different on each rank. Id 0 is the embedding tensor layer 0 then keeps (and
vLLM's CUDA norms add into) as its residual.

How: derived from the installed forward: each capture is the sum the next fused norm computes (an
all-reduce of a copy where that norm reduces, none at TP = 1: stock's graph), or, where the layer
takes a pre-normed input, the layer's own fused input norm run in the loop; id 0 a copy; the final
id the final fused norm's second output (no added collective). The steps are below.

Affected releases: vLLM 0.25.0 to 0.34.0 (nvidia; amd from 0.27.0) and later, until upstream fixes it.

Upstream: not fixed as of vLLM 0.34.0; a series of three patches is offered in
upstream/deepseek-v32-final-layer/, upstream/deepseek-v32-id0-copy/ and upstream/deepseek-v32-tp-sum/.

When to drop: when upstream fixes `DeepseekV32Model.forward` and the project no longer supports the
releases without that fix.

The steps, each derived from the installed source:
- In the loop's capture, `hidden_states + residual` becomes
  `(all_reduce(hidden_states.clone()) if <the next norm reduces> else hidden_states) + residual`:
  the value that the following fused norm computes as its new residual. "The next norm reduces" is
  `TP > 1 and not COND`, where COND is read from vLLM's own final-norm statement
  (`if COND: <sequence-parallel norm> else: fused_allreduce_rms_norm(...)`; no COND where the norm
  is unconditional). Only the known CONDs are accepted; each was checked against its release's
  decoder layer, which reduces its input under exactly the same condition. At TP = 1 the condition
  is False when traced: the graph is stock's, with no collective. `.clone()`: some communicators
  (vLLM's CPU one) reduce in place, and the un-reduced value must still reach the next layer.
- Where the layer takes a pre-normed input (nvidia 0.29+: `layer(positions, hidden_states, residual,
  attn_in)`, its shape confirmed in the module's DeepseekV32DecoderLayer.forward), the capture at
  TP > 1 (not sequence-parallel, not the first layer) runs the layer's own fused input norm in the
  loop, keeps a copy of its residual output as the state and passes (that sum, None, attn_in=normed)
  to the layer, which then makes no norm call of its own: no collective added, the same values.
- Id 0 (the embeddings, captured before layer 0 while `residual` is None) becomes a copy:
  `hidden_states.clone() if residual is None else <the sum>`, inside the capture's membership test,
  so the copy is made only when id 0 is requested. Stock (nvidia 0.28+) appends the embedding tensor
  itself, which layer 0 then keeps as its `residual`; vLLM's CUDA norms add into `residual` in place,
  so id 0 ends up holding a later layer's stream. Where stock has no `residual is None` branch
  (nvidia 0.25-0.27, amd) it raises TypeError for id 0; patched, id 0 is the embeddings, as vLLM
  0.28+ defines it.
- The final layer's state is the final fused norm's second output (`hidden_states, final_state =
  fused_allreduce_rms_norm(...)`), appended after it: no collective. On the sequence-parallel branch
  (already reduced there) the loop's capture block, for `self.end_layer`, is inserted before the
  norm statement, after the non-last-pipeline-rank return, so it joins the packed all-gather.
"""

from __future__ import annotations

import ast
import copy
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.aux_capture import FINAL_TEST, REDUCE, WORLD_SIZE, TensorParallelCapture
from vllm_hotfix.fixes.base import Probe, contains_code, parse_function, parse_or_unknown, same_code
from vllm_hotfix.runtime.decisions import Decision

INIT = "aux_hidden_states = []"
LOOP_TEST = "idx in self.aux_hidden_state_layers"
NOT_LAST_RANK = "not get_pp_group().is_last_rank"
HAS_AUX = "len(aux_hidden_states) > 0"
FUSED_NORM = "hidden_states, _ = fused_allreduce_rms_norm(hidden_states, residual, self.norm)"
APPEND = "aux_hidden_states.append"
LAYER_INPUT = "hidden_states + residual"  # what the stock loop captures: a per-rank partial at TP > 1
LAYER_CALL = "layer"  # the loop's decoder-layer call, `... = layer(positions, hidden_states, ...)`
# vLLM 0.29+ (nvidia): the layer takes a pre-normed attention input, so the loop can run the layer's
# own fused input norm itself and keep its residual output as the state (no collective added).
PRE_NORMED_CALL = "hidden_states, residual = layer(positions, hidden_states, residual, attn_in)"
LAYER_CLASS = "DeepseekV32DecoderLayer"
LAYER_FIRST = (
    "residual = hidden_states",
    "hidden_states = attn_in if attn_in is not None else self.input_layernorm(hidden_states)",
)
LAYER_SP_TEST = "self.use_sequence_parallel"
LAYER_INPUT_NORM = (
    "hidden_states, residual = fused_allreduce_rms_norm(hidden_states, residual, self.input_layernorm)"
)
FINAL_STATE = "final_state"  # the final fused norm's second output, kept instead of `_`
FIRST_AFFECTED = {"nvidia": "0.25.0", "amd": "0.27.0"}  # the first releases with these files
LAST_CHECKED = "0.34.0"  # the newest release whose source was read

# The conditions under which vLLM's final norm takes its sequence-parallel (already reduced) branch,
# each checked against the decoder layer of the releases that use it (module docstring).
SEQUENCE_PARALLEL = {
    "self.use_sequence_parallel": "vLLM 0.28+: one model-wide sequence-parallel switch",
    "hidden_states.shape[0] != full_num_tokens": "vLLM 0.26-0.27: per-layer sequence-parallel MoE",
}
REDUCERS = (REDUCE, "fused_allreduce_rms_norm")  # a capture block that calls one reduces the sum
REDUCED_TEMPLATE = f"({REDUCE}(hidden_states.clone()) if {{condition}} else hidden_states)"
ENTRY_TEST = "residual is None"  # before layer 0 (first pipeline rank): the capture is id 0
ENTRY_COPY = "hidden_states.clone()"  # id 0: the embeddings, never the tensor layer 0 keeps as residual


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


def _reduces(block: ast.If) -> bool:
    """The capture block itself calls an all-reduce, plain or fused into the next layer's norm (the
    upstream form where the layer takes a pre-normed input: upstream/deepseek-v32.patch)."""
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in REDUCERS
        for n in ast.walk(block)
    )


def _captures_alias(block: ast.If) -> bool:
    """The capture block appends the bare `hidden_states` (id 0's alias of layer 0's residual)."""
    return any(
        isinstance(n, ast.IfExp) and same_code(n.body, "hidden_states") and same_code(n.test, ENTRY_TEST)
        for n in ast.walk(block)
    ) or contains_code(block, f"{APPEND}(hidden_states)")


def layer_takes_pre_normed(module_source: str | None) -> str | None:
    """None when the module's decoder layer runs `attn_in` as its normed input and the residual it is
    given as its residual when `residual is None`, and otherwise fuses its input all-reduce exactly
    as the loop would (`LAYER_INPUT_NORM` unless sequence-parallel); else what is missing."""
    if module_source is None:
        return "the model module's source (to read the decoder layer)"
    try:
        tree = ast.parse(module_source)
    except SyntaxError:
        return "a parsable model module"
    forwards = [
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name == LAYER_CLASS
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "forward"
    ]
    if len(forwards) != 1:
        return f"one {LAYER_CLASS}.forward"
    (forward,) = forwards
    if [a.arg for a in forward.args.args] != ["self", "positions", "hidden_states", "residual", "attn_in"]:
        return f"{LAYER_CLASS}.forward(self, positions, hidden_states, residual, attn_in)"
    for stmt in forward.body:
        if not (isinstance(stmt, ast.If) and same_code(stmt.test, "residual is None")):
            continue
        first = len(stmt.body) == 2 and all(
            same_code(a, b) for a, b in zip(stmt.body, LAYER_FIRST, strict=True)
        )
        rest = stmt.orelse[0] if len(stmt.orelse) == 1 else None
        fused = (
            isinstance(rest, ast.If)
            and same_code(rest.test, LAYER_SP_TEST)
            and len(rest.orelse) == 1
            and same_code(rest.orelse[0], LAYER_INPUT_NORM)
        )
        if first and fused:
            return None
    return (
        f"in {LAYER_CLASS}.forward: `if residual is None: {'; '.join(LAYER_FIRST)} elif {LAYER_SP_TEST}:"
        f" ... else: {LAYER_INPUT_NORM}`"
    )


def _loop_calls(function: ast.FunctionDef, call: str) -> bool:
    return any(isinstance(s, ast.For) and any(same_code(t, call) for t in s.body) for s in function.body)


def zero_collective_capture(capture: ast.If) -> ast.If:
    """The loop's capture block where the layer takes a pre-normed input: at TP > 1 (not sequence-
    parallel, not the first layer) the loop runs the layer's own fused input norm, keeps a copy of
    its residual output (the all-reduced pre-norm sum) as the state, and hands the layer that sum as
    its residual with the normed value as `attn_in`: the same call, inputs and outputs as inside the
    layer, so the model's output is unchanged and no collective is added. Elsewhere, today's form."""
    condition = (
        f"residual is not None and {WORLD_SIZE}() > 1 and not layer.{LAYER_SP_TEST.removeprefix('self.')}"
    )
    free = ast.parse(
        "attn_in, hidden_states = fused_allreduce_rms_norm(hidden_states, residual, layer.input_layernorm)\n"
        "residual = None\n"
        f"{APPEND}(hidden_states.clone())\n"
    ).body
    block = copy.deepcopy(capture)
    block.body = [ast.If(test=ast.parse(condition, mode="eval").body, body=free, orelse=block.body)]
    return block


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


def entry_form(capture: ast.If) -> str:
    """How stock's capture treats id 0: 'alias' (`hidden_states if residual is None else ...`:
    the embedding tensor itself) or 'raises' (`hidden_states + residual` with residual None)."""
    guarded = any(
        isinstance(n, ast.IfExp) and same_code(n.test, ENTRY_TEST) and same_code(n.body, "hidden_states")
        for n in ast.walk(capture)
    )
    return "alias" if guarded else "raises"


ENTRY_REASON = {
    "alias": "id 0 (the embeddings) captured as a copy (stock's is the tensor layer 0 keeps as residual,"
    " which vLLM's in-place CUDA norms overwrite)",
    "raises": "id 0 captured as the embeddings (a copy; stock raises TypeError: residual is None there)",
}


class _EntryCopy(ast.NodeTransformer):
    """Id 0 as a copy of the embedding stream: the `residual is None` branch's `hidden_states`
    becomes `hidden_states.clone()`; an unguarded `hidden_states + residual` gains that branch."""

    def visit_IfExp(self, node: ast.IfExp) -> ast.IfExp:
        if same_code(node.test, ENTRY_TEST) and same_code(node.body, "hidden_states"):
            node.body = ast.parse(ENTRY_COPY, mode="eval").body
            return node  # its `else` is the sum of a later layer: left as it is
        self.generic_visit(node)
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        if same_code(node, LAYER_INPUT):
            return ast.parse(f"{ENTRY_COPY} if {ENTRY_TEST} else {LAYER_INPUT}", mode="eval").body
        self.generic_visit(node)
        return node


class _ReduceSums(ast.NodeTransformer):
    """Replace the left operand of every `hidden_states + residual` with the reduced expression."""

    def __init__(self, reduced: str) -> None:
        self.reduced = reduced

    def visit_BinOp(self, node: ast.BinOp) -> ast.BinOp:
        self.generic_visit(node)
        if same_code(node, LAYER_INPUT):
            node.left = ast.parse(self.reduced, mode="eval").body
        return node


class DeepseekV32FinalAux(TensorParallelCapture):
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
        self.related = (self.module,)  # the decoder layer, read where the loop passes `attn_in`

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if not any(
            isinstance(n, ast.Attribute) and n.attr == "aux_hidden_state_layers" for n in ast.walk(function)
        ):
            return Probe(Decision.NOT_AFFECTED, "forward collects no aux hidden states")
        blocks = _capture_blocks(function)
        sums = [s for block in blocks for s in _layer_sums(block)]
        plain = [s for s in sums if _is_plain(s)]
        if contains_code(function, FINAL_TEST):
            if sums and not plain:
                return Probe(
                    Decision.FIXED_UPSTREAM,
                    f"forward captures the final layer ({FINAL_TEST}) and reduces every captured sum",
                )
            if any(_reduces(block) for block in blocks) and not any(_captures_alias(b) for b in blocks):
                return Probe(
                    Decision.FIXED_UPSTREAM,
                    f"forward captures the final layer ({FINAL_TEST}), reduces the partial sum before its"
                    " capture (a sum left plain is then the sequence-parallel one) and copies id 0",
                )
            return Probe(
                Decision.UNKNOWN,
                f"forward captures the final layer ({FINAL_TEST}) but adds un-reduced per-rank"
                f" `{LAYER_INPUT}` (or no sum this fix knows): a shape this fix does not know",
            )
        shape = Shape(function)
        pre_normed = _loop_calls(function, PRE_NORMED_CALL)
        if pre_normed and (missing := layer_takes_pre_normed((related or {}).get(self.module))):
            shape.missing.append(missing)
        if shape.missing:
            return Probe(
                Decision.UNKNOWN,
                "forward reads self.aux_hidden_state_layers but is not a known buggy shape; missing: "
                + "; ".join(shape.missing),
            )
        where = SEQUENCE_PARALLEL.get(shape.sequence_parallel or "", "no sequence parallelism")
        form = (
            "the loop runs the next layer's own fused input norm: no collective added"
            if pre_normed
            else "one all-reduce per requested inner layer (the layer takes no pre-normed input)"
        )
        assert shape.capture is not None
        return Probe(
            Decision.PATCHED,
            "forward captures per-rank partial sums under tensor parallelism and never the final"
            f" layer's output ({where}); fixed: {form}, the final state from the final fused norm,"
            f" {ENTRY_REASON[entry_form(shape.capture)]}",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        function = parse_function(text)
        shape = Shape(function)
        assert shape.capture is not None and shape.sum is not None and shape.norm is not None
        reduced = reduced_expression(shape.sequence_parallel)
        lines = text.splitlines(keepends=True)

        # Bottom-up. The final state: the final fused norm's second output (no collective).
        fused = shape.norm if shape.sequence_parallel is None else shape.norm.orelse[0]  # type: ignore[attr-defined]
        pad = " " * fused.col_offset
        final_norm = FUSED_NORM.replace("hidden_states, _ =", f"hidden_states, {FINAL_STATE} =")
        lines[fused.lineno - 1 : fused.end_lineno] = [
            f"{pad}{final_norm}\n{pad}if {FINAL_TEST}:\n{pad}    {APPEND}({FINAL_STATE})\n"
        ]
        if shape.sequence_parallel is not None:
            # On the sequence-parallel branch the sum is already reduced: the loop's block, before
            # the norm statement, so that the state joins vLLM's packed all-gather.
            final = _ReduceSums(reduced).visit(copy.deepcopy(shape.capture))
            final.test = ast.parse(f"{FINAL_TEST} and ({shape.sequence_parallel})", mode="eval").body
            at = shape.norm.lineno - 1
            lines[at:at] = [textwrap.indent(ast.unparse(final) + "\n", " " * shape.norm.col_offset)]

        # The loop's capture: id 0 a copy; reduced where the next norm reduces; free where the layer
        # is pre-normed.
        capture = _ReduceSums(reduced).visit(_EntryCopy().visit(copy.deepcopy(shape.capture)))
        if _loop_calls(function, PRE_NORMED_CALL):
            capture = zero_collective_capture(capture)
        block = textwrap.indent(ast.unparse(capture) + "\n", " " * shape.capture.col_offset)
        lines[shape.capture.lineno - 1 : shape.capture.end_lineno] = [block]
        return "".join(lines)


DEEPSEEK_V32_FIXES: tuple[DeepseekV32FinalAux, ...] = (
    DeepseekV32FinalAux("nvidia"),
    DeepseekV32FinalAux("amd"),
)
