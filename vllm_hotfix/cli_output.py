"""What every `vllm-hotfix` command prints for machines, and how it says it was used wrongly.

One JSON vocabulary: each `--json` document carries `schema` (raised when a key changes meaning or
goes), `command` and `exit_code`. A usage error is one line on stderr, and under `--json` also a
document on stdout, before any slow work; it exits exit_codes.USAGE.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from vllm_hotfix import exit_codes

SCHEMA = 1


def document(command: str, exit_code: int, **fields: Any) -> dict[str, Any]:
    """A `--json` document: the common keys first, then the command's own."""
    return {"schema": SCHEMA, "command": command, "exit_code": exit_code} | fields


def print_document(command: str, exit_code: int, **fields: Any) -> None:
    print(json.dumps(document(command, exit_code, **fields), indent=2), flush=True)


class UsageError(Exception):
    """A bad argument, path or setting, found before anything ran."""


def exit_usage(prog: str, message: str, as_json: bool, usage: str | None = None, **fields: Any) -> NoReturn:
    """One line on stderr (and a document on stdout under --json, with the command's own `fields`);
    exit exit_codes.USAGE."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    if as_json:
        print_document(prog.split()[-1], exit_codes.USAGE, **fields, error=message, usage=usage)
    sys.exit(exit_codes.USAGE)


class Parser(argparse.ArgumentParser):
    """argparse with the package's usage errors: exit_codes.USAGE, not argparse's 2 (which would
    read as a verdict), and a JSON document when `--json` was asked for."""

    json_requested = False  # set from the command line before parsing

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        exit_usage(self.prog, message, Parser.json_requested, self.format_usage().strip())


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
        f"--ids {','.join(map(str, ids))}: vLLM returns aux states in ascending layer order, whatever"
        f" order the config lists; slot i of the states is layer {ordered}[i], and this run works in"
        " that order"
    )
