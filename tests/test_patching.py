"""patching.patch() and unpatch() on a module made here: every reference a fix's put() knows is
repointed both ways, and a function replaced since is never undone."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_hotfix.fixes.cpu_sampler_fp64_gumbel import CpuSamplerFp64Gumbel
from vllm_hotfix.runtime import patching

SAMPLER = CpuSamplerFp64Gumbel()
ORIGINAL = "def _sample_recovered_tokens_kernel_impl(x):\n    return x\n"
FIXED = "def _sample_recovered_tokens_kernel_impl(x, USE_FP64_GUMBEL=False):\n    return x + 1\n"


class _FuncWrapper:
    """Stands for vLLM's wrapper that holds the function it calls in `.func`."""

    def __init__(self, func: types.FunctionType) -> None:
        self.func = func


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A stand-in for vllm.utils.cpu_triton_utils, registered under its name in sys.modules."""
    monkeypatch.setenv("VLLMHOTFIX_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "cpu_triton_utils.py"
    path.write_text(ORIGINAL)
    made = types.ModuleType(SAMPLER.module)
    made.__file__ = str(path)
    exec(compile(ORIGINAL, str(path), "exec"), made.__dict__)
    made.sample_recovered_tokens_kernel = _FuncWrapper(made._sample_recovered_tokens_kernel_impl)
    monkeypatch.setitem(sys.modules, SAMPLER.module, made)
    yield made


def test_patch_and_unpatch_repoint_every_reference_both_ways(
    module: types.ModuleType, tmp_path: Path
) -> None:
    original = module._sample_recovered_tokens_kernel_impl
    patched = patching.patch(SAMPLER, module, original, FIXED, "0.24.0")
    function = patched.function
    assert module._sample_recovered_tokens_kernel_impl is function and function(1) == 2
    assert module.sample_recovered_tokens_kernel.func is function  # the override of Fix.put
    assert function.__vllm_hotfix__.fix_id == SAMPLER.fix_id and function.__wrapped__ is original
    assert Path(patched.generated_file).parent == tmp_path / "cache" / "generated"
    assert patched.notes == ()

    assert patching.unpatch(SAMPLER, function, original)
    assert module._sample_recovered_tokens_kernel_impl is original
    assert module.sample_recovered_tokens_kernel.func is original
    assert not patching.unpatch(SAMPLER, function, original)  # already restored: nothing to do


def test_unpatch_leaves_a_later_replacement_alone(module: types.ModuleType) -> None:
    original = module._sample_recovered_tokens_kernel_impl
    function = patching.patch(SAMPLER, module, original, FIXED, "0.24.0").function

    def later(x):
        return x

    module._sample_recovered_tokens_kernel_impl = later
    assert not patching.unpatch(SAMPLER, function, original)
    assert module._sample_recovered_tokens_kernel_impl is later
    assert module.sample_recovered_tokens_kernel.func is function  # not touched either
