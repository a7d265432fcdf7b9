"""Whether vLLM's model registry sends a fix's architectures to the fix's module, read from a wheel.

A probe says a file is buggy; whether anyone runs that file by default is the registry's choice.
`vllm/model_executor/models/registry.py` maps each architecture to (module, class). The module may
be a package whose `__init__` picks the class per platform (`if current_platform.is_cuda(): from
.nvidia.model import ...`), so the route is followed through the fix module's ancestor packages.
Everything is read as text with `ast`, nothing imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from vllm_hotfix.fixes import Fix

REGISTRY_MODULE = "vllm.model_executor.models.registry"
RELATIVE_BASE = "vllm.model_executor.models"  # where the registry's bare module names live
PLATFORMS = {"cuda": "CUDA", "rocm": "ROCm", "xpu": "XPU", "cpu": "CPU", "tpu": "TPU"}

# (a test, whether the branch taken is the one where it holds)
Condition = tuple[ast.expr, bool]


@dataclass(frozen=True)
class Route:
    """How the registry reaches a fix's module: by default (where), only by override, or unknown."""

    default: bool | None  # None: the registry (or a package on the way) could not be read
    where: str | None = None  # the platform condition of a default route; None: unconditional
    reason: str = ""

    @property
    def label(self) -> str:
        """The short phrase the table and `python -m harness.releases` show after the verdict."""
        if self.default is None:
            return "registry route unknown"
        if not self.default:
            return "only with model_class_overrides"
        if self.where and self.where.startswith("not "):
            return f"registry default except on {self.where.removeprefix('not ')}"
        return f"registry default on {self.where}" if self.where else "registry default"


def package_init(module: str) -> str:
    return module.replace(".", "/") + "/__init__.py"


def route_members(fix: Fix) -> list[str]:
    """The wheel members a route needs: the registry, and every package between `vllm` and the module."""
    if not fix.architectures:
        return []
    base = REGISTRY_MODULE.replace(".", "/")
    parts = fix.module.split(".")
    packages = [".".join(parts[:i]) for i in range(2, len(parts))]
    return [f"{base}/__init__.py", f"{base}.py", *(package_init(p) for p in packages)]


def registry_entries(source: str) -> dict[str, set[tuple[str, str]]]:
    """Every `"Arch": ("module", "Class")` entry of the registry's module-level dicts, by architecture.

    Module names are resolved as vLLM's `_resolve_module_name` does: `vllm.` names are absolute,
    others live in vllm.model_executor.models. SyntaxError propagates.
    """
    entries: dict[str, set[tuple[str, str]]] = {}
    for stmt in ast.parse(source).body:
        value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for key, item in zip(value.keys, value.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                continue
            if not (isinstance(item, ast.Tuple) and len(item.elts) == 2):
                continue
            module, cls = (e.value if isinstance(e, ast.Constant) else None for e in item.elts)
            if isinstance(module, str) and isinstance(cls, str):
                resolved = module if module.startswith("vllm.") else f"{RELATIVE_BASE}.{module}"
                entries.setdefault(key.value, set()).add((resolved, cls))
    return entries


def _imports(
    body: list[ast.stmt], conditions: tuple[Condition, ...]
) -> Iterator[tuple[ast.ImportFrom, tuple[Condition, ...]]]:
    """Every `from ... import ...` in a module body, with the if/else branches that lead to it."""
    for stmt in body:
        if isinstance(stmt, ast.ImportFrom):
            yield stmt, conditions
        elif isinstance(stmt, ast.If):
            yield from _imports(stmt.body, (*conditions, (stmt.test, True)))
            yield from _imports(stmt.orelse, (*conditions, (stmt.test, False)))
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from _imports(block, conditions)


def _source_module(package: str, stmt: ast.ImportFrom) -> str:
    """The absolute module a package's `from ... import` reads (relative imports resolved)."""
    if not stmt.level:
        return stmt.module or ""
    parts = package.split(".")[: len(package.split(".")) - (stmt.level - 1)]
    return ".".join([*parts, stmt.module] if stmt.module else parts)


def _platform(test: ast.expr) -> str | None:
    """`current_platform.is_cuda()` -> "CUDA"; None for any other test."""
    if (
        isinstance(test, ast.Call)
        and not test.args
        and isinstance(test.func, ast.Attribute)
        and isinstance(test.func.value, ast.Name)
        and test.func.value.id == "current_platform"
        and test.func.attr.startswith("is_")
    ):
        name = test.func.attr.removeprefix("is_")
        return PLATFORMS.get(name, name)
    return None


def _runtime(test: ast.expr, holds: bool) -> Condition:
    """The condition as it is at run time: `TYPE_CHECKING or X` is X (TYPE_CHECKING is False), and
    `not X` holding is X not holding."""
    if (
        isinstance(test, ast.BoolOp)
        and isinstance(test.op, ast.Or)
        and len(test.values) == 2
        and isinstance(test.values[0], ast.Name)
        and test.values[0].id == "TYPE_CHECKING"
    ):
        return _runtime(test.values[1], holds)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _runtime(test.operand, not holds)
    return test, holds


def describe(conditions: tuple[Condition, ...]) -> str | None:
    """A branch's conditions in words: "CUDA", "not ROCm/XPU"; None when unconditional."""
    if not conditions:
        return None
    conditions = tuple(_runtime(test, holds) for test, holds in conditions)
    named = [(name, holds) for test, holds in conditions if (name := _platform(test)) is not None]
    if len(named) == len(conditions):
        taken = [name for name, holds in named if holds]  # platforms exclude each other
        return " and ".join(taken) if taken else "not " + "/".join(name for name, _ in named)
    return " and ".join(ast.unparse(t) if holds else f"not ({ast.unparse(t)})" for t, holds in conditions)


def _reach(
    module: str,
    cls: str,
    target: str,
    texts: Mapping[str, str | None],
    conditions: tuple[Condition, ...] = (),
) -> list[tuple[Condition, ...]] | str:
    """The branches under which `module.cls` is `target`'s class; a string says why it is unknown."""
    if module == target:
        return [conditions]
    if not target.startswith(module + "."):
        return []
    init = texts.get(package_init(module))
    if init is None:
        return f"{package_init(module)} is not in this release"
    try:
        tree = ast.parse(init)
    except SyntaxError as error:
        return f"{package_init(module)} could not be parsed: {error}"
    found: list[tuple[Condition, ...]] = []
    bound = False
    for stmt, branch in _imports(tree.body, conditions):
        for alias in stmt.names:
            if (alias.asname or alias.name) != cls:
                continue
            bound = True
            deeper = _reach(_source_module(module, stmt), alias.name, target, texts, branch)
            if isinstance(deeper, str):
                return deeper
            found += deeper
    return found if bound else f"{module} does not import {cls}"


def route(fix: Fix, texts: Mapping[str, str | None]) -> Route:
    """Whether any of the fix's architectures reaches `fix.module` by default, read from the texts."""
    base = REGISTRY_MODULE.replace(".", "/")
    source = texts.get(f"{base}/__init__.py") or texts.get(f"{base}.py")
    if source is None:
        return Route(None, reason=f"{REGISTRY_MODULE} is not in this release")
    try:
        entries = registry_entries(source)
    except SyntaxError as error:
        return Route(None, reason=f"{REGISTRY_MODULE} could not be parsed: {error}")
    if not entries:
        return Route(None, reason=f"{REGISTRY_MODULE} has no (module, class) entries this tool knows")
    branches: list[tuple[Condition, ...]] = []
    seen: list[str] = []
    for arch in fix.architectures:
        targets = entries.get(arch, set())
        if len(targets) > 1:
            return Route(None, reason=f"the registry maps {arch} to several classes: {sorted(targets)}")
        for module, cls in targets:
            reached = _reach(module, cls, fix.module, texts)
            if isinstance(reached, str):
                return Route(None, reason=f"{arch} -> {module}.{cls}: {reached}")
            branches += reached
            seen.append(f"{arch} -> {module}.{cls}" + (" (this file)" if reached else " (not this file)"))
        if not targets:
            seen.append(f"{arch}: not in the registry")
    if not branches:
        return Route(False, reason="; ".join(seen))
    wheres = list(dict.fromkeys(describe(b) for b in branches))
    where = None if None in wheres else " or ".join(w for w in wheres if w)
    return Route(True, where, "; ".join(seen) + (f"; on {where}" if where else ""))
