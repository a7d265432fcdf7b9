"""What every `vllm-hotfix` command prints for machines, and how it says it was used wrongly.

One JSON envelope (`document`): each `--json` document begins with `schema` (the command's own,
raised when one of its keys changes meaning or goes), `command`, `verdict`, `exit_code` and
`reason`, in that order, then the command's own keys; it is the only thing on stdout. `verdict` is
PASS (exit 0), FAIL (exit 1) or UNKNOWN (2 to 4), for every command (judging/verdicts.py). A usage
error is one line on stderr, and under `--json` also a document on stdout, before any slow work;
it exits verdicts.USAGE.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, NoReturn, TextIO

from vllm_hotfix.judging import verdicts
from vllm_hotfix.judging.verdicts import verdict_of

SCHEMA = 1  # the schema of status, clean and the site hook's commands
# each command's schema where it has its own: verify 5 (a rank's `tokens` and `checked_tokens` are
# totals, not lists per forward), audit 3 (`counts` and `per_id` over the files; `files` names the
# wrong and n/a ones unless --list-every-file); audit-merge prints an audit document
SCHEMAS = {"verify": 5, "audit": 3, "audit-merge": 3}


def document(
    command: str, exit_code: int, reason: str, verdict: str | None = None, **fields: Any
) -> dict[str, Any]:
    """A `--json` document: the envelope's keys first, in their order, then the command's own."""
    head = {
        "schema": SCHEMAS.get(command, SCHEMA),
        "command": command,
        "verdict": verdict or verdict_of(exit_code),
        "exit_code": exit_code,
        "reason": reason,
    }
    return head | {key: value for key, value in fields.items() if key not in head}


def print_document(
    command: str, exit_code: int, reason: str, stream: TextIO | None = None, **fields: Any
) -> None:
    """The document on stdout, or on `stream`: the stdout verify and audit kept where vLLM's log
    took fd 1 (session.keep_stdout)."""
    text = json.dumps(document(command, exit_code, reason, **fields), indent=2)
    print(text, file=stream or sys.stdout, flush=True)


def exit_usage(
    prog: str, message: str, as_json: bool, usage: str | None = None, stream: TextIO | None = None
) -> NoReturn:
    """One line on stderr (and a document on stdout, or `stream`, under --json); exit
    verdicts.USAGE."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    if as_json:
        reason = f"usage error: {message}"
        print_document(prog.split()[-1], verdicts.USAGE, reason, stream, error=message, usage=usage)
    sys.exit(verdicts.USAGE)


class QuietPipe:
    """A text stream whose reader may go away (`vllm-hotfix ... | head`): once a write or flush
    meets a closed pipe the stream says nothing more, and its file descriptor is pointed at
    os.devnull so that the interpreter's last flush is quiet too. Everything else is the stream's."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._went_away()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._went_away()

    def _went_away(self) -> None:
        self._gone = True
        with contextlib.suppress(Exception):
            blank = os.open(os.devnull, os.O_WRONLY)
            os.dup2(blank, self._stream.fileno())
            os.close(blank)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
