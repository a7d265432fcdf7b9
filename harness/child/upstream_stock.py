"""Stock's function in a process that runs an upstream patch (upstream/, harness/upstream.py): the
patched vLLM files are an overlay first on PYTHONPATH, so the module imported is the patched file,
and stock is the same function compiled from the installed, unpatched file, in the patched module's
globals (a patch only adds names). Stock and patched then run in one process on one model, as with
the hotfix, where stock is the function it keeps as `__wrapped__`.
"""

from __future__ import annotations

import ast
import os
from types import FunctionType, ModuleType


def stock_function(module: ModuleType, owner: str, attribute: str, site: str) -> FunctionType:
    """`owner.attribute` as `site`'s (unpatched) copy of `module`'s file defines it."""
    path = os.path.join(site, *module.__name__.split(".")) + ".py"
    loaded = os.path.realpath(module.__file__ or "")
    assert loaded != os.path.realpath(path), f"{module.__name__} is the unpatched file: no overlay"
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
    (function,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == attribute]
    defined: dict = {}
    exec(compile(ast.Module(body=[function], type_ignores=[]), path, "exec"), vars(module), defined)
    made = defined[attribute]
    made.__qualname__ = f"{owner}.{attribute}"
    return made
