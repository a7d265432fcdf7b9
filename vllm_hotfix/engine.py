"""Decide, per fix and per process, whether to patch; patch, remember, report and undo.

Everything a fix needs is decided here at patch time, once per process: the installed function
then runs with no checks, logging or other Python side effects (it is traced by torch.compile).
No exception leaves this module into vLLM's import or start-up unless strict mode asks for it.
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import logging
import os
import sys
import tempfile
import threading
import types
from dataclasses import dataclass, field
from typing import Any

from vllm_hotfix import codegen
from vllm_hotfix import settings as settings_mod
from vllm_hotfix._version import __version__
from vllm_hotfix.fixes import ALL_FIXES, FIX_IDS, Fix, Verdict
from vllm_hotfix.vllm_version import VllmVersion, loaded_vllm_version

logger = logging.getLogger("vllm.hotfix")  # a child of vLLM's logger: vLLM's handler shows it

# Decisions beyond the probe's verdicts.
DISABLED = "disabled"
FAILED = "failed"
REMOVED = "removed"
PENDING = "pending"


class HotfixError(RuntimeError):
    """Raised only in strict mode (VLLM_HOTFIX_STRICT=1) when a fix could not be applied."""


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
    decision: str
    reason: str
    vllm_version: str | None
    original: Any = None
    installed: Any = None
    generated_file: str | None = None
    notes: list[str] = field(default_factory=list)


_lock = threading.RLock()
_records: dict[str, Record] = {}
_hooked: set[str] = set()
_armed = False
_reported_problems: set[str] = set()


def _settings() -> settings_mod.Settings:
    found = settings_mod.read_settings(FIX_IDS)
    for problem in found.problems:
        if problem not in _reported_problems:
            _reported_problems.add(problem)
            logger.error("vllm-hotfix: %s", problem)
    if found.strict and found.problems:
        raise HotfixError("; ".join(found.problems))
    return found


def _generated_dirs() -> list[str]:
    return [
        os.path.join(settings_mod.cache_dir(), "generated"),
        os.path.join(tempfile.gettempdir(), f"vllm-hotfix-{os.getuid()}", "generated"),
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


def _version_note(fix: Fix, verdict: str, version: VllmVersion | None) -> str:
    """The version cross-check: agreement is stated, disagreement is flagged; the probe decides."""
    if version is None:
        return "vLLM version unknown"
    first, last = fix.affected
    inside = version.in_range(first, last)
    span = f"known affected range {first} to {last}"
    if inside is None:
        return f"vLLM {version.text}: version unreadable, the probe decides"
    expected_inside = verdict == Verdict.BUGGY.value
    where = "inside" if inside else "outside"
    if inside == expected_inside:
        return f"vLLM {version.text} is {where} the {span}, as expected"
    return (
        f"vLLM {version.text} is {where} the {span}, but the loaded code says '{verdict}':"
        " the probe decides (a backport, nightly or local build?)"
    )


def _log_decision(fix: Fix, record: Record) -> None:
    level = logging.WARNING if record.decision in (Verdict.UNKNOWN.value, FAILED) else logging.INFO
    message = (
        f"vllm-hotfix pid={os.getpid()} vllm={record.vllm_version or 'not loaded'} fix={fix.fix_id}"
        f" decision={record.decision!r} reason={record.reason!r}"
    )
    if level == logging.WARNING:
        message += (
            " The fix was NOT applied. If this vLLM carries the bug: upgrading to a vLLM with the"
            f" upstream fix ({fix.upstream}) repairs it; {settings_mod.FORCE_VAR}={fix.fix_id} patches"
            " an unrecognised source shape anyway if upstream's change can still be made to it (never"
            " a function another plugin installed); please report the output of"
            " `vllm-hotfix status --json` to the vllm-hotfix maintainers."
            f" {settings_mod.STRICT_VAR}=1 makes this an error."
        )
    logger.log(level, message)


def _decide(fix: Fix, module: types.ModuleType) -> Record:
    """Probe the loaded target and patch it if it has the known buggy shape."""
    version = loaded_vllm_version()
    version_text = version.text if version else None
    found = _settings()
    if found.is_disabled(fix.fix_id):
        raw = os.environ.get(settings_mod.DISABLE_VAR, "")
        return Record(fix.fix_id, DISABLED, f"{settings_mod.DISABLE_VAR}={raw}", version_text)

    def unknown(reason: str) -> Record:
        return Record(fix.fix_id, Verdict.UNKNOWN.value, reason, version_text)

    try:
        current = fix.current(module)
    except AttributeError as error:
        return unknown(f"{fix.target} not found: {error}")
    marker = getattr(current, "__vllm_hotfix__", None)
    previous = _records.get(fix.fix_id)
    if isinstance(marker, Marker) and marker.fix_id == fix.fix_id:
        if previous is not None and previous.installed is current:
            return previous
        return unknown(f"{fix.target} was patched by another copy of vllm-hotfix {marker.version}")
    if current is None:
        return Record(fix.fix_id, fix.absent.value, f"{fix.target} does not exist in this vLLM", version_text)
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
    note = _version_note(fix, probe.verdict.value, version)
    reason = f"{probe.reason}; {note}"
    forced = probe.verdict is Verdict.UNKNOWN and fix.fix_id in found.forced_ids
    if probe.verdict is not Verdict.BUGGY and not forced:
        return Record(fix.fix_id, probe.verdict.value, reason, version_text)
    if forced:
        reason = f"forced by {settings_mod.FORCE_VAR} although the probe said: {reason}"

    try:
        fixed_source = fix.transform_source(source)
    except Exception as error:
        if not forced:
            raise
        return Record(
            fix.fix_id, FAILED, f"cannot make upstream's change here ({error}); {reason}", version_text
        )
    check = fix.probe_source(fixed_source, related)
    if check.verdict is not Verdict.FIXED_UPSTREAM:
        return Record(
            fix.fix_id, FAILED, f"self-check of the generated source failed: {check.reason}", version_text
        )
    code = current.__code__
    generated = codegen.build_function(
        fix_id=fix.fix_id,
        original=current,
        namespace=current.__globals__,
        source=fixed_source,
        qualname_base=current.__qualname__,
        provenance=f"{code.co_filename}:{code.co_firstlineno} (vLLM {version_text})",
        directories=_generated_dirs(),
    )
    generated.function.__vllm_hotfix__ = Marker(  # type: ignore[attr-defined]
        fix.fix_id, __version__, generated.digest, generated.filename
    )
    fix.install(module, generated.function, current)
    record = Record(
        fix.fix_id,
        Verdict.BUGGY.value,
        reason,
        version_text,
        original=current,
        installed=generated.function,
        generated_file=generated.filename,
    )
    if generated.filename.startswith("<"):
        record.notes.append(
            "no writable directory for the generated source: compile caches cannot tell this fix"
            " apart from other revisions; set VLLM_DISABLE_COMPILE_CACHE=1 or VLLM_HOTFIX_CACHE_DIR"
        )
        logger.warning("vllm-hotfix fix=%s: %s", fix.fix_id, record.notes[-1])
    return record


def _warn_if_built_already(fix: Fix, module: types.ModuleType, record: Record) -> None:
    """Armed after the module was imported: objects built before keep compiled, unpatched code."""
    if fix.owner is None or record.decision != Verdict.BUGGY.value:
        return
    cls = getattr(module, fix.owner, None)
    if not isinstance(cls, type):
        return
    count = sum(1 for obj in gc.get_objects() if issubclass(type(obj), cls))  # no __class__ lookups
    if count:
        note = (
            f"{count} {fix.owner} object(s) existed before the fix was armed; a model compiled when"
            " it was built (vLLM's default) keeps the unpatched forward: build it again after"
            " `import vllm_hotfix`, or install the hotfix as a vLLM plugin"
        )
        record.notes.append(note)
        logger.warning("vllm-hotfix fix=%s: %s", fix.fix_id, note)


def _on_import(fix: Fix, module: types.ModuleType, late: bool = False) -> None:
    """wrapt post-import hook: runs when vLLM imports the fix's module (or at once if it was)."""
    with _lock:
        if not _armed:
            return
        previous = _records.get(fix.fix_id)
        try:
            record = _decide(fix, module)
        except HotfixError:
            raise
        except Exception as error:  # never break the host
            record = Record(
                fix.fix_id,
                FAILED,
                f"{type(error).__name__}: {error}",
                getattr(loaded_vllm_version(), "text", None),
            )
        if record is previous:
            return
        _records[fix.fix_id] = record
        _log_decision(fix, record)
        if late:
            _warn_if_built_already(fix, module, record)
        if record.decision in (Verdict.UNKNOWN.value, FAILED) and _strict():
            raise HotfixError(f"vllm-hotfix fix {fix.fix_id} not applied: {record.reason}")


def _strict() -> bool:
    return settings_mod.read_settings(FIX_IDS).strict


def arm() -> None:
    """Patch every target now if its module is loaded, else when vLLM imports it."""
    global _armed
    import wrapt

    with _lock:
        _armed = True
        for fix in ALL_FIXES:
            late = fix.module in sys.modules
            if fix.fix_id not in _hooked:
                _hooked.add(fix.fix_id)
                wrapt.register_post_import_hook(
                    lambda module, fix=fix, late=late: _on_import(fix, module, late), fix.module
                )
            elif late:
                _on_import(fix, sys.modules[fix.module], late=True)


def remove() -> None:
    """Restore every original function we installed over, unless someone replaced ours since."""
    global _armed
    with _lock:
        _armed = False
        for fix in ALL_FIXES:
            record = _records.get(fix.fix_id)
            if record is None or record.installed is None:
                continue
            module = sys.modules.get(fix.module)
            current = fix.current(module) if module is not None else None
            if current is not record.installed:
                note = (
                    f"{fix.target} is no longer the function vllm-hotfix installed (replaced by"
                    " something else since): left untouched"
                )
                record.notes.append(note)
                logger.warning("vllm-hotfix fix=%s: %s", fix.fix_id, note)
                continue
            fix.install(module, record.original, record.installed)
            _records[fix.fix_id] = Record(
                fix.fix_id, REMOVED, "restored the original function by remove()", record.vllm_version
            )
            logger.info("vllm-hotfix pid=%d fix=%s decision='removed'", os.getpid(), fix.fix_id)


def records() -> dict[str, Record]:
    with _lock:
        return dict(_records)


def is_armed() -> bool:
    return _armed
