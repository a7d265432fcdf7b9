"""`vllm-hotfix` / `python -m vllm_hotfix`: the command line read (parser.py), the command run, and
every way it can end: its exit code, a usage error (exit 4), its own failure (exit 3), a reader
that went away (a closed pipe: quiet). The small commands (status, clean, the site hook's install
and removal) are here; verify, audit and audit-merge have a module each.

Exit codes (vllm_hotfix/judging/verdicts.py, the same for every command): 0 ok, 1 wrong, 2 not
everything could be checked or decided, 3 the command or vLLM failed, 4 usage error. Results go to
stdout, messages (a no-vLLM line, warnings, failures) to stderr.
"""

from __future__ import annotations

import sys
import traceback

from vllm_hotfix.commands.output import QuietPipe, exit_usage, print_document
from vllm_hotfix.commands.parser import parse
from vllm_hotfix.judging import verdicts
from vllm_hotfix.judging.verdicts import UsageError
from vllm_hotfix.runtime.errors import one_line


def main(argv: list[str] | None = None) -> int:
    """Run the command line; its exit code. A reader that goes away (`| head`, `| true`) ends the
    output quietly, never the exit code."""
    stdout = sys.stdout
    sys.stdout = QuietPipe(stdout)  # a TextIO's methods, forwarded
    try:
        return _run(sys.argv[1:] if argv is None else list(argv))
    finally:
        sys.stdout = stdout


def _run(argv: list[str]) -> int:
    args = parse(argv)
    try:
        code: int = args.run(args)
        return code
    except UsageError as error:
        exit_usage(f"vllm-hotfix {args.command}", str(error), bool(getattr(args, "json", False)))
    except Exception as error:  # a failure of the command itself: exit 3, the document under --json
        traceback.print_exc()
        reason = f"the command failed: {one_line(error)}"
        print(f"vllm-hotfix {args.command}: {reason}", file=sys.stderr)
        if getattr(args, "json", False):
            print_document(args.command, verdicts.ERROR, reason)
        return verdicts.ERROR


if __name__ == "__main__":
    sys.exit(main())
