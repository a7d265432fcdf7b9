"""The exit codes of every `vllm-hotfix` command: one scheme, so that a script reads them alike.

A usage error has a code of its own, never shared with a verdict, and is reported before any slow
work (before vLLM is imported). docs/usage.md lists them.
"""

from __future__ import annotations

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
