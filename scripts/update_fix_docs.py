#!/usr/bin/env python3
"""Regenerate docs/fixes.md's per-fix headers from the fix modules' docstrings (harness/fix_docs.py).

Only the text between `<!-- fix-header:MODULE:start -->` and `<!-- fix-header:MODULE:end -->` is
replaced, one block per module of vllm_hotfix/fixes/ that defines a registered fix. `--check`
writes nothing and exits 1 when a block differs from its module's docstring.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a clone without installing the package

from harness import fix_docs  # noqa: E402
from harness.marked_block import write_or_check  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--doc", type=Path, default=fix_docs.DOC, help="the marked file")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if out of date")
    args = parser.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    try:
        updated = fix_docs.with_headers(text, fix_docs.all_headers())
    except ValueError as error:
        print(f"{args.doc}: {error}", file=sys.stderr)
        return 2
    return write_or_check(
        args.doc, text, updated, what="the fixes' headers", check=args.check, script=__file__
    )


if __name__ == "__main__":
    sys.exit(main())
