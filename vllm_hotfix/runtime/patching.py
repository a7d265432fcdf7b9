"""Patch and unpatch: put the fixed function where vLLM's is, and put vLLM's back.

`decide.decide()` only decides: it returns, for a fix to apply, the loaded original and the fixed
source it derived and self-checked. `patch()` turns that source into a plain function
(`codegen.build_function`, its file in one of `generated_dirs()`), marks it (`fix.Marker`) and puts
it in place; `unpatch()` puts the original back, unless something else replaced the fixed function
since. Both go through the fix's `Fix.put()`, the one place that knows where the function is referenced.
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from dataclasses import dataclass

from vllm_hotfix._version import __version__
from vllm_hotfix.runtime import codegen, store
from vllm_hotfix.runtime import settings as settings_mod
from vllm_hotfix.runtime.fix import Fix, Marker


@dataclass(frozen=True)
class Patched:
    """What patch() put in place."""

    function: types.FunctionType
    generated_file: str  # a real file, or a synthetic <...> name when no directory was usable
    notes: tuple[str, ...]  # why the generated source is not where it should be, if it is not


def generated_dirs() -> list[store.Place]:
    """Where generated sources go: the user's cache directory, else a private per-user directory
    in the shared temporary directory (see store for the rules that make that safe)."""
    base, parts = settings_mod.cache_root()
    return [
        store.Place(base, (*parts, "generated")),
        store.Place(tempfile.gettempdir(), (f"vllm-hotfix-{os.getuid()}", "generated")),
    ]


def _bindings(fix: Fix, module: types.ModuleType, original: types.FunctionType) -> dict[str, object]:
    """The fix's bindings, plus `__class__` for a method that calls zero-argument `super()`."""
    bindings = dict(fix.bindings(module))
    owner = fix.class_cell(module, original)
    if owner is not None:
        bindings["__class__"] = owner
    return bindings


def patch(
    fix: Fix,
    module: types.ModuleType,
    original: types.FunctionType,
    fixed_source: str,
    vllm_version: str | None,
) -> Patched:
    """Build the function `fixed_source` defines, in `original`'s namespace, and put it in place of
    `original` (`fix.put`). `fixed_source` is what decide() derived and self-checked."""
    code = original.__code__
    places = generated_dirs()
    generated = codegen.build_function(
        fix_id=fix.fix_id,
        original=original,
        namespace=original.__globals__,
        source=fixed_source,
        qualname_base=original.__qualname__,
        provenance=f"{code.co_filename}:{code.co_firstlineno} (vLLM {vllm_version})",
        directories=places,
        bindings=_bindings(fix, module, original),
    )
    generated.function.__vllm_hotfix__ = Marker(  # type: ignore[attr-defined]
        fix.fix_id, __version__, generated.digest, generated.filename
    )
    fix.put(module, generated.function, replacing=original)
    return Patched(generated.function, generated.filename, tuple(_place_notes(places, generated.filename)))


def unpatch(fix: Fix, installed: types.FunctionType, original: types.FunctionType) -> bool:
    """Put `original` back where patch() put `installed` (`fix.put`).

    False, and nothing is touched, when the target is no longer `installed` (replaced by something
    else since, or its module is gone).
    """
    module = sys.modules.get(fix.module)
    if module is None or fix.current(module) is not installed:
        return False
    fix.put(module, original, replacing=installed)
    return True


def _place_notes(places: list[store.Place], filename: str) -> list[str]:
    """Say why the generated source is not where it should be."""
    if filename.startswith("<"):
        tried = "; ".join(f"{place.path}: {store.problem(place)}" for place in places)
        return [
            f"no usable directory for the generated source ({tried}): compile caches cannot tell this"
            " fix apart from other revisions; set VLLM_DISABLE_COMPILE_CACHE=1, or VLLMHOTFIX_CACHE_DIR"
            " to a directory of yours"
        ]
    explicit = os.environ.get(settings_mod.CACHE_DIR_VAR)
    if explicit and os.path.dirname(filename) != places[0].path:
        return [
            f"{settings_mod.CACHE_DIR_VAR}={explicit} cannot hold generated sources"
            f" ({store.problem(places[0])}); using {os.path.dirname(filename)}"
        ]
    return []
