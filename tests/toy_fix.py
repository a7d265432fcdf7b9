"""A toy fix and its target module, made here: for the tests of decide() and the engine without vLLM."""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from pathlib import Path

import pytest

from vllm_hotfix.fixes.base import Fix, Probe
from vllm_hotfix.runtime import settings
from vllm_hotfix.runtime.decisions import Decision

BUGGY = "def scale(x):\n    return x * 2\n"
FIXED = "def scale(x):\n    return x * 3\n"
NO_SWITCHES = settings.read_settings(("toy",), environ={})


class ToyFix(Fix):
    """`scale` must multiply by 3: `* 2` is the known buggy shape, `* 3` upstream's."""

    fix_id = "toy"
    title = "a toy fix"
    module = "vllm_hotfix_toy_target"
    owner = None
    attribute = "scale"
    affected = ("0.1.0", "0.2.0")
    fixed_in = "0.3.0"
    upstream = "nowhere"

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        if "* 2" in source:
            return Probe(Decision.PATCHED, "multiplies by 2")
        if "* 3" in source:
            return Probe(Decision.FIXED_UPSTREAM, "multiplies by 3")
        return Probe(Decision.UNKNOWN, "multiplies by something else")

    def transform_source(self, source: str) -> str:
        return source.replace("* 2", "* 3")


TOY = ToyFix()


def load(tmp_path: Path, source: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """`source` as the module TOY targets, from a real file (decide reads the function's source),
    for the length of the test; generated sources go under `tmp_path`."""
    monkeypatch.setenv("VLLMHOTFIX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)  # no vLLM version to cross-check
    path = tmp_path / "toy_target.py"
    path.write_text(source)
    made = types.ModuleType(TOY.module)
    made.__file__ = str(path)
    exec(compile(source, str(path), "exec"), made.__dict__)
    monkeypatch.setitem(sys.modules, TOY.module, made)
    return made
