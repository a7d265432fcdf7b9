"""vLLM's compile caches never hand an artifact compiled without the fix to a patched run, or the
other way round, nor one of another hotfix version: checked on the cache directories and results.

vLLM's GPU default is kept on CPU (VLLM_COMPILE, piecewise backend, ahead-of-time and JIT disk
caches; harness/model_states.py --gpu-like-compile), all runs sharing one VLLM_CACHE_ROOT.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.testenv import BUG

pytestmark = pytest.mark.vllm
GPU_LIKE = ("--gpu-like-compile",)


def artifacts(root: Path) -> dict[str, set[str]]:
    base = root / "torch_compile_cache"
    aot = base / "torch_aot_compile"
    return {
        "aot": {p.name for p in aot.iterdir()} if aot.exists() else set(),
        "jit": {p.name for p in base.iterdir() if p.name != "torch_aot_compile"} if base.exists() else set(),
    }


def test_cache_is_never_shared_across_patch_states(model_states, tmp_path: Path) -> None:
    root = tmp_path / "shared-vllm-cache"

    def run(step: int, hotfix: bool, *options: str) -> tuple[dict, dict[str, set[str]]]:
        saved = model_states(
            BUG,
            hotfix,
            "1,4",
            "float32",
            "compile",
            options=GPU_LIKE + options,
            VLLM_CACHE_ROOT=str(root),
            HARNESS_STEP=str(step),
        )
        assert saved["compiled"]
        return saved, artifacts(root)

    stock1, after1 = run(1, False)
    patched2, after2 = run(2, True)
    patched3, after3 = run(3, True)
    stock4, after4 = run(4, False)
    other5, after5 = run(5, True, "--hotfix-version", "0.0.0+other")

    assert after1["aot"] and after1["jit"], "the first run wrote no cache: the test would prove nothing"
    for kind in ("aot", "jit"):
        assert after2[kind] > after1[kind], f"patched run reused the unpatched {kind} cache"
        assert after3[kind] == after2[kind], f"a second patched run did not reuse its {kind} cache"
        assert after4[kind] == after3[kind], f"the unpatched run wrote a new {kind} cache"
        assert after5[kind] > after4[kind], f"another hotfix version reused this one's {kind} cache"

    for saved, aux in ((stock1, 1), (patched2, 2), (patched3, 2), (stock4, 1), (other5, 2)):
        assert len(saved["variants"]["1,4"]["aux"]) == aux
    for a, b in ((patched2, patched3), (patched2, other5), (stock1, stock4)):
        assert torch.equal(a["variants"]["1,4"]["aux"][-1], b["variants"]["1,4"]["aux"][-1])
