"""A launch script: one engine with extract_hidden_states whose proposer pads its batch as under CUDA
graphs (a test-only stand-in), printing where the cache-only KV cache's contents went.

vLLM's CPU runner captures no CUDA graphs, so the extract_hidden_states proposer never pads there.
This script wraps the proposer's own `_determine_batch_execution_and_padding` so that the token
count it returns is rounded up to a multiple of PAD, as the CUDA-graph dispatcher rounds a batch up
to the next captured size; the proposer then fills the padded rows' slots with PADDING_SLOT_ID (-1)
itself (`_get_slot_mapping`), as on a GPU. Nothing else of vLLM is replaced. The engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the wrapper and the cache are reachable.
With HARNESS_IMPORT_HOTFIX=1 the script does `import vllm_hotfix` first, as a user's script would.
Saves the cache-only layer's KV cache (torch.save) to --out and prints `RESULT {json}`.
"""

import os

if os.environ.get("HARNESS_IMPORT_HOTFIX") == "1":
    import vllm_hotfix  # noqa: F401

import argparse
import gc
import json
import sys

PAD = 8  # the captured batch sizes' step: every batch is padded up to a multiple of it
PROMPTS = [[5, 17, 42, 99, 123, 7, 300, 512, 64, 800, 11, 256], [9, 8, 7]]


def pad_like_cuda_graphs() -> None:
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    original = ExtractHiddenStatesProposer._determine_batch_execution_and_padding

    def padded(self, num_tokens, use_cudagraphs=True):  # type: ignore[no-untyped-def]
        mode, num_input_tokens, across_dp = original(self, num_tokens, use_cudagraphs)
        return mode, -(-num_input_tokens // PAD) * PAD, across_dp

    ExtractHiddenStatesProposer._determine_batch_execution_and_padding = padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--ids", default="1,2")
    parser.add_argument("--out", required=True)
    parser.add_argument("--blocks", type=int, default=4, help="KV-cache blocks (num_gpu_blocks_override)")
    args = parser.parse_args()
    for key, value in {
        "VLLM_MLA_DISABLE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }.items():
        os.environ.setdefault(key, value)

    import torch
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

    pad_like_cuda_graphs()
    ids = [int(x) for x in args.ids.split(",")]
    llm = LLM(
        model=args.checkpoint,
        dtype="float32",
        max_model_len=64,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        seed=0,
        num_gpu_blocks_override=args.blocks,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        },
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    layers = [layer for name, layer in context.items() if isinstance(layer, CacheOnlyAttentionLayer)]
    layers = layers or [o for o in gc.get_objects() if isinstance(o, CacheOnlyAttentionLayer)]
    assert len(layers) == 1, sorted(context)
    cache = layers[0].kv_cache
    torch.save(cache.clone(), args.out)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "shape": list(cache.shape),
        "patched": "vllm_hotfix" in sys.modules[CacheOnlyAttentionLayer.__module__].basic_cache.__qualname__,
    }
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
