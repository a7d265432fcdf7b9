"""What every `vllm-hotfix` command prints for machines, and how it says it was used wrongly.

One JSON envelope (`document`): each `--json` document begins with `schema` (the command's own,
raised when one of its keys changes meaning or goes), `command`, `verdict`, `exit_code` and
`reason`, in that order, then the command's own keys; it is the only thing on stdout. `verdict` is
PASS (exit 0), FAIL (exit 1) or UNKNOWN (2 to 4), for every command. A usage error is one line on
stderr, and under `--json` also a document on stdout, before any slow work; it exits
exit_codes.USAGE.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TextIO

from vllm_hotfix.judging import exit_codes

SCHEMA = 1  # the schema of status, clean and the site hook's commands
# each command's schema where it has its own: verify 5 (a rank's `tokens` and `checked_tokens` are
# totals, not lists per forward), audit 3 (`counts` and `per_id` over the files; `files` names the
# wrong and n/a ones unless --list-every-file); audit-merge prints an audit document
SCHEMAS = {"verify": 5, "audit": 3, "audit-merge": 3}
PASS, FAIL, UNKNOWN = "PASS", "FAIL", "UNKNOWN"


def verdict_of(exit_code: int) -> str:
    """The verdict an exit code means, the same for every command."""
    return PASS if exit_code == exit_codes.OK else FAIL if exit_code == exit_codes.WRONG else UNKNOWN


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


class UsageError(Exception):
    """A bad argument, path or setting, found before anything ran."""


def exit_usage(
    prog: str, message: str, as_json: bool, usage: str | None = None, stream: TextIO | None = None
) -> NoReturn:
    """One line on stderr (and a document on stdout, or `stream`, under --json); exit
    exit_codes.USAGE."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    if as_json:
        reason = f"usage error: {message}"
        print_document(prog.split()[-1], exit_codes.USAGE, reason, stream, error=message, usage=usage)
    sys.exit(exit_codes.USAGE)


NEAR = 2  # an unknown option this close to one of the command's own is taken for a typo of it
# vLLM engine flags within NEAR of an option of ours: they go to vLLM (tests/test_cli_options.py
# checks this list against the parsers of the test environment's vLLM releases)
ENGINE_FLAGS_NEAR_OURS = frozenset({"--ubatch-size"})


def edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of neighbours that turn `a` into `b`."""
    rows = [list(range(len(b) + 1))] + [[i] + [0] * len(b) for i in range(1, len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            changed = a[i - 1] != b[j - 1]
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + changed)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                rows[i][j] = min(rows[i][j], rows[i - 2][j - 2] + 1)
    return rows[len(a)][len(b)]


class Parser(argparse.ArgumentParser):
    """argparse with the package's usage errors: exit_codes.USAGE, not argparse's 2 (which would
    read as a verdict), and a JSON document when `--json` was asked for. An unknown option that is a
    near miss of one of the command's own, or a positional given as an option (`--model`), is a usage
    error here, before a command that passes unknown options on (to vLLM's parser) imports vLLM."""

    json_requested = False  # set from the command line before parsing

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        exit_usage(self.prog, message, Parser.json_requested, self.format_usage().strip())

    def parse_known_args(  # type: ignore[override]  # typeshed's overloads; same behaviour
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._subparsers is None:  # a command's parser (a parser of commands leaves it to them)
            # before argparse's own errors: a near miss is likelier the cause than a "required"
            problem = self.not_ours(sys.argv[1:] if args is None else list(args))
            if problem is not None:
                self.error(problem)
        return super().parse_known_args(args, namespace)

    def not_ours(self, words: list[str]) -> str | None:
        """The usage error for an option word that is not one of ours but means one, None when none
        does: a positional given as an option (`--model`), or a near miss (edit distance NEAR or
        less) of one of our long options. Others (vLLM's engine flags) are left alone."""
        own = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        positionals = [action for action in self._actions if not action.option_strings]
        named = {f"--{action.dest}": action for action in positionals}
        for given in words:
            if given == "--":  # what follows is not an option of ours
                break
            word = given.split("=", 1)[0]
            if not word.startswith("--") or word in own:
                continue
            if self.allow_abbrev and any(option.startswith(word) for option in own):
                continue  # argparse takes it for ours (or says it is ambiguous)
            if word in named:
                form = " ".join(str(a.metavar or a.dest.upper()) for a in positionals)
                return (
                    f"{word}: {named[word].metavar or named[word].dest.upper()} is positional, not an"
                    f" option: {self.prog} {form} [options]"
                )
            if word.replace("_", "-") in ENGINE_FLAGS_NEAR_OURS:
                continue
            # the closest; of those as close, one the word begins (`--js`: --json, not --ids)
            near = sorted((edit_distance(word, o), not o.startswith(word), o) for o in own)
            if near and near[0][0] <= NEAR:
                return f"unrecognized argument {word}: did you mean {near[0][2]}?"
        return None


def numbers(what: str, least: int) -> Callable[[str], list[int]]:
    """An argparse type: a comma-separated list of whole numbers >= least (else a usage error)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be whole numbers, e.g. 1,4") from None
        if not values or min(values) < least:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be >= {least}")
        return values

    return parse


def seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds > 0")
    return value


_numbers = numbers("aux layer ids", 0)


def aux_ids(text: str) -> list[int]:
    """An argparse type: aux layer ids, each once (vLLM captures by membership: a repeated id is
    one state, so the files would hold fewer ids than the list names)."""
    ids = _numbers(text)
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r}: aux layer ids {repeated} repeated; name each once")
    return ids


def in_vllm_order(ids: list[int]) -> tuple[list[int], str | None]:
    """The ids in the order vLLM returns their states (ascending layer), and a note when the user's
    order differs: every release captures by a membership test inside the layer loop, so slot i of
    the states (and of the files `extract_hidden_states` writes) is the i-th smallest id."""
    ordered = sorted(ids)
    if ordered == ids:
        return ordered, None
    return ordered, (
        f"--ids {','.join(map(str, ids))} read in vLLM's order {','.join(map(str, ordered))}: vLLM"
        " returns and stores aux states in ascending layer order whatever order its config lists"
        " them; slot i of the states (and of the files' columns) is the i-th smallest id"
    )
