#!/usr/bin/env python3
"""Regenerate docs/verification.md's benchmark table from benchmarks/results/*.json (written by the
benchmarks), its release-matrix table from benchmarks/results/matrix/*.json (scripts/matrix.sh) and
its model-zoo table from benchmarks/results/zoo/*.json (scripts/zoo_sweep.py).

Only the text between `<!-- benchmarks:start -->` and `<!-- benchmarks:end -->`, between
`<!-- matrix:start -->` and `<!-- matrix:end -->`, and between `<!-- zoo:start -->` and
`<!-- zoo:end -->`, is replaced. `--check` writes nothing and exits 1 when a table differs from the
result files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import tables  # noqa: E402
from harness.marked_block import write_or_check  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "verification.md", help="the marked file")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if out of date")
    args = parser.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    updated = tables.with_table(text, tables.benchmark_table(), tables.BENCHMARK_MARKERS)
    updated = tables.with_table(updated, tables.matrix_table(), tables.MATRIX_MARKERS)
    updated = tables.with_table(updated, tables.zoo_table(), tables.ZOO_MARKERS)
    return write_or_check(
        args.doc,
        text,
        updated,
        what="the benchmark, matrix and model-zoo tables",
        check=args.check,
        script=__file__,
    )


if __name__ == "__main__":
    sys.exit(main())
