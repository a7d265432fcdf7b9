"""A generated block of a text file: the text between one start marker and one end marker.

The compatibility, benchmark and release-matrix tables of docs/verification.md are each such a block,
written by a script and compared by a test; one implementation keeps the three from drifting apart.
"""

from __future__ import annotations

import sys
from pathlib import Path


def block_in(text: str, start: str, end: str) -> str:
    """The text between the markers (ValueError unless there is exactly one pair, in order)."""
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one {start} and one {end}")
    first, last = text.index(start) + len(start), text.index(end)
    if last < first:
        raise ValueError(f"{end} comes before {start}")
    return text[first:last]


def with_block(text: str, block: str, start: str, end: str) -> str:
    """`text` with only the block between the markers replaced, as one line break, `block`, one line break."""
    block_in(text, start, end)  # validates the markers
    first, last = text.index(start) + len(start), text.index(end)
    return f"{text[:first]}\n{block.strip()}\n{text[last:]}"


def write_or_check(path: Path, original: str, updated: str, *, what: str, check: bool, script: str) -> int:
    """Write `updated` to `path` (or, with `check`, only compare); the exit status for the script.

    0 when the file is up to date or was written, 1 when `check` finds it out of date.
    """
    if updated == original:
        print(f"{path}: {what} up to date", file=sys.stderr)
        return 0
    if check:
        print(f"{path}: {what} out of date; run {script}", file=sys.stderr)
        return 1
    path.write_text(updated, encoding="utf-8")
    print(f"{path}: {what} updated", file=sys.stderr)
    return 0
