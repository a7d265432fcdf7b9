"""Forward A/B of DeepseekV2Model in ONE process on ONE model instance: stock against patched.

vLLM's engine builds the real model in this process (V1 multiprocessing off, eager) with the hotfix
imported. On the first real prefill (12 tokens, with attention metadata), inside that step:
- stock = the original forward the hotfix keeps as `__wrapped__`, patched = the class's forward;
- for each aux id list and each mode (eager; `torch.compile(fullgraph=True)` of each function on
  its own, inductor, the same model), both are warmed up, then called alternately, one call each
  per round, the order swapped every round; each call is timed on its own;
- the figure is the median of the per-round ratios patched/stock, with their interquartile range.

Writes JSON to --out. Used by benchmarks/forward_time.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import in_process  # a sibling module: this script's directory is on sys.path
from first_prefill import after_init, first_prefill_hook


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, statistics.median(values), q3


def ab(stock, patched, rounds: int, warmup: int) -> dict[str, object]:
    for _ in range(warmup):
        stock()
        patched()
    times: dict[str, list[float]] = {"stock": [], "patched": []}
    calls = (("stock", stock), ("patched", patched))
    for n in range(rounds):
        for name, call in calls if n % 2 == 0 else calls[::-1]:
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    ratios = [p / s for p, s in zip(times["patched"], times["stock"], strict=True)]
    return {
        "rounds": rounds,
        "ratio": quartiles(ratios),
        "ratios": ratios,  # per round, for the median's confidence interval (harness/bench_results.py)
        "stock_ms": quartiles([t * 1e3 for t in times["stock"]]),
        "patched_ms": quartiles([t * 1e3 for t in times["patched"]]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--variants", default="1,2;1,2,4", help="aux id lists, ';'-separated")
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    in_process.set_defaults()
    import vllm_hotfix  # noqa: F401  (patches DeepseekV2Model when vLLM imports it: first)

    # isort: split
    import torch
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models import deepseek_v2

    variants = [tuple(int(x) for x in v.split(",")) for v in args.variants.split(";")]
    results: dict[str, object] = {}

    def on_prefill(module, inputs, output) -> None:
        model = module.model
        patched = vars(type(model))["forward"]
        stock = patched.__wrapped__  # the hotfix keeps the original
        assert getattr(patched, "__vllm_hotfix__", None) is not None, "the forward is not patched"
        first = model.aux_hidden_state_layers
        for mode in args.modes.split(","):
            for variant in variants:
                model.aux_hidden_state_layers = variant
                functions = {"stock": stock, "patched": patched}
                if mode == "compile":
                    torch._dynamo.reset()
                    functions = {k: torch.compile(f, fullgraph=True) for k, f in functions.items()}
                calls = {k: functools.partial(f, model, *inputs) for k, f in functions.items()}
                with torch.inference_mode():
                    outputs = {k: call() for k, call in calls.items()}  # compiles, in compile mode
                    counts = {k: len(v[1]) if isinstance(v, tuple) else 0 for k, v in outputs.items()}
                    entry = ab(calls["stock"], calls["patched"], args.rounds, args.warmup)
                entry["aux_states"] = counts
                results[f"{mode} [{','.join(map(str, variant))}]"] = entry
                print(f"forward_ab {mode} {variant}: {entry}", flush=True)
        model.aux_hidden_state_layers = first

    hook = first_prefill_hook(on_prefill)

    def built(lm) -> None:
        lm.model.aux_hidden_state_layers = variants[0]
        lm.register_forward_hook(hook, with_kwargs=True)

    after_init(deepseek_v2.DeepseekV2ForCausalLM, built)
    llm = LLM(
        model=args.checkpoint,
        **in_process.TINY_ENGINE,
    )
    llm.generate(
        [{"prompt_token_ids": in_process.PROMPT}],
        SamplingParams(max_tokens=1, temperature=0.0),
        use_tqdm=False,
    )
    import vllm

    with open(args.out, "w") as handle:
        json.dump(
            {
                "vllm": vllm.__version__,
                "torch": str(torch.__version__),
                "tokens": len(in_process.PROMPT),
                "threads": torch.get_num_threads(),
                "results": results,
            },
            handle,
            indent=1,
        )


if __name__ == "__main__":
    main()
