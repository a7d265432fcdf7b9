"""What ExampleHiddenStatesConnector saves when prompts share a cached prefix (tests only).

Runs vLLM with `extract_hidden_states` and the connector, prefix caching left as vLLM decides it
(on by default), chunked prefill off (0.22.0-0.23.0 refuse it with this connector), block size 16,
and sends three rounds, each one `generate` call, so each round's prompts are prefilled in one step:
  1. P, a 40-token prompt;
  2. P again: its first 32 tokens (two full blocks) are cached from round 1;
  3. S, P's first 32 tokens and 8 others, together with Q, an unrelated 24-token prompt.
Prints `RESULT {json}`: per round and prompt, the prompt, vLLM's count of cached tokens and the
path of the connector's file; the engine's `enable_prefix_caching`; whether the hotfix was loaded.
The connector's save path is CUDA-only: put harness/child/sites/cpu_connector on PYTHONPATH.

python harness/child/prefix_cache_files.py --checkpoint DIR --out DIR [--ids 1,2] [--hotfix]
    [--engine-kwargs JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

PREFIX, FIRST, OTHER = 32, 40, 24


def prompts(seed: int = 0) -> list[list[list[int]]]:
    """The three rounds: [P], [P], [S, Q] (S shares P's first PREFIX tokens)."""
    generator = random.Random(seed)
    p = [generator.randrange(1, 1000) for _ in range(FIRST)]
    s = p[:PREFIX] + [generator.randrange(1, 1000) for _ in range(FIRST - PREFIX)]
    q = [generator.randrange(1, 1000) for _ in range(OTHER)]
    return [[p], [p], [s, q]]


def wait_for_files(llm: object, paths: list[str]) -> None:
    """Step the engine until the connector has written every file (0.24.0+ save a finished request
    at the next step; 0.22.0-0.23.0 in the request's step, on a writer thread), then wait on each
    file's lock, which its writer thread holds until saved."""
    import time

    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    for _ in range(120):
        if all(os.path.exists(path) for path in paths):
            break
        llm.llm_engine.step()  # type: ignore[attr-defined]
        time.sleep(0.25)
    missing = [path for path in paths if not os.path.exists(path)]
    if missing:
        raise RuntimeError(f"the connector saved no file for: {missing}")
    for path in paths:
        load_hidden_states(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ids", default="1,2")
    parser.add_argument("--engine-kwargs", default="{}")
    parser.add_argument("--hotfix", action="store_true", help="import vllm_hotfix first (on PYTHONPATH)")
    args = parser.parse_args()
    if args.hotfix:
        import vllm_hotfix  # noqa: F401  (arms its fixes before vLLM is imported)
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_MLA_DISABLE": "1"}.items():
        os.environ.setdefault(key, value)

    from vllm import LLM, SamplingParams

    options = {
        "model": args.checkpoint,
        "dtype": "float32",
        "max_model_len": 128,
        "block_size": 16,
        "enforce_eager": True,
        "enable_chunked_prefill": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in args.ids.split(",")]}
            },
        },
        "kv_transfer_config": {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": args.out},
        },
    }
    llm = LLM(**{**options, **json.loads(args.engine_kwargs)})
    rounds = []
    for batch in prompts():
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in batch], SamplingParams(max_tokens=1), use_tqdm=False
        )
        saved = [
            {
                "prompt": prompt,
                "cached": output.num_cached_tokens,
                "path": (output.kv_transfer_params or {})["hidden_states_path"],
            }
            for prompt, output in zip(batch, outputs, strict=True)
        ]
        wait_for_files(llm, [entry["path"] for entry in saved])
        rounds.append(saved)
    result = {
        "rounds": rounds,
        "prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
        "hotfix": "vllm_hotfix" in sys.modules,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
