"""Decide for one fix in this process: probe the loaded target, and patch it if it is the known
buggy shape. Everything is decided here, at patch time; the installed function has no checks."""

from __future__ import annotations

import importlib.util
import inspect
import os
import tempfile
import types
from dataclasses import dataclass, field
from typing import Any

from vllm_hotfix import codegen, store
from vllm_hotfix import settings as settings_mod
from vllm_hotfix._version import __version__
from vllm_hotfix.decisions import Decision
from vllm_hotfix.fixes import Fix
from vllm_hotfix.vllm_version import VllmVersion, loaded_vllm_version


@dataclass
class Marker:
    """Carried by every installed function as `__vllm_hotfix__`: who made it, from what."""

    fix_id: str
    version: str
    digest: str
    filename: str


@dataclass
class Record:
    """What happened to one fix in this process."""

    fix_id: str
    decision: Decision
    reason: str
    vllm_version: str | None
    original: Any = None
    installed: Any = None
    generated_file: str | None = None
    notes: list[str] = field(default_factory=list)


def generated_dirs() -> list[store.Place]:
    """Where generated sources go: the user's cache directory, else a private per-user directory
    in the shared temporary directory (see store for the rules that make that safe)."""
    base, parts = settings_mod.cache_root()
    return [
        store.Place(base, (*parts, "generated")),
        store.Place(tempfile.gettempdir(), (f"vllm-hotfix-{os.getuid()}", "generated")),
    ]


def _module_source(name: str) -> str | None:
    """A related module's source text, read from its file without executing it."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            return None
        with open(spec.origin, encoding="utf-8") as handle:
            return handle.read()
    except (ImportError, OSError, ValueError):
        return None


def _version_note(fix: Fix, verdict: Decision, version: VllmVersion | None) -> str:
    """The version cross-check: agreement is stated, disagreement is flagged; the probe decides."""
    if version is None:
        return "vLLM version unknown"
    first, last = fix.affected
    inside = version.in_range(first, last)
    span = f"known affected range {first} to {last}"
    if inside is None:
        return f"vLLM {version.text}: version unreadable, the probe decides"
    expected_inside = verdict is Decision.PATCHED
    where = "inside" if inside else "outside"
    if inside == expected_inside:
        return f"vLLM {version.text} is {where} the {span}, as expected"
    return (
        f"vLLM {version.text} is {where} the {span}, but the loaded code says '{verdict.value}':"
        " the probe decides (a backport, nightly or local build?)"
    )


def decide(
    fix: Fix, module: types.ModuleType, found: settings_mod.Settings, previous: Record | None
) -> Record:
    """Probe the loaded target and patch it if it has the known buggy shape.

    `previous` is this process's last record for the fix: a target that is still the function it
    installed is returned as is (idempotent).
    """
    version = loaded_vllm_version()
    version_text = version.text if version else None
    if found.is_disabled(fix.fix_id):
        raw = os.environ.get(settings_mod.DISABLE_VAR, "")
        return Record(fix.fix_id, Decision.DISABLED, f"{settings_mod.DISABLE_VAR}={raw}", version_text)

    def unknown(reason: str) -> Record:
        return Record(fix.fix_id, Decision.UNKNOWN, reason, version_text)

    try:
        current = fix.current(module)
    except AttributeError as error:
        return unknown(f"{fix.target} not found: {error}")
    marker = getattr(current, "__vllm_hotfix__", None)
    if isinstance(marker, Marker) and marker.fix_id == fix.fix_id:
        if previous is not None and previous.installed is current:
            return previous
        return unknown(f"{fix.target} was patched by another copy of vllm-hotfix {marker.version}")
    if current is None:
        return Record(fix.fix_id, fix.absent, f"{fix.target} does not exist in this vLLM", version_text)
    if type(current) is not types.FunctionType:  # type(), not isinstance: proxies fake __class__
        kind = type(current)
        return unknown(
            f"{fix.target} is a {kind.__module__}.{kind.__qualname__}, not vLLM's plain function"
            " (replaced by another plugin or wrapper?)"
        )
    module_file = getattr(module, "__file__", None)
    if module_file and os.path.realpath(current.__code__.co_filename) != os.path.realpath(module_file):
        return unknown(
            f"{fix.target} comes from {current.__code__.co_filename}, not from {module_file}"
            " (replaced by another plugin?)"
        )
    if current.__code__.co_freevars:
        return unknown(f"{fix.target} is a closure ({current.__code__.co_freevars}); not the known shape")
    try:
        source = inspect.getsource(current)
    except (OSError, TypeError) as error:
        return unknown(f"source of {fix.target} not available: {error}")

    related = {name: _module_source(name) for name in fix.related}
    probe = fix.probe_source(source, related)
    note = _version_note(fix, probe.verdict, version)
    reason = f"{probe.reason}; {note}"
    forced = probe.verdict is Decision.UNKNOWN and fix.fix_id in found.forced_ids
    if probe.verdict is not Decision.PATCHED and not forced:
        return Record(fix.fix_id, probe.verdict, reason, version_text)
    if forced:
        reason = f"forced by {settings_mod.FORCE_VAR} although the probe said: {reason}"

    try:
        fixed_source = fix.transform_source(source)
    except Exception as error:
        if not forced:
            raise
        return Record(
            fix.fix_id,
            Decision.FAILED,
            f"cannot make upstream's change here ({error}); {reason}",
            version_text,
        )
    check = fix.probe_source(fixed_source, related)
    if check.verdict is not Decision.FIXED_UPSTREAM:
        return Record(
            fix.fix_id,
            Decision.FAILED,
            f"self-check of the generated source failed: {check.reason}",
            version_text,
        )
    code = current.__code__
    generated = codegen.build_function(
        fix_id=fix.fix_id,
        original=current,
        namespace=current.__globals__,
        source=fixed_source,
        qualname_base=current.__qualname__,
        provenance=f"{code.co_filename}:{code.co_firstlineno} (vLLM {version_text})",
        directories=generated_dirs(),
        bindings=fix.bindings(module),
    )
    generated.function.__vllm_hotfix__ = Marker(  # type: ignore[attr-defined]
        fix.fix_id, __version__, generated.digest, generated.filename
    )
    fix.install(module, generated.function, current)
    record = Record(
        fix.fix_id,
        Decision.PATCHED,
        reason,
        version_text,
        original=current,
        installed=generated.function,
        generated_file=generated.filename,
    )
    record.notes += _place_notes(generated_dirs(), generated.filename)  # the same places again
    return record


def _place_notes(places: list[store.Place], filename: str) -> list[str]:
    """Say why the generated source is not where it should be."""
    if filename.startswith("<"):
        tried = "; ".join(f"{place.path}: {store.problem(place)}" for place in places)
        return [
            f"no usable directory for the generated source ({tried}): compile caches cannot tell this"
            " fix apart from other revisions; set VLLM_DISABLE_COMPILE_CACHE=1, or VLLM_HOTFIX_CACHE_DIR"
            " to a directory of yours"
        ]
    explicit = os.environ.get(settings_mod.CACHE_DIR_VAR)
    if explicit and os.path.dirname(filename) != places[0].path:
        return [
            f"{settings_mod.CACHE_DIR_VAR}={explicit} cannot hold generated sources"
            f" ({store.problem(places[0])}); using {os.path.dirname(filename)}"
        ]
    return []
