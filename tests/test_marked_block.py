"""The generated-block helper behind the three tables of docs/verification.md (compatibility, benchmarks,
matrix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.marked_block import block_in, with_block, write_or_check

START, END = "<!-- x:start -->", "<!-- x:end -->"


def test_with_block_replaces_only_the_block() -> None:
    text = f"head\n{START}\nold\n{END}\ntail\n"
    updated = with_block(text, "\nnew\n\n", START, END)
    assert updated == f"head\n{START}\nnew\n{END}\ntail\n"
    assert block_in(updated, START, END) == "\nnew\n"


@pytest.mark.parametrize("text", ["none\n", f"{START}{END}{START}{END}", f"{END}\n{START}\n"])
def test_markers_must_be_one_pair_in_order(text: str) -> None:
    with pytest.raises(ValueError):
        block_in(text, START, END)


def test_write_or_check(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text("old", encoding="utf-8")
    assert write_or_check(path, "old", "old", what="t", check=True, script="s") == 0
    assert write_or_check(path, "old", "new", what="t", check=True, script="s") == 1
    assert path.read_text(encoding="utf-8") == "old"  # --check never writes
    assert write_or_check(path, "old", "new", what="t", check=False, script="s") == 0
    assert path.read_text(encoding="utf-8") == "new"
