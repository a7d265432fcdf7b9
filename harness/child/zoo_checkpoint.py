"""Build tiny random checkpoints of model families that capture aux states through vLLM's shared
helper (`EagleModelMixin._maybe_add_hidden_state`): Llama, Qwen3-MoE, gpt-oss. No hub access.

Each is built by transformers from a small config (hidden 128, 4 layers, the tokenizer of
tiny_checkpoint.py) with every matrix drawn from N(0, 0.05), seeded, so the states are well scaled
and differ between layers. Sizes the CPU build runs: head dim 32 or 64, MoE with 4 experts, top 2.
Run with the test environment's Python: python harness/child/zoo_checkpoint.py FAMILY OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os

from tiny_checkpoint import VOCAB, save_tokenizer  # this script's directory is on sys.path

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    }),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    }),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", {
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }),
}  # fmt: skip


def build(family: str, out_dir: str, seed: int = 0) -> str:
    """Write config, random weights (safetensors) and the tokenizer; return out_dir (kept when built)."""
    import torch
    import transformers

    marker = os.path.join(out_dir, "zoo-checkpoint.json")
    recipe = {"family": family, "seed": seed, **COMMON, **FAMILIES[family][2], "version": 1}
    if os.path.exists(marker):
        with open(marker) as handle:
            if json.load(handle) == recipe:
                return out_dir
    config_name, model_name, fields = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **fields)
    config.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(out_dir)
    with open(marker, "w") as handle:
        json.dump(recipe, handle)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("out_dir")
    args = parser.parse_args()
    print(build(args.family, args.out_dir))


if __name__ == "__main__":
    main()
