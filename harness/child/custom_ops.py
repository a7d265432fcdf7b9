"""A torch custom op for harness instrumentation, registered once per process: an opaque call that
vLLM's compiled graph keeps and CUDA graphs capture like any other kernel. Used by the capture and
oracle sites (harness/child/sites/)."""

from __future__ import annotations

from collections.abc import Callable


def custom_op(name: str, function: Callable, fake: Callable, mutates_args: tuple[str, ...] = ()) -> object:
    """Register `function` (type-annotated) as the op `name` ("namespace::op"), with `fake` for
    tracing, unless this process has it already; return the op as `torch.ops` holds it."""
    import torch

    namespace, op = name.split("::")
    if not hasattr(getattr(torch.ops, namespace), op):
        torch.library.custom_op(name, mutates_args=mutates_args)(function).register_fake(fake)
    return getattr(getattr(torch.ops, namespace), op)
