"""A launch script: vLLM's hidden-states cache write on a batch padded as under CUDA graphs.

An earlier request's state fills the last block of a small cache-only KV cache, then a batch of 5
real rows and 3 padded ones (slot -1, PADDING_SLOT_ID) is written through vLLM's backend
(`CacheOnlyAttentionImpl.do_kv_cache_update`), through `basic_cache` itself and through
`torch.compile(basic_cache, fullgraph=True)`, and without the padded rows. vLLM's CPU runner never
pads, so the padded rows are given here as the proposer writes them on a GPU. With
HARNESS_IMPORT_HOTFIX=1 the script does `import vllm_hotfix` first. Prints `RESULT {json}`: each
cache after the writes, the inputs, and whether (and how) the hotfix decided `basic_cache`.
"""

import os

if os.environ.get("HARNESS_IMPORT_HOTFIX") == "1":
    import vllm_hotfix  # noqa: F401  (arms: the module below is patched on import)

import json
import sys

BLOCKS, BLOCK_SIZE, HEADS, HIDDEN = 4, 4, 3, 8  # the cache-only layer: [blocks, block size, ids, hidden]
LAST_SLOT = BLOCKS * BLOCK_SIZE - 1
FIX = "hidden-states-padding-slot"


def main() -> None:
    import torch
    from vllm.model_executor.models import extract_hidden_states as ehs

    torch.manual_seed(0)
    stored = torch.randn(BLOCK_SIZE, HEADS, HIDDEN)  # an earlier request's prompt, the whole last block
    batch = torch.randn(8, HEADS, HIDDEN)
    padded = torch.tensor([4, 5, 6, 7, 8, -1, -1, -1])  # 5 real rows, 3 padding rows (PADDING_SLOT_ID)
    impl = ehs.CacheOnlyAttentionImpl(HEADS, HIDDEN, "auto", torch.float32)

    def run(write, slots, rows):  # type: ignore[no-untyped-def]
        cache = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, HIDDEN)
        write(stored, cache, torch.arange(LAST_SLOT + 1 - BLOCK_SIZE, LAST_SLOT + 1))
        write(rows, cache, slots)
        return cache.tolist()

    def backend(rows, cache, slots):  # type: ignore[no-untyped-def]
        impl.do_kv_cache_update(None, rows, cache, slots)

    compiled = torch.compile(ehs.basic_cache, fullgraph=True, backend="inductor")
    decision = None
    if "vllm_hotfix" in sys.modules:
        fixes = sys.modules["vllm_hotfix"].status()["fixes"]
        decision = {f["fix"]: f["decision"] for f in fixes}[FIX]
    result = {
        "stored": stored.tolist(),
        "batch": batch.tolist(),
        "backend": run(backend, padded, batch),
        "function": run(ehs.basic_cache, padded, batch),
        "compiled": run(compiled, padded, batch),
        "unpadded": run(backend, padded[:5], batch[:5]),
        "patched": "vllm_hotfix" in ehs.basic_cache.__qualname__,
        "decision": decision,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
