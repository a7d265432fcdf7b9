"""Arm the fixes, and per fix and per process: have it decided (runtime/decide.py), patched or unpatched
(runtime/patching.py), and record and log what happened: one `Record`, built once the patch is made.

Everything a fix needs is decided at patch time, once per process: the installed function then
runs with no checks, logging or other Python side effects (it is traced by torch.compile).
No exception leaves this module into vLLM's import or start-up unless strict mode asks for it
(runtime/containment.py).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import types
from dataclasses import dataclass, replace
from typing import Any

from vllm_hotfix.runtime import containment, patching
from vllm_hotfix.runtime import settings as settings_mod
from vllm_hotfix.runtime.decide import Plan, decide
from vllm_hotfix.runtime.decisions import Decision
from vllm_hotfix.runtime.errors import HotfixError
from vllm_hotfix.runtime.fix import Fix, registered, registered_ids
from vllm_hotfix.runtime.vllm_version import loaded_vllm_version

logger = logging.getLogger("vllm.hotfix")  # a child of vLLM's logger: vLLM's handler shows it


@dataclass(frozen=True)
class Record:
    """What happened to one fix in this process: decide()'s plan and, if patched, what was installed."""

    fix_id: str
    decision: Decision
    reason: str
    vllm_version: str | None
    original: Any = None  # the loaded function a `patched` decision replaced
    installed: Any = None  # the function patching.patch() put in its place
    generated_file: str | None = None
    notes: tuple[str, ...] = ()


_lock = threading.RLock()
_records: dict[str, Record] = {}
_hooked: set[str] = set()
_armed = False


def _settings() -> settings_mod.Settings:
    found = settings_mod.read_settings(registered_ids())
    for line in settings_mod.unreported(found.problems):
        logger.error("%s", line)
    if found.strict and found.problems:
        raise HotfixError("; ".join(found.problems))
    return found


def _log_decision(fix: Fix, record: Record) -> None:
    level = logging.WARNING if record.decision.is_problem else logging.INFO
    message = (
        f"vllm-hotfix pid={os.getpid()} vllm={record.vllm_version or 'not loaded'} fix={fix.fix_id}"
        f" decision={record.decision.value!r} reason={record.reason!r}"
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


def _built_already(fix: Fix, module: types.ModuleType) -> list[str]:
    """Armed after the module was imported: objects built before keep compiled, unpatched code."""
    cls = getattr(module, fix.owner, None) if fix.owner is not None else None
    if not isinstance(cls, type):
        return []
    count = sum(1 for obj in gc.get_objects() if issubclass(type(obj), cls))  # no __class__ lookups
    if not count:
        return []
    return [
        f"{count} {fix.owner} object(s) existed before the fix was armed; a model compiled when"
        " it was built (vLLM's default) keeps the unpatched forward: build it again after"
        " `import vllm_hotfix`, or install the hotfix as a vLLM plugin"
    ]


def _on_import(fix: Fix, module: types.ModuleType, late: bool = False) -> None:
    """wrapt post-import hook: runs when vLLM imports the fix's module (or at once if it was).

    It runs inside vLLM's import of that module, so nothing escapes it unless strict mode asks:
    HotfixError is raised only in strict mode, and any other error is contained (runtime/containment.py).
    """
    error = containment.contain(
        f"fix {fix.fix_id} not decided", lambda: _decide_now(fix, module, late), (HotfixError,)
    )
    if error is None:
        return
    try:
        with _lock:
            if getattr(_records.get(fix.fix_id), "installed", None) is None:  # keep a patch made
                reason = f"{type(error).__name__}: {error}"
                _records[fix.fix_id] = Record(fix.fix_id, Decision.FAILED, reason, None)
    except Exception:
        pass


def _apply_plan(fix: Fix, module: types.ModuleType, plan: Plan, late: bool) -> Record:
    """Patch what `plan` says to, and return its one record (for `patched`, made once it is in place)."""
    if plan.original is None or plan.fixed_source is None:  # nothing to install
        return Record(fix.fix_id, plan.decision, plan.reason, plan.vllm_version)
    built_already = _built_already(fix, module) if late else []  # before patching: nothing to lose
    original: types.FunctionType = plan.original  # type: ignore[assignment]  # a field, not a method
    patched = patching.patch(fix, module, original, plan.fixed_source, plan.vllm_version)
    return Record(
        fix.fix_id,
        plan.decision,
        plan.reason,
        plan.vllm_version,
        original=plan.original,
        installed=patched.function,
        generated_file=patched.generated_file,
        notes=(*patched.notes, *built_already),
    )


def _decide_now(fix: Fix, module: types.ModuleType, late: bool) -> None:
    with _lock:
        if not _armed:
            return
        previous = _records.get(fix.fix_id)
        found = _settings()  # raises HotfixError in strict mode when a switch is invalid
        try:
            plan = decide(fix, module, found, previous.installed if previous else None)
            if plan is None:  # still the function this process installed: the record stands
                return
            record = _apply_plan(fix, module, plan, late)
        except Exception as error:  # an error while deciding or patching is a decision: failed
            record = Record(
                fix.fix_id,
                Decision.FAILED,
                f"{type(error).__name__}: {error}",
                getattr(loaded_vllm_version(), "text", None),
            )
        _records[fix.fix_id] = record
        _log_decision(fix, record)
        for note in record.notes:
            logger.warning("vllm-hotfix fix=%s: %s", fix.fix_id, note)
        if record.decision.is_problem and found.strict:
            raise HotfixError(f"vllm-hotfix fix {fix.fix_id} not applied: {record.reason}")


def arm() -> None:
    """Patch every registered fix's target now if its module is loaded, else when vLLM imports it."""
    global _armed
    import wrapt

    fixes = registered()  # before anything is armed: raises if there is nothing to arm
    with _lock:
        _armed = True
        for fix in fixes:
            late = fix.module in sys.modules
            if fix.fix_id not in _hooked:
                _hooked.add(fix.fix_id)

                def hook(module: types.ModuleType, fix: Fix = fix, late: bool = late) -> None:
                    _on_import(fix, module, late)

                wrapt.register_post_import_hook(hook, fix.module)
            elif late:
                _on_import(fix, sys.modules[fix.module], late=True)


def remove() -> None:
    """Restore every original function we installed over, unless someone replaced ours since."""
    global _armed
    with _lock:
        _armed = False
        for fix in registered():
            record = _records.get(fix.fix_id)
            if record is None or record.installed is None:
                continue
            if not patching.unpatch(fix, record.installed, record.original):
                note = (
                    f"{fix.target} is no longer the function vllm-hotfix installed (replaced by"
                    " something else since): left untouched"
                )
                _records[fix.fix_id] = replace(record, notes=(*record.notes, note))
                logger.warning("vllm-hotfix fix=%s: %s", fix.fix_id, note)
                continue
            _records[fix.fix_id] = Record(
                fix.fix_id,
                Decision.REMOVED,
                "restored the original function by remove()",
                record.vllm_version,
            )
            logger.info(
                "vllm-hotfix pid=%d fix=%s decision=%r", os.getpid(), fix.fix_id, Decision.REMOVED.value
            )


def records() -> dict[str, Record]:
    with _lock:
        return dict(_records)


def is_armed() -> bool:
    return _armed
