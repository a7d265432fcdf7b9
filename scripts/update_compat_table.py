#!/usr/bin/env python3
"""Regenerate docs/verification.md's compatibility table from the probes' verdicts on every release
recorded in tests/sources/index.json (the snapshot scripts/refresh_sources.py writes, and calls this
after): a release published since is listed as not recorded, never put in the table, so the table
and the tests that hold it (tests/test_releases_table.py) move only when a maintainer records it.

Only the text between `<!-- compat-table:start -->` and `<!-- compat-table:end -->` is replaced.
Refuses to write when a wheel could not be read, so a network failure never lands in the table.
`--check` writes nothing and exits 1 when the committed table is out of date. Prints the table's
changed lines, so a refresh shows which verdicts a new release brought.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a clone without installing the package

from harness import releases  # noqa: E402
from harness.marked_block import write_or_check  # noqa: E402
from tests.recorded import recorded  # noqa: E402  (the releases tests/sources/index.json records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--doc", default=os.path.join(ROOT, "docs", "verification.md"), help="the marked file"
    )
    parser.add_argument("--workers", type=int, default=8, help="wheels read in parallel (default 8)")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if out of date")
    args = parser.parse_args(argv)

    with open(args.doc, encoding="utf-8") as handle:
        text = handle.read()
    try:
        releases.table_in(text)
    except ValueError as error:
        print(f"{args.doc}: {error}", file=sys.stderr)
        return 2

    started = time.monotonic()
    rows = releases.classify_all(workers=args.workers)
    print(releases.summary(rows, time.monotonic() - started), file=sys.stderr)
    if any(row.error for row in rows):
        print(f"some wheels could not be read: {args.doc} left unchanged", file=sys.stderr)
        return 2
    known = recorded()
    new = [row for row in rows if (row.dist, row.version) not in known]
    rows = [row for row in rows if (row.dist, row.version) in known]
    for row in new:
        print(f"not recorded (run scripts/refresh_sources.py): {row.dist} {row.version}", file=sys.stderr)
    for line in releases.unknowns(rows):
        print(f"warning: unknown verdict: {line}", file=sys.stderr)

    table = releases.markdown_table(rows, releases.all_probes())
    updated = releases.with_table(text, table)
    old = releases.table_in(text).strip().splitlines()
    for line in difflib.unified_diff(
        old, table.strip().splitlines(), "table before", "table now", n=0, lineterm=""
    ):
        print(line, file=sys.stderr)
    return write_or_check(
        Path(args.doc), text, updated, what="the compatibility table", check=args.check, script=__file__
    )


if __name__ == "__main__":
    sys.exit(main())
