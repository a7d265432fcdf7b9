"""The layer loop's aux-state index under pipeline parallelism, in six models' forward.

Why: `LlamaModel`, `Qwen2Model`, `MiniCPMModel`, `StepDecoderModel` (Step1), `AfmoeModel` and
`ApertusModel`.forward iterate `enumerate(islice(self.layers, self.start_layer, self.end_layer))`
(or a slice) without `start=`, so the index they compare with the global ids of
`self.aux_hidden_state_layers` is stage-local. At PP > 1 the last stage, whose states EAGLE3 reads,
captures no state for ids beyond its layer count (the draft's `fc` fails) and silently layer
`start_layer + id` for the others (vLLM issue #36151).

How: upstream's index change, made to the installed forward: `start=self.start_layer` in that
`enumerate`, and (0.18+) the stage-input capture's id `0` becomes `self.start_layer`. At PP = 1 the
function computes what stock does; models that inherit one of these forwards are fixed with it; a
forward whose index also drives something else (HunYuan, Gemma 4) is `unknown`.

Affected releases: vLLM 0.10.0 (Llama) to 0.29.0 for Llama and Qwen2; from 0.10.2-0.16.0 to 0.34.0
and later for the others.

Upstream: Llama and Qwen2 in vLLM PR #50514, released in 0.30.0; the others not fixed as of 0.34.0
(the patch offered is in upstream/pp-aux-layer-index/).

When to drop: per model, when the oldest supported vLLM has `start=self.start_layer` in that forward.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.base import Fix, Probe, parse_function, parse_or_unknown, same_code
from vllm_hotfix.runtime.decisions import Decision

STAGE_LAYERS = (
    "islice(self.layers, self.start_layer, self.end_layer)",
    "self.layers[self.start_layer : self.end_layer]",
)
START = "self.start_layer"
HELPER = "self._maybe_add_hidden_state"
AUX_IDS = "self.aux_hidden_state_layers"
LAST_CHECKED = "0.34.0"  # the newest release whose source was read
UPSTREAM_FIX = "vLLM PR #50514, released in 0.30.0 (with the relay of earlier stages' states)"
NOT_FIXED = (
    f"not fixed upstream as of vLLM {LAST_CHECKED} (PR #50514 fixed Llama and Qwen2 only; PR #36731,"
    " the same change in these models, was closed)"
)


def _is_helper_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and same_code(node.func, HELPER)


def _stage_loops(function: ast.FunctionDef) -> list[ast.For]:
    """Top-level `for ... in enumerate(<the stage's layers>, ...)` loops."""
    return [
        s
        for s in function.body
        if isinstance(s, ast.For)
        and isinstance(s.iter, ast.Call)
        and isinstance(s.iter.func, ast.Name)
        and s.iter.func.id == "enumerate"
        and s.iter.args
        and any(same_code(s.iter.args[0], layers) for layers in STAGE_LAYERS)
    ]


def _starts_globally(call: ast.Call) -> bool:
    """`enumerate(..., start=self.start_layer)` or `enumerate(..., self.start_layer)`."""
    if len(call.args) == 2 and same_code(call.args[1], START):
        return True
    return any(k.arg == "start" and same_code(k.value, START) for k in call.keywords)


def _entry_captures(function: ast.FunctionDef, loop: ast.For) -> list[ast.Call]:
    """Helper calls in top-level statements before the loop (the capture of the stage's input)."""
    before = function.body[: function.body.index(loop)]
    return [n for s in before for n in ast.walk(s) if _is_helper_call(n)]  # type: ignore[misc]


class Shape:
    """The loop and the stage-input capture of the known buggy forward, or what is missing."""

    def __init__(self, function: ast.FunctionDef) -> None:
        self.missing: list[str] = []
        self.enumerate: ast.Call | None = None
        self.entry_id: ast.Constant | None = None  # the literal 0 of the stage-input capture
        self.form = ""
        loops = _stage_loops(function)
        if len(loops) != 1:
            self.missing.append(f"one top-level loop `for idx, layer in enumerate({STAGE_LAYERS[0]})`")
            return
        (loop,) = loops
        self.enumerate = loop.iter  # type: ignore[assignment]
        target = loop.target
        if not (
            isinstance(target, ast.Tuple)
            and len(target.elts) == 2
            and all(isinstance(e, ast.Name) for e in target.elts)
        ):
            self.missing.append("the loop target `idx, layer`")
            return
        index = target.elts[0].id  # type: ignore[attr-defined]
        body = ast.Module(body=loop.body, type_ignores=[])
        before = f"{index} in {AUX_IDS}"  # to 0.17: compared before the layer
        after = f"{HELPER}(aux_hidden_states, {index} + 1, hidden_states, residual)"  # 0.18+
        compared = [n for n in ast.walk(body) if isinstance(n, ast.Compare) and same_code(n, before)]
        captured = [n for n in ast.walk(body) if _is_helper_call(n) and same_code(n, after)]
        uses = [n for n in ast.walk(body) if isinstance(n, ast.Name) and n.id == index]
        if any(isinstance(n.ctx, ast.Store) for n in uses):
            self.missing.append(f"no assignment to the loop index `{index}` in the loop")
        if len(uses) != len(compared) + len(captured) or not uses:
            self.missing.append(
                f"the loop index `{index}` used only as a capture id (`{index} in {AUX_IDS}` or"
                f" `{HELPER}(aux_hidden_states, {index} + 1, ...)`), and at least once"
            )
        if compared and captured:
            self.missing.append("one capture form in the loop, not both")
        entries = _entry_captures(function, loop)
        if captured:
            self.form = "helper"
            first = entries[0] if len(entries) == 1 else None
            if first is None or len(first.args) < 2 or not same_code(first.args[1], "0"):
                self.missing.append(
                    f"one capture of the stage's input before the loop, `{HELPER}([], 0, hidden_states, ...)`"
                )
            else:
                self.entry_id = first.args[1]  # type: ignore[assignment]
        elif compared:
            self.form = "compare"
            if entries:
                self.missing.append(f"no {HELPER} call before a loop that compares `{index} in {AUX_IDS}`")


class PpAuxLayerIndex(Fix):
    """One model's `*Model.forward`: the layer loop's index is global (`start=self.start_layer`)."""

    owner: str
    attribute = "forward"
    absent = Decision.NOT_AFFECTED  # no such model (or class) in the release: nothing to index

    def __init__(
        self, model: str, owner: str, affected: tuple[str, str], fixed_in: str | None = None
    ) -> None:
        self.fix_id = f"pp-aux-layer-index-{model.replace('_', '-')}"
        self.module = f"vllm.model_executor.models.{model}"
        self.owner = owner
        self.title = f"{owner} captures the aux layers it is asked for on every pipeline stage"
        self.affected = affected
        self.fixed_in = fixed_in
        self.upstream = UPSTREAM_FIX if fixed_in is not None else NOT_FIXED

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        reads_aux = any(
            (isinstance(n, ast.Attribute) and n.attr == "aux_hidden_state_layers") or _is_helper_call(n)
            for n in ast.walk(function)
        )
        if not reads_aux:
            return Probe(Decision.NOT_AFFECTED, "forward collects no aux hidden states")
        loops = _stage_loops(function)
        if len(loops) == 1 and _starts_globally(loops[0].iter):  # type: ignore[arg-type]
            entries = _entry_captures(function, loops[0])
            if any(len(c.args) > 1 and same_code(c.args[1], "0") for c in entries):
                return Probe(
                    Decision.UNKNOWN,
                    f"the loop index starts at {START} but the stage's input is still captured as id 0:"
                    " a shape this fix does not know",
                )
            return Probe(
                Decision.FIXED_UPSTREAM, f"the layer loop's index is global (`enumerate(..., start={START})`)"
            )
        shape = Shape(function)
        if shape.missing:
            return Probe(
                Decision.UNKNOWN,
                "forward collects aux hidden states but is not the known stage-local-index shape; missing: "
                + "; ".join(shape.missing),
            )
        entry = f" and the stage's input is captured as id {START}, not 0" if shape.entry_id else ""
        return Probe(
            Decision.PATCHED,
            "the layer loop enumerates the stage's layers from 0 and compares that index with the global"
            " aux layer ids: at pipeline-parallel size > 1 a later stage captures other layers or none;"
            f" fixed: `enumerate(..., start={START})`{entry}, as vLLM PR #50514",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        shape = Shape(parse_function(text))
        assert shape.enumerate is not None and not shape.missing
        lines = [line.encode("utf-8") for line in text.splitlines(keepends=True)]

        def replace(node: ast.expr, new: str, keep: bool) -> None:
            """Put `new` after `node` (keep) or in its place, on its last line; nothing else moves."""
            assert node.end_lineno is not None and node.end_col_offset is not None
            row, end = node.end_lineno - 1, node.end_col_offset
            start = end if keep else node.col_offset
            assert keep or node.lineno == node.end_lineno
            lines[row] = lines[row][:start] + new.encode("utf-8") + lines[row][end:]

        replace(shape.enumerate.args[0], f", start={START}", keep=True)  # the later line first
        if shape.entry_id is not None:
            replace(shape.entry_id, START, keep=False)
        return b"".join(lines).decode("utf-8")


PP_AUX_LAYER_INDEX_FIXES: tuple[PpAuxLayerIndex, ...] = (
    PpAuxLayerIndex("llama", "LlamaModel", ("0.10.0", "0.29.0"), fixed_in="0.30.0"),
    PpAuxLayerIndex("qwen2", "Qwen2Model", ("0.10.1", "0.29.0"), fixed_in="0.30.0"),
    PpAuxLayerIndex("minicpm", "MiniCPMModel", ("0.11.0", LAST_CHECKED)),
    PpAuxLayerIndex("step1", "StepDecoderModel", ("0.15.0", LAST_CHECKED)),
    PpAuxLayerIndex("afmoe", "AfmoeModel", ("0.16.0", LAST_CHECKED)),
    PpAuxLayerIndex("apertus", "ApertusModel", ("0.10.2", LAST_CHECKED)),
)
