"""Decide for one fix in this process: probe the loaded target and, if it is the known buggy shape,
derive the fixed source and self-check it. Nothing is installed or recorded here: decide() returns
a `Plan`, and a `patched` plan carries the original and the fixed source, which the engine has
`patching.patch()` install before it records what happened. Everything is decided at patch time;
the installed function has no checks."""

from __future__ import annotations

import importlib.util
import inspect
import os
import types
from dataclasses import dataclass

from vllm_hotfix.runtime import settings as settings_mod
from vllm_hotfix.runtime.decisions import Decision
from vllm_hotfix.runtime.fix import Fix, Marker
from vllm_hotfix.runtime.vllm_version import VllmVersion, loaded_vllm_version


@dataclass(frozen=True)
class Plan:
    """What decide() concluded for one fix: the decision and, for `patched`, what to install."""

    fix_id: str
    decision: Decision
    reason: str
    vllm_version: str | None
    original: types.FunctionType | None = None  # the loaded function a `patched` plan replaces
    fixed_source: str | None = None  # what replaces it: derived and self-checked by decide()


def related_sources(fix: Fix) -> dict[str, str | None]:
    """The source text of each module in `fix.related`, as the probe gets it (None if absent)."""
    return {name: _module_source(name) for name in fix.related}


def _module_source(name: str) -> str | None:
    """A related module's source text, read from its file without executing it or its packages.

    Only the top-level package is looked up by the import system (vLLM, imported already); the rest
    of the dotted name is followed on the file system. Importing the parent packages instead could
    run them halfway through vLLM's own imports (a fix decided when `vllm.config.vllm` loads reads
    a module under `vllm.distributed`, whose package imports `vllm.config`)."""
    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    path, locations = spec.origin, list(spec.submodule_search_locations or ())
    for part in rest.split(".") if rest else ():
        path = _child_file(locations, part)
        if path is None:
            return None
        locations = [os.path.dirname(path)] if path.endswith("__init__.py") else []
    try:
        with open(path or "", encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def _child_file(locations: list[str], part: str) -> str | None:
    """The file of submodule `part` of a package found at `locations`: its `__init__.py` or `.py`."""
    for location in locations:
        for candidate in (os.path.join(location, part, "__init__.py"), os.path.join(location, f"{part}.py")):
            if os.path.isfile(candidate):
                return candidate
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
    fix: Fix,
    module: types.ModuleType,
    found: settings_mod.Settings,
    installed: types.FunctionType | None,
) -> Plan | None:
    """Probe the loaded target; if it has the known buggy shape, derive and self-check the fix.

    A `patched` plan carries `original` and `fixed_source` for `patching.patch()`. `installed` is
    the function this process last installed for the fix, if any: a target that is still that
    function needs nothing new, and decide() returns None (the previous record stands).
    """
    version = loaded_vllm_version()
    version_text = version.text if version else None
    if found.is_disabled(fix.fix_id):
        raw = os.environ.get(settings_mod.DISABLE_VAR, "")
        return Plan(fix.fix_id, Decision.DISABLED, f"{settings_mod.DISABLE_VAR}={raw}", version_text)

    def unknown(reason: str) -> Plan:
        return Plan(fix.fix_id, Decision.UNKNOWN, reason, version_text)

    try:
        current = fix.current(module)
    except AttributeError as error:
        return unknown(f"{fix.target} not found: {error}")
    marker = getattr(current, "__vllm_hotfix__", None)
    if isinstance(marker, Marker) and marker.fix_id == fix.fix_id:
        if installed is current:
            return None
        return unknown(f"{fix.target} was patched by another copy of vllm-hotfix {marker.version}")
    if current is None:
        return Plan(fix.fix_id, fix.absent, f"{fix.target} does not exist in this vLLM", version_text)
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
    if current.__code__.co_freevars and fix.class_cell(module, current) is None:
        return unknown(f"{fix.target} is a closure ({current.__code__.co_freevars}); not the known shape")
    try:
        source = inspect.getsource(current)
    except (OSError, TypeError) as error:
        return unknown(f"source of {fix.target} not available: {error}")

    related = related_sources(fix)
    probe = fix.probe_source(source, related)
    note = _version_note(fix, probe.verdict, version)
    reason = f"{probe.reason}; {note}"
    forced = probe.verdict is Decision.UNKNOWN and fix.fix_id in found.forced_ids
    if probe.verdict is not Decision.PATCHED and not forced:
        return Plan(fix.fix_id, probe.verdict, reason, version_text)
    if forced:
        reason = f"forced by {settings_mod.FORCE_VAR} although the probe said: {reason}"

    try:
        fixed_source = fix.transform_source(source)
    except Exception as error:
        if not forced:
            raise
        return Plan(
            fix.fix_id,
            Decision.FAILED,
            f"cannot make upstream's change here ({error}); {reason}",
            version_text,
        )
    check = fix.probe_source(fixed_source, related)
    if check.verdict is not Decision.FIXED_UPSTREAM:
        return Plan(
            fix.fix_id,
            Decision.FAILED,
            f"self-check of the generated source failed: {check.reason}",
            version_text,
        )
    return Plan(
        fix.fix_id, Decision.PATCHED, reason, version_text, original=current, fixed_source=fixed_source
    )
