"""What the fixes of aux-hidden-state forwards share: the first verdicts of a probe, which need no
shape check, and its last step, which turns a list of shape checks into a verdict; and the
tensor-parallel names a fixed forward that all-reduces a captured state calls."""

from __future__ import annotations

import ast
from abc import ABC
from types import ModuleType
from typing import Any

from vllm_hotfix.fixes.base import Fix, Probe, contains_code, parse_or_unknown
from vllm_hotfix.runtime.decisions import Decision

FINAL_TEST = "self.end_layer in self.aux_hidden_state_layers"
# vLLM's collective and tensor-parallel size, as a fixed forward calls them (TensorParallelCapture)
REDUCE = "tensor_model_parallel_all_reduce"
WORLD_SIZE = "get_tensor_model_parallel_world_size"


class TensorParallelCapture(Fix, ABC):
    """A fix whose fixed forward all-reduces a captured state: it binds REDUCE and WORLD_SIZE,
    which the model's module does not import, to vLLM's own (imported when the fix is patched)."""

    def bindings(self, module: ModuleType) -> dict[str, Any]:
        from vllm import distributed

        return {
            REDUCE: distributed.tensor_model_parallel_all_reduce,
            WORLD_SIZE: distributed.get_tensor_model_parallel_world_size,
        }


def verdict_without_shape(source: str) -> ast.FunctionDef | Probe:
    """Parse the forward and decide at once where its shape does not matter: UNKNOWN (unparsable),
    NOT_AFFECTED (no aux capture at all), FIXED_UPSTREAM (captures end_layer); else the function."""
    function = parse_or_unknown(source)
    if isinstance(function, Probe):
        return function
    reads_aux = any(
        isinstance(node, ast.Attribute) and node.attr == "aux_hidden_state_layers"
        for node in ast.walk(function)
    )
    if not reads_aux:
        return Probe(Decision.NOT_AFFECTED, "forward collects no aux hidden states")
    if contains_code(function, FINAL_TEST):
        return Probe(Decision.FIXED_UPSTREAM, f"forward already captures the final layer ({FINAL_TEST})")
    return function


def verdict_from_checks(checks: dict[str, bool], buggy_reason: str) -> Probe:
    """PATCHED when every named shape check holds, else UNKNOWN naming what is missing."""
    missing = [name for name, present in checks.items() if not present]
    if missing:
        return Probe(
            Decision.UNKNOWN,
            "forward reads self.aux_hidden_state_layers but is not the known buggy shape;"
            " missing: " + "; ".join(missing),
        )
    return Probe(Decision.PATCHED, buggy_reason)
