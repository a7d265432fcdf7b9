"""Test instrumentation: plant a fault in one tensor-parallel rank's aux hidden states.

Put this directory on PYTHONPATH and set VLLM_HOTFIX_TEST_FAULT=RANK[:INDEX[:nan]]: in the worker of
that TP rank, DeepseekV2ForCausalLM.forward (the model's outer forward, which vLLM does not compile)
changes the aux state at INDEX (default 0; -1 the last) that it returns, in place, before the runner
receives it: it adds 0.5 times each token's root mean square, with `nan` writes one NaN, with
`drop` removes that state from the list (this rank alone then returns one state too few). Only
tests set this; it never touches vllm_hotfix. The in-worker check (vllm_hotfix/verify) must then
fail: ranks disagree (at TP > 1), the final id (INDEX -1 on the final id), finite (nan), or the
count on that rank only (drop).

VLLM_HOTFIX_TEST_CHECK_FAULT=RANK:STAGE:KIND[@CALL] plants a fault inside the check itself, the one
place this site reaches into vllm_hotfix: in the worker of that TP rank, the function of
vllm_hotfix.verify.checks that runs STAGE (shapes, projection, float32, payload) raises
(KIND `raise`) or first sleeps SECONDS (KIND `sleep=SECONDS`, a stalled rank), at its CALL-th call
from check_step (default 1: the first checked step, whose exchange is the handshake; 2: a later
step, whose exchange is the all-gather). Calls from elsewhere (the taps build their projection at
model load) are not counted, so CALL is the checked step. The other ranks must then end with a
clear verdict naming that rank, without waiting past the deadline (VLLM_HOTFIX_VERIFY_TIMEOUT).
"""

import os
import sys

FAULT = os.environ.get("VLLM_HOTFIX_TEST_FAULT")

if FAULT:
    _parts = FAULT.split(":")
    FAULT_RANK = _parts[0]
    FAULT_INDEX = _parts[1] if len(_parts) > 1 else "0"
    FAULT_KIND = _parts[2] if len(_parts) > 2 else "shift"
    import wrapt

    def _plant(module) -> None:
        cls = module.DeepseekV2ForCausalLM
        original = cls.forward

        def forward(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            from vllm.distributed.parallel_state import get_tp_group

            if isinstance(out, tuple) and out[1] and get_tp_group().rank_in_group == int(FAULT_RANK):
                if FAULT_KIND == "drop":
                    out[1].pop(int(FAULT_INDEX))
                    return out
                state = out[1][int(FAULT_INDEX)]
                if FAULT_KIND == "nan":
                    state[0, 0] = float("nan")
                else:
                    rms = state.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
                    state.add_(0.5 * rms.to(state.dtype))
            return out

        cls.forward = forward

    wrapt.register_post_import_hook(_plant, "vllm.model_executor.models.deepseek_v2")

CHECK_FAULT = os.environ.get("VLLM_HOTFIX_TEST_CHECK_FAULT")
CHECK_STAGES = {
    "shapes": "shapes",
    "projection": "projection",
    "float32": "fingerprints",
    "payload": "payload",
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

            from_step = sys._getframe(1).f_code.co_name == "check_step"
            if from_step and get_tp_group().rank_in_group == int(CHECK_RANK):
                calls.append(1)
                if len(calls) == CHECK_CALL:
                    if CHECK_KIND == "raise":
                        raise RuntimeError(f"planted at {CHECK_STAGE}")
                    import time

                    time.sleep(float(CHECK_KIND.split("=")[1]))
            return original(*args, **kwargs)

        setattr(module, name, planted)

    wrapt.register_post_import_hook(_plant_check, "vllm_hotfix.verify.checks")
