"""The facts a user needs to trust the hotfix: per fix, what was decided in this process and why."""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder
from typing import Any

from vllm_hotfix._version import __version__, checkout
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
