"""Make a dataset of aux states as the audit reads them, on the real engine (tests only).

Runs vLLM with extract_hidden_states on the given ids and writes, per prompt, what the model
returned for it as the files of ExampleHiddenStatesConnector and speculators' generate-offline-data
hold it: one safetensors file with `hidden_states` [tokens, ids, hidden] and `token_ids` [tokens].
A forward hook on the target model (installed with vLLM's `apply_model`, the engine in this process)
reads each prefill, split into its prompts by position; prefix caching and chunked prefill are off,
so each prompt is whole in one forward. Prints `RESULT {json}`: the files written, and whether the
hotfix was loaded (by vLLM's plugin loader, where the caller put the installed plugin on the path):
a dataset "made by stock vLLM" is one the hotfix never touched.

With `--connector DIR` the same engine also saves each prompt through vLLM's own
ExampleHiddenStatesConnector into DIR (its save path is CUDA-only: put harness/child/sites/cpu_connector
on PYTHONPATH), and the result adds, per file name, the connector's file, and per TP rank the block
sizes the connector used and the cache it read has: two copies of the same forward, the model's and
the connector's. At TP > 1 the hook is pickled to the workers (VLLM_ALLOW_INSECURE_SERIALIZATION=1).

Run with the test environment's Python:
python harness/child/aux_dataset.py --checkpoint DIR --ids 1,2,3,4 --out DIR [--prompts N] [--longest N]
    [--shortest N]
    [--engine-kwargs JSON]   (LLM's arguments to add or replace, e.g. '{"max_model_len": 512}')
    [--connector DIR]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--longest", type=int, default=40, help="prompts of 5 to this many tokens")
    parser.add_argument(
        "--shortest", type=int, default=5, help="prompts of at least this many tokens (all of it if =)"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager (default: compiled)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-kwargs", default="{}", help="a JSON object of LLM arguments to add or replace"
    )
    parser.add_argument("--connector", help="also save through ExampleHiddenStatesConnector into DIR")
    args = parser.parse_args()
    # The engine core in this process: `apply_model` reaches the model (TP=1: directly).
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_MLA_DISABLE": "1"}.items():
        os.environ.setdefault(key, value)

    from vllm import LLM, SamplingParams

    ids = sorted(int(x) for x in args.ids.split(","))
    generator = random.Random(args.seed)
    prompts = [
        [generator.randrange(1, 1000) for _ in range(length(generator, args.shortest, args.longest))]
        for _ in range(args.prompts)
    ]
    names = {tuple(p): f"sample-{i:03d}.safetensors" for i, p in enumerate(prompts)}
    os.makedirs(args.out, exist_ok=True)
    options = {
        "model": args.checkpoint,
        "dtype": args.dtype,
        "max_model_len": 256,
        "enforce_eager": args.eager,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        },
    }
    if args.connector:
        options["kv_transfer_config"] = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": args.connector},
        }
    llm = LLM(**{**options, **json.loads(args.engine_kwargs)})
    # top-level functions, bound by partial: a TP > 1 engine pickles them to its worker processes
    llm.apply_model(functools.partial(install_hook, names=names, out=args.out))
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(requests, SamplingParams(max_tokens=1), use_tqdm=False)
    result = {"files": sorted(os.listdir(args.out)), "hotfix": "vllm_hotfix" in sys.modules}
    if args.connector:
        result["connector"] = connector_files(llm, prompts, outputs, names)
    print("RESULT " + json.dumps(result), flush=True)


def length(generator: random.Random, shortest: int, longest: int) -> int:
    """A prompt's length: from `shortest` up to `longest` (exclusive), or exactly `longest` where the
    two are equal; the default 5 draws what the dataset always drew, so its files stay the same."""
    return longest if shortest >= longest else generator.randrange(shortest, longest)


def install_hook(model: object, names: dict, out: str) -> int:
    """The forward hook that writes each named prompt's aux states (TP rank 0 only)."""
    import torch
    from safetensors.torch import save_file
    from vllm.distributed import parallel_state
    from vllm.forward_context import get_forward_context

    if parallel_state.get_tp_group().rank_in_group != 0:
        return 0

    def hook(module: object, hook_args: tuple, kwargs: dict, output: object) -> None:
        if not (isinstance(output, tuple) and len(output) == 2):
            return
        if get_forward_context().attn_metadata is None:
            return
        input_ids, positions = kwargs["input_ids"], kwargs["positions"]
        starts = [int(i) for i in (positions == 0).nonzero().flatten()] + [int(positions.shape[0])]
        for start, end in itertools.pairwise(starts):
            name = names.get(tuple(input_ids[start:end].tolist()))
            if name is not None:
                states = torch.stack([a[start:end].float().cpu() for a in output[1]], dim=1)
                tensors = {"hidden_states": states.contiguous(), "token_ids": input_ids[start:end].cpu()}
                save_file(tensors, os.path.join(out, name))

    model.register_forward_hook(hook, with_kwargs=True)
    return 1


def connector_files(llm: object, prompts: list[list[int]], outputs: list, names: dict) -> dict:
    """Per file name, the file ExampleHiddenStatesConnector saved for that prompt (once its writer
    thread has released the file's lock); the block sizes: vLLM's global one, the connector's (the
    one it rebuilds slots with) and that of the cache it reads (the hidden-states group's)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    files = {
        names[tuple(prompt)]: (output.kv_transfer_params or {})["hidden_states_path"]
        for prompt, output in zip(prompts, outputs, strict=True)
    }
    # The connector is handed a finished request's saves at the engine's next step; a separate engine
    # core (vLLM's default) takes that step in its busy loop, the engine in this process on request.
    for _ in range(20):
        if all(os.path.exists(path) for path in files.values()):
            break
        llm.llm_engine.step()
    missing = [path for path in files.values() if not os.path.exists(path)]
    if missing:  # its lock would never be released: fail rather than wait for ever
        raise RuntimeError(f"the connector saved no file for: {missing}")
    for path in files.values():
        load_hidden_states(path)  # blocks until the writer thread has saved it (its lock)
    return {"files": files, "ranks": llm.apply_model(connector_block_sizes)}


def connector_block_sizes(model: object) -> dict:
    """This worker's: vLLM's global block size as its config has it, the connector's, its cache's."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    return {
        "global_block_size": connector._vllm_config.cache_config.block_size,
        "block_size": connector._block_size,
        "cache_block_size": int(connector._kv_cache.shape[1]),
    }


if __name__ == "__main__":
    main()
