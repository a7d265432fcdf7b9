"""The fix on the real model: patched vLLM 0.24.0 returns what vLLM 0.25.0 returns, bit for bit.

Each run builds the real DeepseekV3ForCausalLM of that vLLM release through vLLM's own engine (its
config, distributed context, weight loader and runner) on the tiny checkpoint, and reads the
states DeepseekV2Model returns on a real prefill (see harness/child/model_states.py).
"""

from __future__ import annotations

import pytest
import torch

from harness.testenv import BUG, FIXED
from tests.runs import EAGER_GROUP, EAGER_OPTIONS, EAGER_VARIANTS, WITH_FINAL, WITHOUT_FINAL

pytestmark = [pytest.mark.vllm, pytest.mark.engine]  # model_states runs vLLM's LLM engine


def assert_same(patched: dict, upstream: dict, label: str) -> None:
    assert patched["kind"] == upstream["kind"], f"{label}: {patched['kind']} vs {upstream['kind']}"
    assert torch.equal(patched["hidden"], upstream["hidden"]), f"{label}: normed output differs"
    if upstream["aux"] is None:
        assert patched["aux"] is None
        return
    assert len(patched["aux"]) == len(upstream["aux"]), (
        f"{label}: {len(patched['aux'])} aux states vs {len(upstream['aux'])}"
    )
    for i, (mine, theirs) in enumerate(zip(patched["aux"], upstream["aux"], strict=True)):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), f"{label}: aux state {i} differs"


@EAGER_GROUP
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_patched_equals_upstream(model_states, dtype: str) -> None:
    patched = model_states(BUG, True, EAGER_VARIANTS, dtype, options=EAGER_OPTIONS)
    upstream = model_states(FIXED, False, EAGER_VARIANTS, dtype, options=EAGER_OPTIONS)
    assert patched["vllm_version"] == BUG and patched["patched"]
    assert upstream["vllm_version"] == FIXED and not upstream["patched"]
    for variant in WITH_FINAL + WITHOUT_FINAL:
        assert_same(patched["variants"][variant], upstream["variants"][variant], f"{dtype} ids [{variant}]")
    # The final id alone gives (hidden_states, [final_state]), not a bare tensor.
    only_final = patched["variants"]["4"]
    assert only_final["kind"] == "tuple" and len(only_final["aux"]) == 1


@EAGER_GROUP
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_unpatched_reproduces_the_bug(model_states, dtype: str) -> None:
    """Proves the comparison above can fail: stock 0.24.0 drops the final state."""
    stock = model_states(BUG, False, EAGER_VARIANTS, dtype, options=EAGER_OPTIONS)
    upstream = model_states(FIXED, False, EAGER_VARIANTS, dtype, options=EAGER_OPTIONS)
    assert not stock["patched"]
    assert len(stock["variants"]["1,4"]["aux"]) == 1 and len(upstream["variants"]["1,4"]["aux"]) == 2
    assert stock["variants"]["4"]["kind"] == "tensor"  # the start-up ValueError of the bug
    for variant in WITHOUT_FINAL:
        assert_same(stock["variants"][variant], upstream["variants"][variant], f"stock {dtype} [{variant}]")


@EAGER_GROUP
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_patched_equals_unpatched_without_final_id(model_states, dtype: str) -> None:
    patched = model_states(BUG, True, EAGER_VARIANTS, dtype, options=EAGER_OPTIONS)
    stock = model_states(BUG, False, EAGER_VARIANTS, dtype, options=EAGER_OPTIONS)
    for variant in WITHOUT_FINAL:
        assert_same(patched["variants"][variant], stock["variants"][variant], f"{dtype} [{variant}]")
    # Every state the bug did return is unchanged too; only the final one is added.
    assert torch.equal(patched["variants"]["1,4"]["aux"][0], stock["variants"]["1,4"]["aux"][0])


@EAGER_GROUP
def test_final_state_is_the_prenorm_sum(model_states) -> None:
    """In float32, RMSNorm(final aux state) * weight is the model's normed output (notes)."""
    patched = model_states(BUG, True, EAGER_VARIANTS, "float32", options=EAGER_OPTIONS)
    final = patched["variants"]["4"]["aux"][0]
    hidden = patched["variants"]["4"]["hidden"]
    assert not torch.equal(final, hidden)
    normed = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(
        normed / normed.norm(dim=-1, keepdim=True), hidden / hidden.norm(dim=-1, keepdim=True), atol=1e-4
    )


# bfloat16 compiled is in the long suite (scripts/long-tests.sh); CI keeps it eager (above).
COMPILED = [("1,4", "float32"), pytest.param("1,2,4", "bfloat16", marks=pytest.mark.long)]


@pytest.mark.parametrize(("variant", "dtype"), COMPILED)
def test_compiled_patched_equals_upstream(model_states, variant: str, dtype: str) -> None:
    """Through DeepseekV2Model's own @support_torch_compile path, ahead-of-time compile on."""
    patched = model_states(BUG, True, variant, dtype, "compile")
    upstream = model_states(FIXED, False, variant, dtype, "compile")
    for run in (patched, upstream):
        assert run["compiled"] and run["aot_compiled"], "not compiled through the ahead-of-time path"
        assert run["aot_compile_env"] and run["bytecode_hook_env"]  # vLLM's defaults: both on
    assert patched["patched"]
    assert_same(patched["variants"][variant], upstream["variants"][variant], f"compiled {dtype} [{variant}]")


def test_compiled_without_final_id_is_unchanged(model_states) -> None:
    patched = model_states(BUG, True, "1,2", "float32", "compile")
    stock = model_states(BUG, False, "1,2", "float32", "compile")
    assert patched["compiled"] and stock["compiled"]
    assert_same(patched["variants"]["1,2"], stock["variants"]["1,2"], "compiled [1,2]")
