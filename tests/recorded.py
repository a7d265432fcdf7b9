"""The releases the repository has recorded (tests/sources/index.json), and the rule for the rest.

The network tests read PyPI, which moves on its own. They judge strictly only the releases recorded
in the stored sources: a recorded release whose wheel, source or verdict changed fails the suite. A
release published after the last refresh is reported, never failed: a pytest warning of the class
`UnrecordedRelease` (its verdicts in the text, `unknown` ones included) and a section of the test
summary (tests/conftest.py), so that a new upstream release cannot turn main's CI red by itself.
Recording it is the maintainer's `python scripts/refresh_sources.py` (docs/releasing.md).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import TypeVar

from tests.stored_sources import REFRESH, index

T = TypeVar("T")
HEADING = "new upstream releases, not recorded in tests/sources/index.json"


class UnrecordedRelease(UserWarning):
    """A release on PyPI that the stored sources do not record yet (reported, not failed)."""


@functools.cache
def recorded() -> frozenset[tuple[str, str]]:
    """Every (dist, version) the stored sources record, skipped releases included."""
    return frozenset((row["dist"], row["version"]) for row in index()["releases"])


def split(found: Iterable[T], where: Callable[[T], tuple[str, str]]) -> tuple[list[T], list[T]]:
    """(the recorded ones, the new ones), each in the order found."""
    known, new = [], []
    for item in found:
        (known if where(item) in recorded() else new).append(item)
    return known, new


SEPARATOR = " | "
TO_RECORD = f"to record them: {REFRESH} (docs/releasing.md)"


def report_new(lines: Iterable[str]) -> None:
    """Warn once about the new releases (one line each, starting with `dist version`), if any."""
    lines = list(lines)
    if lines:
        text = SEPARATOR.join(lines)
        warnings.warn(UnrecordedRelease(f"{HEADING}: {text}{SEPARATOR}{TO_RECORD}"), stacklevel=2)


def summary_lines(messages: Iterable[str]) -> list[str]:
    """The test summary's section from the warnings' texts: one line per release (the most detailed
    of what the tests said of it), then how to record them."""
    found: dict[str, str] = {}
    for message in messages:
        if HEADING not in message:
            continue
        text = message.split(f"{HEADING}: ", 1)[1].split("\n", 1)[0]
        for line in text.split(SEPARATOR):
            if line != TO_RECORD:
                release = " ".join(line.split()[:2])
                found[release] = max(found.get(release, ""), line, key=len)
    return [*(found[release] for release in sorted(found)), TO_RECORD] if found else []
