"""The same prompts' aux states recomputed in several batch compositions by one engine, for the
audit's precision model (benchmarks/audit_precision.py compares them across runs).

Runs vLLM with extract_hidden_states on the given ids and the given tensor-parallel size and dtype,
and generates one token for the same prompts three ways:
- `alone`: each prompt in a generate call of its own (a forward holds it and nothing else);
- `mixed`: all the prompts in one call (forwards of several prompts);
- `mixed-fillers`: the prompts in reverse order interleaved with filler prompts of other lengths
  (other neighbours, other token counts per forward).
A forward hook on the target model (TP rank 0; pickled to the workers at TP > 1, hence
VLLM_ALLOW_INSECURE_SERIALIZATION=1) writes each prompt's states, [tokens, ids, hidden] in float32
as the model returned them, to OUT/<composition>/sample-NNN.safetensors: the k-th forward that
carries a prompt is its k-th composition (the calls run one after another, each prompt once per
composition, whole in one forward: prefix caching and chunked prefill are off). Prints
`RESULT {json}`: the files written per composition.

Run with the test environment's Python:
python harness/child/precision_runs.py --checkpoint DIR --ids 1,2,3,4 --out DIR [--tp N]
    [--dtype float32|bfloat16] [--prompts N] [--longest N] [--seed N]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random

COMPOSITIONS = ("alone", "mixed", "mixed-fillers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--longest", type=int, default=200, help="prompts of 16 to this many tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    from vllm import LLM, SamplingParams

    ids = sorted(int(x) for x in args.ids.split(","))
    generator = random.Random(args.seed)

    def prompt() -> list[int]:
        return [generator.randrange(3, 1000) for _ in range(generator.randrange(16, args.longest))]

    prompts = [prompt() for _ in range(args.prompts)]
    fillers = [prompt() for _ in range(args.prompts)]
    names = {tuple(p): f"sample-{i:03d}.safetensors" for i, p in enumerate(prompts)}
    for composition in COMPOSITIONS:
        os.makedirs(os.path.join(args.out, composition), exist_ok=True)
    llm = LLM(
        model=args.checkpoint,
        dtype=args.dtype,
        max_model_len=256,
        tensor_parallel_size=args.tp,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        },
    )
    llm.apply_model(functools.partial(install_hook, names=names, out=args.out))
    sampling = SamplingParams(max_tokens=1, temperature=0.0)

    def run(batch: list[list[int]]) -> None:
        llm.generate([{"prompt_token_ids": p} for p in batch], sampling, use_tqdm=False)

    for one in prompts:  # alone
        run([one])
    run(prompts)  # mixed
    run([p for pair in zip(reversed(prompts), fillers, strict=True) for p in pair])  # mixed-fillers
    result = {c: sorted(os.listdir(os.path.join(args.out, c))) for c in COMPOSITIONS}
    print("RESULT " + json.dumps(result), flush=True)


def install_hook(model: object, names: dict, out: str) -> int:
    """The forward hook that writes each named prompt's states, per composition (TP rank 0 only)."""
    import torch
    from safetensors.torch import save_file
    from vllm.distributed import parallel_state
    from vllm.forward_context import get_forward_context

    if parallel_state.get_tp_group().rank_in_group != 0:
        return 0
    seen: dict[str, int] = {}

    def hook(module: object, hook_args: tuple, kwargs: dict, output: object) -> None:
        if not (isinstance(output, tuple) and len(output) == 2):
            return
        if get_forward_context().attn_metadata is None:
            return
        input_ids, positions = kwargs["input_ids"], kwargs["positions"]
        starts = [int(i) for i in (positions == 0).nonzero().flatten()] + [int(positions.shape[0])]
        for start, end in itertools.pairwise(starts):
            name = names.get(tuple(input_ids[start:end].tolist()))
            if name is None:
                continue
            composition = COMPOSITIONS[min(seen.get(name, 0), len(COMPOSITIONS) - 1)]
            seen[name] = seen.get(name, 0) + 1
            states = torch.stack([a[start:end].float().cpu() for a in output[1]], dim=1)
            tensors = {"hidden_states": states.contiguous(), "token_ids": input_ids[start:end].cpu()}
            save_file(tensors, os.path.join(out, composition, name))

    model.register_forward_hook(hook, with_kwargs=True)
    return 1


if __name__ == "__main__":
    main()
