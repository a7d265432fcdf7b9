"""Make a dataset of aux states as the audit reads them, on the real engine (tests only).

Runs vLLM with extract_hidden_states on the given ids and writes, per prompt, what the model
returned for it as the files of ExampleHiddenStatesConnector and speculators' generate-offline-data
hold it: one safetensors file with `hidden_states` [tokens, ids, hidden] and `token_ids` [tokens].
A forward hook on the target model (installed with vLLM's `apply_model`, the engine in this process)
reads each prefill, split into its prompts by position; prefix caching and chunked prefill are off,
so each prompt is whole in one forward. Prints `RESULT {json}`: the files written, and whether the
hotfix was loaded (by vLLM's plugin loader, where the caller put the installed plugin on the path):
a dataset "made by stock vLLM" is one the hotfix never touched.

Run with the test environment's Python:
python harness/child/aux_dataset.py --checkpoint DIR --ids 1,2,3,4 --out DIR [--prompts N] [--longest N]
    [--engine-kwargs JSON]   (LLM's arguments to add or replace, e.g. '{"max_model_len": 512}')
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager (default: compiled)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-kwargs", default="{}", help="a JSON object of LLM arguments to add or replace"
    )
    args = parser.parse_args()
    # The engine in this process (TP=1): `apply_model` then calls the hook's installer directly.
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_MLA_DISABLE": "1"}.items():
        os.environ.setdefault(key, value)

    from vllm import LLM, SamplingParams

    ids = sorted(int(x) for x in args.ids.split(","))
    generator = random.Random(args.seed)
    prompts = [
        [generator.randrange(1, 1000) for _ in range(generator.randrange(5, args.longest))]
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
    llm = LLM(**{**options, **json.loads(args.engine_kwargs)})
    out = args.out

    def install(model: object) -> int:
        import torch
        from safetensors.torch import save_file
        from vllm.distributed import parallel_state
        from vllm.forward_context import get_forward_context

        if parallel_state.get_tp_group().rank_in_group != 0:
            return 0

        def hook(module: object, hook_args: tuple, kwargs: dict, output: object) -> None:
            if (
                not (isinstance(output, tuple) and len(output) == 2)
                or get_forward_context().attn_metadata is None
            ):
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

    llm.apply_model(install)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    result = {"files": sorted(os.listdir(out)), "hotfix": "vllm_hotfix" in sys.modules}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
