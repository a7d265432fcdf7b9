"""The facts a user needs to trust the hotfix: per fix, what was decided in this process and why."""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder
from typing import Any

from vllm_hotfix._version import __version__, checkout, describe
from vllm_hotfix.runtime import arming
from vllm_hotfix.runtime import settings as settings_mod
from vllm_hotfix.runtime.decisions import Decision
from vllm_hotfix.runtime.fix import registered, registered_ids
from vllm_hotfix.runtime.vllm_version import installed_vllm_version, loaded_vllm_version


def _module_exists(name: str) -> bool:
    """Whether vLLM ships the module `name`, found on disk: importing it could fail, or be heavy."""
    top, *rest = name.split(".")
    loaded = sys.modules.get(top)
    spec = None if loaded is not None else PathFinder.find_spec(top)
    locations = getattr(loaded, "__path__", None) or (spec and spec.submodule_search_locations) or []
    for base in locations:
        path = os.path.join(base, *rest)
        if os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py")):
            return True
    return False


def vllm_found() -> bool:
    """Whether this Python finds vLLM on its path (imported or not)."""
    # PathFinder, not importlib.util.find_spec: looking vLLM up must not fire the import trigger
    return "vllm" in sys.modules or PathFinder.find_spec("vllm") is not None


def no_vllm(command: str = "status") -> str:
    """The one line a command (`vllm-hotfix status`, `verify`, `audit`) says when this Python has no
    vLLM: most often the hotfix was installed into another environment than vLLM's, so it names the
    Python it looked in."""
    return (
        f"vllm-hotfix {command}: no vLLM importable by {sys.executable}: install vllm-hotfix into the"
        " environment that runs vLLM, with that environment's Python (`python -m pip install"
        f" <vllm-hotfix>`), and run `python -m vllm_hotfix {command}` there"
    )


def cache_status() -> dict[str, Any]:
    """The cache directory generated sources go to, whether it is usable now (store.check: nothing
    is created), and the place they would go to instead (None: none is usable)."""
    from vllm_hotfix.runtime import patching, store

    places = patching.generated_dirs()
    problems = [store.check(place) for place in places]
    usable = [place.path for place, problem in zip(places, problems, strict=True) if problem is None]
    used = usable[0] if usable else None
    return {"path": places[0].path, "usable": problems[0] is None, "problem": problems[0], "used": used}


def fix_statuses() -> list[dict[str, Any]]:
    records = arming.records()
    vllm_present = vllm_found()
    found = settings_mod.read_settings(registered_ids())
    rows = []
    for fix in registered():
        record = records.get(fix.fix_id)
        if record is not None:
            decision, reason = record.decision, record.reason
        elif found.is_disabled(fix.fix_id):  # what the fix decides once its module is imported
            decision = Decision.DISABLED
            reason = f"{settings_mod.DISABLE_VAR}={os.environ.get(settings_mod.DISABLE_VAR, '')}"
        elif not vllm_present:
            decision, reason = Decision.PENDING, "vLLM is not installed: nothing to fix"
        elif fix.absent is Decision.NOT_AFFECTED and not _module_exists(fix.module):
            decision, reason = fix.absent, f"{fix.module} does not exist in this vLLM"
        else:
            decision, reason = Decision.PENDING, f"{fix.module} is not imported in this process yet"
        rows.append(
            {
                "fix": fix.fix_id,
                "title": fix.title,
                "target": fix.target,
                "decision": decision.value,  # plain text: status() is JSON-ready
                "reason": reason,
                "vllm_version": record.vllm_version if record else None,
                "generated_file": record.generated_file if record else None,
                "notes": list(record.notes) if record else [],
                "known_affected": list(fix.affected),
                "upstream_fix": fix.upstream,
            }
        )
    return rows


def verify_status() -> dict[str, Any]:
    """The check in this environment: only `vllm-hotfix verify` runs it (in an engine of its own);
    the retired in-server switch, if set. Read without torch or vLLM."""

    found = settings_mod.read_verify()
    return {
        "run_id": found.run_id,
        "report_dir": found.report_dir,
        "model": found.model,
        "retired_switch": os.environ.get(settings_mod.VERIFY_VAR)
        if settings_mod.retired_switch_set()
        else None,
        "problem": found.problem,
    }


def process_status() -> dict[str, Any]:
    found = settings_mod.read_settings(registered_ids())
    loaded = loaded_vllm_version()
    installed = installed_vllm_version()
    from vllm_hotfix.runtime import site_hook

    return {
        "hotfix_version": __version__,
        "hotfix_checkout": checkout(),  # run from a git checkout: its path, commit, modified
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "vllm_loaded": loaded.text if loaded else None,
        "vllm_installed": installed.text if installed else None,
        "armed": arming.is_armed(),
        "settings": {
            settings_mod.DISABLE_VAR: os.environ.get(settings_mod.DISABLE_VAR),
            settings_mod.STRICT_VAR: found.strict,
            "problems": list(found.problems),
        },
        "site_hook": site_hook.installed_path(),
        "cache_dir": cache_status(),
        "verify": verify_status(),
        "fixes": fix_statuses(),
    }


def settings_problems(status: dict[str, Any]) -> list[str]:
    """Every invalid setting a status names: the fixes' switches, and the check's if it has any."""
    found = list(status["settings"]["problems"])
    verify = status.get("verify") or {}
    if verify.get("problem"):
        found.append(verify["problem"])
    return found


def cache_line(cache: dict[str, Any]) -> str:
    """The cache directory, and where generated sources go instead when it is not usable."""
    if cache["usable"]:
        return f"cache directory: {cache['path']} (usable)"
    instead = (
        f"generated sources go to {cache['used']}"
        if cache["used"]
        else "no place is usable: compile caches cannot tell a fix apart"
    )
    return (
        f"cache directory: {cache['path']} NOT usable ({cache['problem']}); {instead};"
        f" set {settings_mod.CACHE_DIR_VAR} to a directory of yours"
    )


def format_text(status: dict[str, Any]) -> str:
    settings = status["settings"]
    version = describe(status["hotfix_version"], status.get("hotfix_checkout"))
    lines = [
        f"vllm-hotfix {version} (pid {status['pid']}, Python {status['python']}:"
        f" {status['python_executable']})",
        f"vLLM: {status['vllm_loaded'] or status['vllm_installed'] or 'not installed'}"
        + ("" if status["vllm_loaded"] else " (not imported)"),
        f"armed: {'yes' if status['armed'] else 'no'}"
        + (
            f"; every fix is disabled ({settings_mod.DISABLE_VAR})"
            if all(fix["decision"] == Decision.DISABLED.value for fix in status["fixes"])
            else ""
        ),
        f"{settings_mod.DISABLE_VAR}={settings[settings_mod.DISABLE_VAR] or ''}"
        f"  {settings_mod.STRICT_VAR}={'on' if settings[settings_mod.STRICT_VAR] else 'off'}",
        cache_line(status["cache_dir"]),
        f"site hook: {status['site_hook'] or 'not installed'}",
    ]
    lines += [f"settings problem: {problem}" for problem in settings["problems"]]
    verify = status["verify"]
    if verify["run_id"]:
        lines.append(f"verify: this is the engine of `vllm-hotfix verify` run {verify['run_id']}")
    else:
        lines.append("verify: `vllm-hotfix verify MODEL -- <engine flags>` checks the aux states")
    if verify["retired_switch"]:
        lines.append("verify: VLLMHOTFIX_VERIFY is set but retired: it installs nothing")
    if verify["problem"]:
        lines.append(f"settings problem: {verify['problem']}")
    for fix in status["fixes"]:
        first, last = fix["known_affected"]
        lines += [
            f"fix {fix['fix']}: {fix['decision']}",
            f"  {fix['title']}",
            f"  target: {fix['target']}",
            f"  reason: {fix['reason']}",
            f"  known affected: vLLM {first} to {last}; upstream fix: {fix['upstream_fix']}",
        ]
        if fix["generated_file"]:
            lines.append(f"  generated source: {fix['generated_file']}")
        lines += [f"  note: {note}" for note in fix["notes"]]
    return "\n".join(lines)
