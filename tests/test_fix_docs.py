"""docs/fixes.md's per-fix headers are the fix modules' docstrings (harness/fix_docs.py): every
module that defines a registered fix opens with the one header form, and each rendered header in
the docs equals its module's, so a docstring changed without `python scripts/update_fix_docs.py`
fails here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from harness import fix_docs

FIX = "run `python scripts/update_fix_docs.py`"


@pytest.mark.parametrize("module", sorted(fix_docs.fix_modules()))
def test_every_fix_module_opens_with_the_header_form(module: str) -> None:
    found = fix_docs.header(module)
    assert found.summary and all(found.parts), found


def test_the_docs_show_each_modules_header_as_its_docstring_says() -> None:
    text = fix_docs.DOC.read_text(encoding="utf-8")
    assert fix_docs.stale(text, fix_docs.all_headers()) == [], FIX


def test_a_docstring_edited_without_regenerating_the_docs_is_caught(tmp_path: Path) -> None:
    """A planted edit: one word of one module's header changed in a copy of the fixes."""
    copy = tmp_path / "fixes"
    shutil.copytree(fix_docs.FIXES_DIR, copy)
    module = copy / "deepseek_final_aux.py"
    source = module.read_text(encoding="utf-8")
    module.write_text(
        source.replace("Upstream: vLLM PR #46973", "Upstream: vLLM PR #46974", 1), encoding="utf-8"
    )
    text = fix_docs.DOC.read_text(encoding="utf-8")
    assert fix_docs.stale(text, fix_docs.all_headers(copy)) == ["deepseek_final_aux"]
    regenerated = fix_docs.with_headers(text, fix_docs.all_headers(copy))
    assert fix_docs.stale(regenerated, fix_docs.all_headers(copy)) == []


def test_a_module_out_of_the_form_is_named() -> None:
    with pytest.raises(ValueError, match="expected a paragraph opened by 'How: '"):
        fix_docs.parse("planted", "Summary.\n\nWhy: a bug.\n\nWhat: a fix.\n\nA.\n\nB.\n\nC.\n")
    with pytest.raises(ValueError, match="needs a summary"):
        fix_docs.parse("planted", "Summary.\n\nWhy: a bug.\n")
