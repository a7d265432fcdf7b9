"""The first real prefill of a causal-LM model vLLM builds, as harness code reads it: a forward hook
on the causal-LM wrapper (which vLLM does not compile), registered when the model is built, that
sees the backbone's own inputs and output inside that step. Used by the scripts here and by the
oracle site; the hook returns the plain hidden states (these runs have no speculative method).
"""

from __future__ import annotations

import functools
from collections.abc import Callable


def forward_inputs(args: tuple, kwargs: dict) -> tuple:
    """The backbone's forward arguments as its causal-LM wrapper received them: input ids,
    positions, intermediate tensors, input embeddings."""
    return (
        kwargs.get("input_ids", args[0] if args else None),
        kwargs["positions"] if "positions" in kwargs else args[1],
        kwargs.get("intermediate_tensors"),
        kwargs.get("inputs_embeds"),
    )


def copy_output(output: object) -> dict:
    """What the backbone returned, copied: `(hidden_states, aux_hidden_states)` or a bare tensor."""
    if isinstance(output, tuple):
        hidden, aux = output
        return {"kind": "tuple", "hidden": hidden.clone(), "aux": [a.clone() for a in aux]}
    return {"kind": "tensor", "hidden": output.clone(), "aux": None}


def first_prefill_hook(on_prefill: Callable[[object, tuple, object], None]) -> Callable:
    """A forward hook (`register_forward_hook(..., with_kwargs=True)`) that calls
    `on_prefill(lm, inputs, output)` once, on the first forward with attention metadata (a real
    prefill, not vLLM's dummy or profile runs), and returns the plain hidden states every time."""
    from vllm.forward_context import get_forward_context

    done: list[bool] = []

    def hook(lm: object, args: tuple, kwargs: dict, output: object) -> object:
        if not done and get_forward_context().attn_metadata is not None:
            done.append(True)
            on_prefill(lm, forward_inputs(args, kwargs), output)
        return output[0] if isinstance(output, tuple) else output

    return hook


def after_init(cls: type, built: Callable[[object], None]) -> None:
    """Call `built(model)` on every `cls` built from now on, right after its own __init__ (before
    vLLM loads weights or compiles it)."""
    original_init = cls.__init__

    @functools.wraps(original_init)
    def init(self: object, *args: object, **kwargs: object) -> None:
        original_init(self, *args, **kwargs)
        built(self)

    cls.__init__ = init
