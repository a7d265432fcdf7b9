"""What a fix is: a target function, a probe of its source, and a source transform.

A fix never trusts the version number alone: the probe reads the loaded function's source and says
whether it has the known buggy shape. The transform then derives the fixed function from that same
source, so nothing of vLLM is copied into this package.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import FunctionType, ModuleType
from typing import Any

from vllm_hotfix.runtime.decisions import Decision


@dataclass(frozen=True)
class Probe:
    """What a probe concluded about a source: one of decisions.VERDICTS, and why."""

    verdict: Decision
    reason: str


class Fix(ABC):
    """One repair of one function. Subclasses set the class attributes and the two methods."""

    fix_id: str  # stable, used in VLLMHOTFIX_DISABLE, logs and markers
    title: str
    module: str  # the module whose import triggers the fix
    owner: str | None  # class that holds the function, or None for a module-level function
    attribute: str  # the function's name
    affected: tuple[str, str]  # first and last release known to carry the bug (corroboration only)
    fixed_in: str | None  # the first release with upstream's fix; None while upstream has none
    upstream: str  # where upstream fixed it, or that it has not
    related: tuple[str, ...] = ()  # other modules whose source the probe reads (never imported)
    absent: Decision = Decision.UNKNOWN  # the verdict when the target does not exist at all
    # Model architectures (keys of vLLM's model registry) whose model lives in `module`. Release
    # tooling only: it reads each wheel's registry to say whether they reach `module` by default
    # or only through `model_class_overrides`. Empty: no such claim (the table says just "patched").
    architectures: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        owner = f"{self.owner}." if self.owner else ""
        return f"{self.module}.{owner}{self.attribute}"

    @abstractmethod
    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        """Classify the target function's source text (as inspect.getsource returns it).

        `related` maps each module named in `self.related` to its source text (None if absent).
        """

    @abstractmethod
    def transform_source(self, source: str) -> str:
        """Return the fixed function's source, dedented. Only called on a PATCHED verdict."""

    # -- where the function lives; fixes with extra references override put() --------------
    def holder(self, module: ModuleType) -> Any:
        return module if self.owner is None else getattr(module, self.owner)

    def current(self, module: ModuleType) -> Any:
        """The object installed now, read without descriptors (a plain function, or whatever)."""
        holder = self.holder(module)
        if self.owner is None:
            return holder.__dict__.get(self.attribute)
        return vars(holder).get(self.attribute)

    def put(self, module: ModuleType, function: FunctionType, replacing: FunctionType) -> None:
        """Put `function` where `replacing` is now: the fixed function in place of the original
        (patching.patch), and the original back in place of the fixed one (patching.unpatch)."""
        setattr(self.holder(module), self.attribute, function)

    def class_cell(self, module: ModuleType, function: FunctionType) -> type | None:
        """The owner class, when it is what the method's only closure cell holds: the `__class__`
        cell the compiler makes for zero-argument `super()`. None for any other closure.

        Such a method is no closure in the sense that matters: its fixed source is built with
        `__class__` bound to that class (patching.patch), so its `super()` resolves as vLLM's did."""
        if self.owner is None or function.__code__.co_freevars != ("__class__",):
            return None
        closure = function.__closure__ or ()
        try:
            held = closure[0].cell_contents if len(closure) == 1 else None
        except ValueError:  # an empty cell
            return None
        return held if held is self.holder(module) else None

    def bindings(self, module: ModuleType) -> dict[str, Any]:
        """Names the fixed source uses that the target's module does not define (none by default)."""
        return {}

    # -- shared helpers for source probes -----------------------------------------------------
    @staticmethod
    def parse_function(source: str) -> ast.FunctionDef:
        tree = ast.parse(textwrap.dedent(source))
        if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
            raise ValueError("the source is not a single function definition")
        return tree.body[0]


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
