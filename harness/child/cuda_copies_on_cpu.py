"""A CPU stand-in for the CUDA calls of ExampleHiddenStatesConnector's save path (tests only).

vLLM 0.24.0/0.25.0's connector copies a finished request's hidden states to the host on a side
CUDA stream into pinned memory (`torch.cuda.Stream`, `torch.cuda.Event`, `torch.cuda.stream`,
`torch.empty_like(..., pin_memory=True)`), none of which runs without a GPU. This replaces the
connector module's `torch` name (that module only, for the duration of the context) with one whose
`cuda` streams and events are synchronous no-ops and whose `empty_like` allocates ordinary memory.
The contract kept: when `record()`/`synchronize()`/`query()` say the copy is done, it is done (on
CPU every copy completes before the call returns). Every other name is the real torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any


class _Event:
    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    def wait_event(self, event: _Event) -> None:
        pass


class _TorchOnCpu:
    """The real torch, except `cuda` streams/events and `empty_like`'s pinned memory."""

    def __init__(self, torch: ModuleType) -> None:
        self._torch = torch
        self.cuda = SimpleNamespace(
            Stream=_Stream, Event=_Event, stream=lambda stream: contextlib.nullcontext()
        )

    def empty_like(self, tensor: Any, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return self._torch.empty_like(tensor, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


@contextlib.contextmanager
def cuda_copies_on_cpu(module: ModuleType) -> Iterator[None]:
    """Run `module`'s CUDA stream copies synchronously on CPU while the context lasts."""
    real = module.torch
    module.torch = _TorchOnCpu(real)
    try:
        yield
    finally:
        module.torch = real
