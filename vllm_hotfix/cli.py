"""`vllm-hotfix` / `python -m vllm_hotfix`: status, and the site hook's install and removal."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from vllm_hotfix import site_hook


def _status(args: argparse.Namespace) -> int:
    import vllm_hotfix
    from vllm_hotfix import report
    from vllm_hotfix.fixes import ALL_FIXES

    if args.probe:
        # Decide as vLLM's own processes would: import each target module, which fires the fix.
        for fix in ALL_FIXES:
            try:
                importlib.import_module(fix.module)
            except ImportError:
                continue
    status = vllm_hotfix.status()
    print(json.dumps(status, indent=2) if args.json else report.format_text(status))
    problems = [f for f in status["fixes"] if f["decision"] in report.PROBLEM_DECISIONS]
    return 2 if problems else 0


def _install(args: argparse.Namespace) -> int:
    path = site_hook.install(args.site_dir)
    print(f"installed the vllm-hotfix site hook: {path}")
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    path = site_hook.uninstall(args.site_dir)
    print(f"removed {path}" if path else "the vllm-hotfix site hook was not installed")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-hotfix", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    status = commands.add_parser(
        "status",
        help="say, per fix, what the hotfix decides for the vLLM of this environment",
        description="Imports vLLM's target modules (as vLLM would) and reports each fix's decision."
        " Exits 2 when a fix is 'unknown' or 'failed'.",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="do not import vLLM; report only what this process knows",
    )
    status.set_defaults(run=_status)

    for name, run, verb in (
        ("install-sitecustomize", _install, "write"),
        ("uninstall-sitecustomize", _uninstall, "remove"),
    ):
        sub = commands.add_parser(
            name, help=f"{verb} the site hook that arms vllm-hotfix in every Python process"
        )
        sub.add_argument("--site-dir", help="site-packages directory (default: the active environment's)")
        sub.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
