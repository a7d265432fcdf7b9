"""vLLM's GPU-only norm paths, emulated on CPU with their real aliasing contracts (a test mode).

On CPU vLLM's fused add-RMSNorm is functional (a new sum, a new normed tensor), so a captured state
that aliases a tensor the model later keeps as `residual` never changes. On a CUDA GPU two paths
write into their inputs instead, and a state that aliases them is overwritten:

- `ir.ops.fused_add_rms_norm.maybe_inplace` (what `RMSNorm(x, residual)` calls) dispatches to the
  `vllm_c` kernel (`torch.ops._C.fused_add_rms_norm`, registered `inplace=True`): `residual := x +
  residual`, `x := rms_norm(residual) * weight`, and it returns the two input tensors. Emulated by
  registering the provider `gpu_inplace_emulation` in vLLM's own IR op registry (`register_impl(...,
  inplace=True)`, computed by vLLM's native implementation, then written into the inputs) and putting
  it first in the op's dispatch priority (`set_priority` / `set_default`, then `native`), as vLLM's
  platform priority puts `vllm_c` first on CUDA. vLLM's functional overload (`fused_add_rms_norm(...)`,
  what its GemmaRMSNorm calls) keeps copying the inputs for an in-place provider (`func_impl_fn`), as
  on CUDA.
- flashinfer's fused all-reduce + residual add + RMSNorm (`flashinfer_trtllm_fused_allreduce_norm`,
  a custom op that returns None and mutates its arguments), which vLLM's `fused_allreduce_rms_norm` /
  `fused_allreduce_gemma_rms_norm` call at TP > 1 when `_can_use_flashinfer` admits the step (the
  token count within the workspace's budget) and otherwise fall back to all-reduce + norm. With
  `norm_out` given (the only way these helpers call it), vLLM's wrapper passes `residual_out =
  allreduce_in`: the kernel writes the all-reduced pre-norm sum `all_reduce(allreduce_in) + residual`
  into `allreduce_in`, the normalized sum `* (rms_gamma + weight_bias)` into `norm_out`, leaves
  `residual` untouched and returns None; the helpers then return `(norm_out, allreduce_in)`. The
  stand-in does exactly that, the all-reduce through vLLM's own `tensor_model_parallel_all_reduce`
  (one collective, as the kernel's), the sum and norm in float32 (`fp32_acc=True`); float32 inputs
  are accepted too (the kernel takes 16-bit only) so that the CPU runs take it. It replaces the
  names `flashinfer_trtllm_fused_allreduce_norm`, `_can_use_flashinfer` and `_AR_RESIDUAL_RMS_NORM`
  in every loaded vLLM module that holds them (the helpers import them by value), so it must be
  installed after the model module is imported. `_can_use_flashinfer` becomes `num_tokens <=
  threshold_tokens`: one run takes both branches (fused at or below the threshold, the fallback above),
  as a GPU does with its workspace budget.

API: `install(threshold_tokens)` for the rest of the process; `emulated(threshold_tokens)` the same,
undone on exit. `threshold_tokens=None`: the in-place norm only (no fused all-reduce branch).
`FUSED_CALLS[0]` counts the fused stand-in's calls (which branch the steps took).
Needs vLLM's IR ops (`vllm.ir`, vLLM 0.24+). Imports nothing at module level: the test process can
import it as `harness.child.gpu_norms`.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

PROVIDER = "gpu_inplace_emulation"
FUSED_NAMES = ("flashinfer_trtllm_fused_allreduce_norm", "_can_use_flashinfer", "_AR_RESIDUAL_RMS_NORM")
PATTERN = 1  # stands for flashinfer's AllReduceFusionPattern.kARResidualRMSNorm (not read by the stand-in)
FUSED_CALLS = [0]  # calls of the fused all-reduce stand-in in this process: which branch a step took


def _in_place_provider() -> object:
    """vLLM's IR op `fused_add_rms_norm` with the in-place provider registered (once)."""
    from vllm import ir

    op = ir.ops.fused_add_rms_norm
    if PROVIDER in op.impls:
        return op
    native = op.impls["native"].impl_fn

    def in_place(*args: Any) -> tuple:
        x, x_residual = args[0], args[1]
        normed, summed = native(*args)
        x_residual.copy_(summed)
        x.copy_(normed)
        return x, x_residual

    in_place.__signature__ = inspect.signature(native)  # the schema must be the native one's
    in_place.__annotations__ = dict(native.__annotations__)
    op.register_impl(PROVIDER, inplace=True)(in_place)
    return op


def _fused_allreduce_norm(
    *,
    allreduce_in: Any,
    residual: Any,
    rms_gamma: Any,
    rms_eps: float,
    world_size: int,
    launch_with_pdl: bool,
    fp32_acc: bool,
    max_token_num: int,
    pattern_code: int,
    norm_out: Any = None,
    quant_out: Any = None,
    scale_out: Any = None,
    scale_factor: Any = None,
    weight_bias: float = 0.0,
) -> None:
    """flashinfer's fused all-reduce + residual add + RMSNorm with `norm_out` (module docstring)."""
    import torch
    from vllm.distributed import tensor_model_parallel_all_reduce

    assert norm_out is not None and quant_out is None, "only the norm_out pattern is emulated"
    assert allreduce_in.shape[0] <= max_token_num, "over the workspace's token budget"
    summed = tensor_model_parallel_all_reduce(allreduce_in.clone()).float() + residual.float()
    variance = summed.pow(2).mean(-1, keepdim=True)
    normed = summed * torch.rsqrt(variance + rms_eps) * (rms_gamma.float() + weight_bias)
    allreduce_in.copy_(summed)  # residual_out is allreduce_in
    norm_out.copy_(normed)
    FUSED_CALLS[0] += 1


def _fused_stand_ins(threshold_tokens: int) -> dict[str, object]:
    def can_use_flashinfer(hidden_states: Any, tp_size: int) -> tuple[bool, int]:
        ok = hidden_states.dim() == 2 and hidden_states.shape[0] <= threshold_tokens
        return (True, threshold_tokens) if ok else (False, 0)

    return {
        "flashinfer_trtllm_fused_allreduce_norm": _fused_allreduce_norm,
        "_can_use_flashinfer": can_use_flashinfer,
        "_AR_RESIDUAL_RMS_NORM": PATTERN,
    }


def _fused_holders() -> list[object]:
    """Every loaded vLLM module that holds vLLM's fused all-reduce names (the helpers' modules)."""
    return [
        module
        for name, module in list(sys.modules.items())
        if (name == "vllm" or name.startswith("vllm."))
        and module is not None
        and "_can_use_flashinfer" in vars(module)
    ]


def _patch_fused(threshold_tokens: int) -> list[tuple[object, str, object]]:
    """Put the fused all-reduce stand-ins where vLLM's helpers look; what was there before."""
    holders = _fused_holders()
    assert holders, "no vLLM module holds _can_use_flashinfer: import the model module first"
    saved = []
    for module in holders:
        for name, value in _fused_stand_ins(threshold_tokens).items():
            saved.append((module, name, vars(module).get(name)))
            setattr(module, name, value)
    return saved


@contextlib.contextmanager
def emulated(threshold_tokens: int | None = None) -> Iterator[None]:
    """The in-place fused add-RMSNorm first in vLLM's dispatch priority and, with `threshold_tokens`,
    the fused all-reduce + norm stand-in for steps of at most that many tokens; undone on exit."""
    op = _in_place_provider()
    saved = _patch_fused(threshold_tokens) if threshold_tokens is not None else []
    try:
        with op.set_priority([PROVIDER, "native"]):
            yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def register() -> None:
    """Register the in-place provider only, for a priority that vLLM's own config sets
    (`kernel_config.ir_op_priority`, which a worker applies at start-up)."""
    _in_place_provider()


def install(threshold_tokens: int | None = None) -> None:
    """`emulated(threshold_tokens)` for the rest of the process (after the model module's import)."""
    _in_place_provider().set_default([PROVIDER, "native"])
    if threshold_tokens is not None:
        _patch_fused(threshold_tokens)
