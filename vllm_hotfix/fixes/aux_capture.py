"""What every probe of an aux-hidden-state forward shares: the first two verdicts, which need no
shape check, and the last step, which turns a list of shape checks into a verdict."""

from __future__ import annotations

import ast

from vllm_hotfix.fixes.base import Probe, contains_code, parse_function
from vllm_hotfix.runtime.decisions import Decision

FINAL_TEST = "self.end_layer in self.aux_hidden_state_layers"


def verdict_without_shape(source: str) -> ast.FunctionDef | Probe:
    """Parse the forward and decide at once where its shape does not matter: UNKNOWN (unparsable),
    NOT_AFFECTED (no aux capture at all), FIXED_UPSTREAM (captures end_layer); else the function."""
    try:
        function = parse_function(source)
    except (SyntaxError, ValueError) as error:
        return Probe(Decision.UNKNOWN, f"source could not be parsed: {error}")
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
