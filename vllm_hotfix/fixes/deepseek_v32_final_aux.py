"""DeepseekV32Model (vllm/models/deepseek_v32/{nvidia,amd}/model.py) misses the final aux state too.

A report-only probe, deliberately NOT in ALL_FIXES: it classifies releases (`vllm-hotfix releases`)
and never patches. The forward has DeepseekV2Model's bug (it captures the inputs of the requested
layers, never the last layer's output), but its final norm is fused with the tensor-parallel
all-reduce, `fused_allreduce_rms_norm(hidden_states, residual, self.norm)`: under TP > 1 the
`hidden_states` it is given is each rank's un-reduced partial, so upstream's one-line repair,
appending `hidden_states + residual` before the norm, would capture a wrong, per-rank sum. A
correct fix needs the all-reduced sum and changes GPU numerics and collectives, which nobody can
check on a CPU; until it is verified on GPUs, the hotfix only reports these forwards. (By the same
reading, the captures inside the layer loop are per-rank partials under TP > 1 as well: each layer
leaves its MLP/MoE output un-reduced for the next fused norm.)
"""

from __future__ import annotations

import ast
from collections.abc import Mapping

from vllm_hotfix.fixes.aux_capture import verdict_from_checks, verdict_without_shape
from vllm_hotfix.fixes.base import Fix, Probe, Verdict, contains_code, same_code
from vllm_hotfix.fixes.deepseek_final_aux import HAS_AUX, INIT, LOOP_TEST, NOT_LAST_RANK

FUSED_NORM = "hidden_states, _ = fused_allreduce_rms_norm(hidden_states, residual, self.norm)"
APPEND = "aux_hidden_states.append"
LAYER_INPUT = "hidden_states + residual"  # what the loop captures: the input of layer idx
LAYER_CALL = "layer"  # the loop's decoder-layer call, `... = layer(positions, hidden_states, ...)`
FIRST_AFFECTED = {"nvidia": "0.25.0", "amd": "0.27.0"}  # the first releases with these files
AFFECTED = "affected, not patched"  # how the releases table shows BUGGY for a report-only probe
WHY_NO_PATCH = (
    "the final norm is fused with the tensor-parallel all-reduce"
    " (fused_allreduce_rms_norm(hidden_states, residual, self.norm)): before it, hidden_states is a"
    " per-rank partial, so `hidden_states + residual` is not the final layer's output under TP > 1;"
    " a correct fix needs the all-reduced sum, changes GPU numerics and collectives, and stays off"
    " until verified on GPUs"
)


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


def _calls_layer(stmt: ast.stmt) -> bool:
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == LAYER_CALL
        for node in ast.walk(stmt)
    )


def _captures_layer_input(stmt: ast.stmt) -> bool:
    """`if idx in self.aux_hidden_state_layers:` appending something built from `hidden_states + residual`.

    vLLM 0.26 and 0.27 all-gather the sequence-parallel shards inside that block; later releases
    append the sum directly: both are the known shape.
    """
    if not isinstance(stmt, ast.If) or not same_code(stmt.test, LOOP_TEST) or stmt.orelse:
        return False
    block = ast.Module(body=stmt.body, type_ignores=[])
    appends = any(isinstance(node, ast.Call) and same_code(node.func, APPEND) for node in ast.walk(block))
    return appends and contains_code(block, LAYER_INPUT)


def _loop_captures_inputs(body: list[ast.stmt]) -> bool:
    """A layer loop that captures a layer's input before it calls the layer."""
    for loop in body:
        if not isinstance(loop, ast.For):
            continue
        captured = False
        for stmt in loop.body:
            if _captures_layer_input(stmt):
                captured = True
            elif captured and _calls_layer(stmt):
                return True
    return False


def _top_level_if_returns(body: list[ast.stmt], test: str) -> list[int]:
    return [
        i
        for i, stmt in enumerate(body)
        if isinstance(stmt, ast.If) and same_code(stmt.test, test) and isinstance(stmt.body[-1], ast.Return)
    ]


class DeepseekV32FinalAux(Fix):
    """One vendor's DeepseekV32Model.forward; report only (see the module docstring)."""

    owner = "DeepseekV32Model"
    attribute = "forward"
    upstream = "not fixed upstream as of vLLM 0.33.0"
    absent = Verdict.NOT_AFFECTED  # before vLLM 0.25.0 (amd: 0.27.0) V3.2 ran on DeepseekV2Model
    report_only = True  # never in ALL_FIXES; transform_source refuses

    def __init__(self, vendor: str) -> None:
        self.vendor = vendor
        self.fix_id = f"deepseek-v32-final-aux-{vendor}"
        self.title = f"DeepseekV32Model ({vendor}) returns the final layer's aux hidden state (report only)"
        self.module = f"vllm.models.deepseek_v32.{vendor}.model"
        self.affected = (FIRST_AFFECTED[vendor], "0.33.0")

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = verdict_without_shape(source)
        if isinstance(function, Probe):
            return function

        body = function.body
        norm_top = [i for i, stmt in enumerate(body) if contains_code(stmt, FUSED_NORM)]
        norm_at = norm_top[0] if len(norm_top) == 1 else None
        checks = {
            f"one top-level statement holding `{FUSED_NORM}`": norm_at is not None,
            f"top-level `{INIT}`": _has_init(body),
            f"a layer loop with `if {LOOP_TEST}: {APPEND}(... {LAYER_INPUT} ...)`"
            " before the layer call": _loop_captures_inputs(body),
            f"`if {NOT_LAST_RANK}: ... return` before the norm": norm_at is not None
            and any(i < norm_at for i in _top_level_if_returns(body, NOT_LAST_RANK)),
            f"`if {HAS_AUX}: return ...` after the norm": norm_at is not None
            and any(i > norm_at for i in _top_level_if_returns(body, HAS_AUX)),
        }
        return verdict_from_checks(
            checks,
            "forward captures the inputs of the requested layers and never the final layer's output;"
            f" not patched: {WHY_NO_PATCH}",
        )

    def transform_source(self, source: str) -> str:
        raise NotImplementedError(f"{self.fix_id} is report-only: {WHY_NO_PATCH}")


REPORT_ONLY_FIXES: tuple[DeepseekV32FinalAux, ...] = (
    DeepseekV32FinalAux("nvidia"),
    DeepseekV32FinalAux("amd"),
)
