#!/usr/bin/env python3
"""Regenerate docs/verification.md's compatibility table from the probes' verdicts on every PyPI release.

Only the text between `<!-- compat-table:start -->` and `<!-- compat-table:end -->` is replaced.
Refuses to write when a wheel could not be read, so a network failure never lands in the table.
`--check` writes nothing and exits 1 when the committed table is out of date (for CI).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a clone without installing the package

from vllm_hotfix import releases  # noqa: E402
from vllm_hotfix.releases.marked_block import write_or_check  # noqa: E402


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
    for line in releases.unknowns(rows):
        print(f"warning: unknown verdict: {line}", file=sys.stderr)

    updated = releases.with_table(text, releases.markdown_table(rows, releases.all_probes()))
    return write_or_check(
        Path(args.doc), text, updated, what="the compatibility table", check=args.check, script=__file__
    )


if __name__ == "__main__":
    sys.exit(main())
