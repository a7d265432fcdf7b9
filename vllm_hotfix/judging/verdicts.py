"""What every `vllm-hotfix` command says: its exit code, the verdict word the code means, and the
statuses of an id or a file. One scheme, so that a script reads every command alike; the check and
the audit both judge, so the words live here, below both.

A usage error has a code of its own, never shared with a verdict, and is reported before any slow
work (before vLLM is imported). docs/usage.md lists the codes.
"""

from __future__ import annotations

from typing import Any

OK = 0  # verify PASS, audit: every checked file ok, status: every fix decided, a command done
WRONG = 1  # verify FAIL, audit: a file is wrong
INCOMPLETE = 2  # not everything asked could be checked or decided (UNKNOWN, a fix unknown/failed)
ERROR = 3  # the command or vLLM failed while it ran (an engine that would not start, a file unwritable)
USAGE = 4  # a bad argument, path or setting: nothing was run

MEANINGS = {
    OK: "ok: PASS, every file ok, every fix decided",
    WRONG: "something is wrong: FAIL, a wrong file",
    INCOMPLETE: "not everything could be checked or decided",
    ERROR: "the command or vLLM failed while it ran",
    USAGE: "usage error: a bad argument, path or setting; nothing was run",
}

PASS, FAIL, UNKNOWN = "PASS", "FAIL", "UNKNOWN"  # a run's verdict: OK, WRONG, any other code
STATUSES = ("ok", "wrong", "n/a")  # an id's or a file's status
COMPARED = ("ok", "wrong")  # the statuses of what was compared (else n/a)


def verdict_of(exit_code: int) -> str:
    """The verdict an exit code means, the same for every command."""
    return PASS if exit_code == OK else FAIL if exit_code == WRONG else UNKNOWN


class UsageError(Exception):
    """A bad argument, path or setting, found before anything ran: exit USAGE."""


def take_largest(row: dict[str, Any], figure: float | None, **where: Any) -> None:
    """Fold one more `max_rel_diff` into `row`: the larger kept, with where it was (`where`, e.g.
    the file); the one fold of the check's ids over ranks and the audit's ids over files."""
    if figure is not None and (row.get("max_rel_diff") is None or figure > row["max_rel_diff"]):
        row["max_rel_diff"] = figure
        row.update(where)
