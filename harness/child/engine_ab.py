"""Engine throughput A/B in ONE engine: stock forward against patched, generate call by generate call.

Separate engines differ from start to start by more than the fix can cost (measured here: 4 rounds of
fresh engines gave ratios 1.009-1.153 for the same forward), so a 1% difference cannot be told that
way. Here vLLM's engine runs in this process (V1 multiprocessing off, eager) with the hotfix imported
and the extract_hidden_states speculative method on; between generate calls the class's forward is
swapped between stock (the original the hotfix keeps as `__wrapped__`) and patched. In eager mode
vLLM looks the forward up on the class at every step, so everything else (scheduler, sampler, KV
cache, the speculative proposer) is the same object for both sides. Rounds alternate the order; each
generate call is timed on its own; the ratio per round is patched tokens/s over stock tokens/s.

The ids must leave out the final layer: stock cannot produce it (that is the bug), so with it the
two sides would not do the same work. Writes JSON to --out. Used by benchmarks/engine_throughput.py.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import in_process  # a sibling module: this script's directory is on sys.path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--ids", default="1,2")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    in_process.set_defaults()
    import vllm_hotfix  # noqa: F401  (patches DeepseekV2Model when vLLM imports it: first)

    # isort: split
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models import deepseek_v2

    ids = [int(x) for x in args.ids.split(",")]
    llm = LLM(
        model=args.checkpoint,
        **in_process.TINY_ENGINE,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        },
    )
    cls = deepseek_v2.DeepseekV2Model
    patched = vars(cls)["forward"]
    assert getattr(patched, "__vllm_hotfix__", None) is not None, "the forward is not patched"
    forwards = {"stock": patched.__wrapped__, "patched": patched}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    calls = {"stock": 0, "patched": 0}  # forwards run per side: proof that the swap took effect

    def counting(name: str, forward):
        def run(self, *a, **k):
            calls[name] += 1
            return forward(self, *a, **k)

        return run

    def generate(name: str) -> tuple[float, list[int]]:
        cls.forward = counting(name, forwards[name])
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": in_process.PROMPT}], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = list(out[0].outputs[0].token_ids)
        return len(tokens) / seconds, tokens

    for _ in range(args.warmup):
        for name in forwards:
            generate(name)
    rates: dict[str, list[float]] = {"stock": [], "patched": []}
    outputs: dict[str, list[int]] = {}
    for n in range(args.rounds):
        for name in ("stock", "patched") if n % 2 == 0 else ("patched", "stock"):
            rate, tokens = generate(name)
            rates[name].append(rate)
            outputs.setdefault(name, tokens)
    cls.forward = patched
    ratios = [p / s for p, s in zip(rates["patched"], rates["stock"], strict=True)]
    with open(args.out, "w") as handle:
        json.dump(
            {
                "vllm": vllm.__version__,
                "torch": str(torch.__version__),
                "ids": ids,
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "rates": rates,
                "ratios": ratios,
                "forward_calls": calls,
                "same_tokens": outputs["stock"] == outputs["patched"],
            },
            handle,
            indent=1,
        )
    os._exit(0)  # the in-process engine's shutdown can hang on CPU


if __name__ == "__main__":
    main()
