"""What a fix is: a target function, a probe of its source, and a source transform.

A fix never trusts the version number alone: the probe reads the loaded function's source and says
whether it has the known buggy shape. The transform then derives the fixed function from that same
source, so nothing of vLLM is copied into this package.
"""

from __future__ import annotations

import ast
import functools
import textwrap

from vllm_hotfix.runtime.decisions import Decision
from vllm_hotfix.runtime.fix import Fix, Probe

__all__ = ["Fix", "Probe", "contains_code", "parse_function", "parse_or_unknown", "reads_key", "same_code"]


def parse_function(source: str) -> ast.FunctionDef:
    """The one function definition `source` holds; ValueError for anything else."""
    tree = ast.parse(textwrap.dedent(source))
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        raise ValueError("the source is not a single function definition")
    return tree.body[0]


def parse_or_unknown(source: str) -> ast.FunctionDef | Probe:
    """What each probe starts with: the function `source` defines, or the `unknown` verdict that
    says why it could not be parsed (a probe returns the Probe as it is)."""
    try:
        return parse_function(source)
    except (SyntaxError, ValueError) as error:
        return Probe(Decision.UNKNOWN, f"source could not be parsed: {error}")


@functools.cache
def _expected(expected: str) -> tuple[type, str]:
    parsed = ast.parse(expected).body[0]
    if isinstance(parsed, ast.Expr):
        # a bare expression matches as an expression; a call statement is matched via its Expr
        return type(parsed.value), ast.dump(parsed.value)
    return type(parsed), ast.dump(parsed)


def same_code(node: ast.AST, expected: str) -> bool:
    """Whether `node` is the statement or expression `expected`, ignoring layout and comments."""
    kind, dump = _expected(expected)
    if isinstance(node, ast.Expr) and kind is not ast.Expr:
        node = node.value
    return type(node) is kind and ast.dump(node) == dump


def contains_code(tree: ast.AST, expected: str) -> bool:
    """Whether any node under `tree` is `expected`."""
    return any(same_code(node, expected) for node in ast.walk(tree))


def reads_key(tree: ast.AST, key: str) -> bool:
    """Whether any node under `tree` reads `key` from a mapping: `x.get(key...)` or `x[key]`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and first.value == key:
                return True
        index = node.slice if isinstance(node, ast.Subscript) else None
        if isinstance(index, ast.Constant) and index.value == key:
            return True
    return False
