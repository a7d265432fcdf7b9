"""An EAGLE3 engine run that says which target layers feed the draft (the GPU kit's eagle3 check).

Run with a test environment's Python: python harness/child/eagle3_engine.py [--layers N]

Writes a tiny Llama target (N layers, default 8, config and tokenizer only) and an EAGLE3 draft whose
config declares its aux layer ids the SpecForge/EAGLE way (`eagle_config.eagle_aux_hidden_state_layer_ids`,
DECLARED), then runs vLLM's engine in this process (`LLM`, dummy weights, vLLM's default compilation
and CUDA graphs) with `method="eagle3"` and generates a few tokens. From the worker it records which
model runner ran (its class's module: `vllm.v1.worker.gpu.model_runner` is Model Runner V2), the
layers the target captures for the draft (`aux_hidden_state_layers` of the target's inner model, as
the runner's set-up call set them), how many aux states the draft's `fc` takes, and whether the
hotfix's fix is installed. Prints `RESULT {...}`. The environment chooses the rest: the hotfix as a
plugin or not, `VLLMHOTFIX_DISABLE`, `VLLM_USE_V2_MODEL_RUNNER`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from in_process import set_defaults
from tiny_checkpoint import save_tokenizer

DECLARED = [1, 3, 6]  # an 8-layer Llama's defaults are (2, 4, 5)
HIDDEN = 256


def _configs(root: str, layers: int) -> tuple[str, str]:
    target = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_hidden_layers": layers,
        "vocab_size": 1024,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    draft = {
        **target,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": 1024,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": DECLARED, "use_aux_hidden_state": True},
    }
    paths = []
    for name, config in (("target", target), ("draft", draft)):
        path = os.path.join(root, name)
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle)
        save_tokenizer(path)
        paths.append(path)
    return paths[0], paths[1]


def worker_facts(worker: Any) -> dict[str, Any]:
    """Run in the worker: which runner, which target layers, the draft's fc width, the fix's state."""
    runner = worker.model_runner
    target = runner.get_model()
    inner = getattr(target, "model", target)
    draft = None
    for holder in (getattr(runner, "speculator", None), getattr(runner, "drafter", None)):
        draft = getattr(holder, "model", None) if holder is not None else None
        if draft is not None:
            break
    fc = getattr(getattr(draft, "model", None), "fc", None)
    from vllm.v1.worker.gpu.spec_decode.eagle import eagle3_utils

    return {
        "runner": type(runner).__module__,
        "aux_layers": sorted(int(i) for i in getattr(inner, "aux_hidden_state_layers", ())),
        "draft_fc_states": None if fc is None else int(fc.weight.shape[1]) // HIDDEN,
        "fix_installed": hasattr(eagle3_utils.get_eagle3_aux_layers_from_config, "__vllm_hotfix__"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    set_defaults()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    target, draft = _configs(tempfile.mkdtemp(prefix="eagle3-engine-"), args.layers)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=target,
        speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 2},
        load_format="dummy",
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
    )
    outputs = llm.generate(
        [{"prompt_token_ids": [5, 17, 42, 99, 123, 7]}, {"prompt_token_ids": [300, 512, 64, 800]}],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    )
    (facts,) = llm.collective_rpc(worker_facts)
    facts["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
    facts["declared"] = DECLARED
    print("RESULT " + json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
