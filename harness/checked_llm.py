"""The engine the check's benchmarks time, defined once: the tiny checkpoint in float32, compiled
(vLLM's default), asking for aux states through `extract_hidden_states` with ids 1, 2 and 4 (the
EAGLE3 convention on 4 layers, plus the final one). benchmarks/verify_cost.py (during the window),
verify_after_window.py (after it), verify_startup.py (start-up) and gpu/bench_after_window.py (after
it, on a GPU: in bfloat16, with a share of the GPU's memory) measure this same engine."""

from __future__ import annotations

from typing import Any

IDS = [1, 2, 4]
PROMPT = [{"prompt_token_ids": [5, 17, 42, 99, 123, 7, 300, 512, 64, 800, 11, 256]}]


def checked_llm(checkpoint: str, tp: int = 1, dtype: str = "float32", **engine: Any) -> Any:
    """vLLM's `LLM` on `checkpoint` at tensor-parallel size `tp`, in `dtype`, with further `engine`
    arguments (import vllm_hotfix first)."""
    from vllm import LLM

    return LLM(
        model=checkpoint,
        dtype=dtype,
        max_model_len=128,
        max_num_batched_tokens=128,
        tensor_parallel_size=tp,
        seed=0,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": IDS}},
        },
        **engine,
    )
