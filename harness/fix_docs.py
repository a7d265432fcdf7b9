"""The short header of each fix, read from its module's docstring, and its place in docs/fixes.md.

Every module of `vllm_hotfix/fixes/` that defines a registered fix opens its docstring with one
form: a summary line, then one paragraph each, in this order, opened by its label: `Why:`, `How:`,
`Affected releases:`, `Upstream:`, `When to drop:`. Anything after them is notes for the code's
reader. docs/fixes.md holds each module's header, rendered, between
`<!-- fix-header:MODULE:start -->` and `<!-- fix-header:MODULE:end -->` in its fix's section
(`scripts/update_fix_docs.py` writes them, tests/test_fix_docs.py holds them); the long evidence
follows by hand.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

from harness.marked_block import block_in, with_block
from vllm_hotfix.fixes import ALL_FIXES, Fix

REPO = Path(__file__).resolve().parent.parent
FIXES_DIR = REPO / "vllm_hotfix" / "fixes"
DOC = REPO / "docs" / "fixes.md"
SCRIPT = "scripts/update_fix_docs.py"
LABELS = ("Why", "How", "Affected releases", "Upstream", "When to drop")
WIDTH = 100


@dataclass(frozen=True)
class Header:
    """One fix module's header: its summary line and one text per label, in LABELS' order."""

    module: str  # the module's file name without .py, e.g. "deepseek_final_aux"
    summary: str
    parts: tuple[str, ...]


def fix_modules() -> dict[str, list[Fix]]:
    """Each module that defines a registered fix, with its fixes, in the registry's order."""
    found: dict[str, list[Fix]] = {}
    for fix in ALL_FIXES:
        found.setdefault(type(fix).__module__.rsplit(".", 1)[-1], []).append(fix)
    return found


def _flat(paragraph: str) -> str:
    return " ".join(paragraph.split())


def parse(module: str, docstring: str | None) -> Header:
    """The header `docstring` opens with; ValueError naming what is not in the form."""
    if not docstring:
        raise ValueError(f"fixes/{module}.py has no docstring")
    paragraphs = [p for p in inspect.cleandoc(docstring).split("\n\n") if p.strip()]
    if len(paragraphs) < 1 + len(LABELS):
        raise ValueError(f"fixes/{module}.py: the docstring needs a summary and {', '.join(LABELS)}")
    parts = []
    for label, paragraph in zip(LABELS, paragraphs[1 : 1 + len(LABELS)], strict=True):
        if not paragraph.startswith(f"{label}: "):
            found = _flat(paragraph)[:40]
            raise ValueError(
                f"fixes/{module}.py: expected a paragraph opened by '{label}: ', found {found!r}"
            )
        parts.append(_flat(paragraph[len(label) + 2 :]))
    return Header(module, _flat(paragraphs[0]), tuple(parts))


def header(module: str, root: Path = FIXES_DIR) -> Header:
    """The header of fixes/`module`.py, read from its file (not imported)."""
    source = (root / f"{module}.py").read_text(encoding="utf-8")
    return parse(module, ast.get_docstring(ast.parse(source), clean=False))


def markers(module: str) -> tuple[str, str]:
    return f"<!-- fix-header:{module}:start -->", f"<!-- fix-header:{module}:end -->"


def _wrapped(text: str, first: str = "", rest: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)


def render(found: Header, fixes: list[Fix]) -> str:
    """The block docs/fixes.md shows for one module: where it is, what it patches, its header."""
    path = f"vllm_hotfix/fixes/{found.module}.py"
    if len(fixes) == 1:
        targets = f"Target: `{fixes[0].target}`."
    else:
        targets = "Targets: " + ", ".join(f"`{fix.target}` (`{fix.fix_id}`)" for fix in fixes) + "."
    lines = [
        _wrapped(f"*Generated from the docstring of `{path}` by `{SCRIPT}`: edit it there.*"),
        "",
        _wrapped(f"Module: `{path}`. {targets}"),
        "",
        _wrapped(f"**{found.summary}**"),
        "",
    ]
    lines += [
        _wrapped(f"{label}: {text}", "- ", "  ") for label, text in zip(LABELS, found.parts, strict=True)
    ]
    return "\n".join(lines)


def with_headers(text: str, headers: list[Header]) -> str:
    """`text` (docs/fixes.md) with each module's block replaced by its rendering."""
    modules = fix_modules()
    for found in headers:
        text = with_block(text, render(found, modules[found.module]), *markers(found.module))
    return text


def all_headers(root: Path = FIXES_DIR) -> list[Header]:
    return [header(module, root) for module in fix_modules()]


def stale(text: str, headers: list[Header]) -> list[str]:
    """The modules whose block in `text` is not their header's rendering (or is missing)."""
    modules = fix_modules()
    wrong = []
    for found in headers:
        try:
            block = block_in(text, *markers(found.module))
        except ValueError:
            wrong.append(found.module)
            continue
        if block.strip() != render(found, modules[found.module]).strip():
            wrong.append(found.module)
    return wrong
