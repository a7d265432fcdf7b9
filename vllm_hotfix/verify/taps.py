"""Taps: what each decoder layer of the model actually received, in the same forward as the aux states.

The aux state of id k is, by vLLM's convention, the residual stream entering decoder layer k
(`hidden_states + residual`, pre-norm; id 0: the embeddings entering layer 0; id N, the number of
layers: the final norm's input sum, which is what layer N-1 returns). So, when the check is on, the
model gets, at load (before vLLM compiles or captures it):

- a forward pre-hook on its first decoder layer (site 0: the `hidden_states`, and `residual` if
  any, it is called with) and a forward hook on every decoder layer k-1 (site k: the
  `(hidden_states, residual)` pair it returns, which layer k receives);
- each hook calls one opaque custom op, `vllm_hotfix_verify::tap`, that writes the fingerprints of
  both tensors (each token projected on the check's K fixed directions, `checks.projection`) into
  fixed preallocated buffers (`out=`), and counts its call. It mutates only its own buffers: the
  model's tensors are neither copied into the model's path nor replaced (a tap that handed the
  layer a copy would hide exactly the in-place aliasing it must see), so vLLM's compiled graph
  keeps the op (a mutation of its inputs) and a CUDA graph replays it like any kernel.

The fingerprint is linear, so a per-rank partial `hidden_states` (a row-parallel output whose
all-reduce vLLM fuses into the next norm) gives the reduced stream's fingerprint as the sum of the
ranks' fingerprints plus the residual's: no collective beyond the check's own exchange
(reference.py). The op reads a flag first: after the window it returns at once in eager mode and in
a compiled graph (the op stays opaque to the compiler); a CUDA graph captured while the window was
open still writes the few floats per token per layer. With the check off nothing is registered.
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
import weakref
from typing import Any

logger = logging.getLogger("vllm.hotfix")

OP = "vllm_hotfix_verify::tap"
DEFAULT_MAX_TOKENS = 8192  # when vLLM's max_num_batched_tokens is not readable at load
SCHEMA = (
    "(Tensor hidden, Tensor? residual, Tensor projection, Tensor(a!) fp_hidden, Tensor(b!) fp_residual,"
    " Tensor(c!) meta, int site) -> ()"
)
PAIR = "pair"  # the form of a layer that returns (hidden_states, residual)

_state = {"active": True}
_registry: weakref.WeakKeyDictionary[Any, Taps] = weakref.WeakKeyDictionary()


def deactivate() -> None:
    """After the window: every tap returns at once (eager and compiled; module docstring)."""
    _state["active"] = False


def _tap(
    hidden: Any,
    residual: Any,
    projection: Any,
    fp_hidden: Any,
    fp_residual: Any,
    meta: Any,
    site: int,
) -> None:
    """Fingerprints of `hidden` and `residual` (None: zeros) into row `site` of the buffers;
    meta[site] = (calls, rows written)."""
    import torch

    if not _state["active"]:
        return
    rows = min(int(hidden.shape[0]), int(fp_hidden.shape[1]))
    torch.matmul(hidden[:rows].float(), projection, out=fp_hidden[site, :rows])
    if residual is None:
        fp_residual[site, :rows].zero_()
    else:
        torch.matmul(residual[:rows].float(), projection, out=fp_residual[site, :rows])
    meta[site, 0] += 1
    meta[site, 1].fill_(int(hidden.shape[0]))


def _fake(
    hidden: Any, residual: Any, projection: Any, fp_hidden: Any, fp_residual: Any, meta: Any, site: int
) -> None:
    return None


def tap_op() -> Any:
    """The custom op, registered once per process."""
    import torch

    namespace, name = OP.split("::")
    if not hasattr(getattr(torch.ops, namespace), name):
        op = torch.library.custom_op(
            OP, _tap, mutates_args=("fp_hidden", "fp_residual", "meta"), schema=SCHEMA
        )
        op.register_fake(_fake)
    return getattr(getattr(torch.ops, namespace), name)


class Taps:
    """The taps of one model (its module that holds `layers`): buffers, sites, what each site saw."""

    def __init__(self, holder: Any, layers: Any, start: int, max_tokens: int, hidden_size: int) -> None:
        import torch

        from vllm_hotfix.verify.checks import K, projection

        device = next((p.device for p in holder.parameters()), torch.device("cpu"))
        self.holder_name = type(holder).__name__
        self.start = start
        self.sites = len(layers) + 1  # site s: the stream entering layer start + s
        self.max_tokens = max_tokens
        self.hidden_size = hidden_size
        self.projection = projection(hidden_size, device)
        self.fp_hidden = torch.zeros(self.sites, max_tokens, K, dtype=torch.float32, device=device)
        self.fp_residual = torch.zeros_like(self.fp_hidden)
        self.meta = torch.zeros(self.sites, 2, dtype=torch.int64, device=device)
        self.seen = torch.zeros(self.sites, dtype=torch.int64, device=device)  # calls at the last check
        self.forms: dict[int, str] = {}  # site: PAIR or what the layer returned instead (at trace)

    def site(self, layer_id: int) -> int | None:
        s = layer_id - self.start
        return s if 0 <= s < self.sites else None

    def _call(self, hidden: Any, residual: Any, site: int) -> None:
        tap_op()(hidden, residual, self.projection, self.fp_hidden, self.fp_residual, self.meta, site)

    def entry_hook(self, layer: Any) -> Any:
        import torch

        names = list(inspect.signature(layer.forward).parameters)

        def pre(module: Any, args: tuple, kwargs: dict) -> None:
            bound = dict(zip(names, args, strict=False)) | kwargs
            hidden, residual = bound.get("hidden_states"), bound.get("residual")
            if isinstance(hidden, torch.Tensor) and (residual is None or isinstance(residual, torch.Tensor)):
                self._call(hidden, residual, 0)
            return None

        return pre

    def exit_hook(self, site: int) -> Any:
        import torch

        def post(module: Any, args: tuple, output: Any) -> None:
            pair = (
                isinstance(output, tuple)
                and len(output) == 2
                and all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in output)
                and output[0].shape == output[1].shape
            )
            # The form is noted in eager calls only: a dict written while Dynamo traces becomes a
            # replayed `update` in the compiled bytecode, which vLLM refuses under CUDA graphs
            # (tests/test_verify_taps.py). A compiled layer of another form just never taps (n/a).
            note = not torch.compiler.is_compiling()
            if not pair:
                if note:
                    kind = (
                        f"{type(output).__name__} of {len(output)}"
                        if isinstance(output, tuple)
                        else "one tensor"
                    )
                    self.forms[site] = (
                        f"{type(module).__name__} returns a {kind}, not (hidden_states, residual)"
                    )
                return None
            if note:
                self.forms[site] = PAIR
            self._call(output[0], output[1], site)
            return None

        return post


def decoder_layers(model: Any) -> tuple[Any, Any, int] | None:
    """(the module that holds the decoder layers and the aux ids, its layers, its first layer id)."""
    import torch

    for module in model.modules():
        layers = getattr(module, "layers", None)
        if (
            isinstance(layers, torch.nn.ModuleList)
            and len(layers)
            and hasattr(module, "aux_hidden_state_layers")
        ):
            return module, layers, int(getattr(module, "start_layer", 0) or 0)
    return None


def attach(model: Any, hidden_size: int, max_tokens: int | None = None) -> Taps | None:
    """Register the taps on `model` (before compilation); None when it has no decoder layers to tap.
    Only this rank's layers (start_layer..end_layer under pipeline parallelism) are tapped."""
    found = decoder_layers(model)
    if found is None:
        return None
    holder, layers, start = found
    if holder in _registry:
        return _registry[holder]
    end = int(getattr(holder, "end_layer", len(layers)) or len(layers))
    local = [layers[i] for i in range(start, min(end, len(layers)))]
    if not local:
        return None
    taps = Taps(holder, local, start, max_tokens or DEFAULT_MAX_TOKENS, hidden_size)
    reason = _bypassed(holder)
    if reason is not None:  # every id n/a with this reason, not "the tap did not run"
        taps.forms.update(dict.fromkeys(range(1, taps.sites), reason))
    local[0].register_forward_pre_hook(taps.entry_hook(local[0]), with_kwargs=True)
    for offset, layer in enumerate(local):
        layer.register_forward_hook(taps.exit_hook(offset + 1))
    _registry[holder] = taps
    return taps


def split_layer_reason(forward_source: str, owner: str) -> str | None:
    """Why module hooks on the decoder layers would never fire, or None: a forward whose layer loop
    calls the layers' own methods instead of `layer(...)` (vLLM 0.34.0's MiniMax-M3 calls
    `layer.forward_input_norm` then `layer.forward_after_input_norm`)."""
    tree = ast.parse(textwrap.dedent(forward_source))
    names = {
        target.id
        for loop in ast.walk(tree)
        if isinstance(loop, ast.For) and "self.layers" in ast.unparse(loop.iter)
        for target in ast.walk(loop.target)
        if isinstance(target, ast.Name)
    }
    calls = [node.func for node in ast.walk(tree) if isinstance(node, ast.Call)]
    if any(isinstance(f, ast.Name) and f.id in names for f in calls):
        return None
    methods = sorted(
        {
            f.attr
            for f in calls
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in names
        }
    )
    if not methods:
        return None
    return (
        f"{owner}.forward calls its decoder layers' methods ({', '.join(methods)}), not the layers"
        " themselves, so the check's taps (module hooks) never see the stream a layer receives"
    )


def _bypassed(holder: Any) -> str | None:
    try:
        return split_layer_reason(inspect.getsource(type(holder).forward), type(holder).__name__)
    except Exception:  # no source to read (or not parsable): the hooks are the only evidence
        return None


def of(holder: Any) -> Taps | None:
    return _registry.get(holder)


def attach_loaded(model: Any) -> None:
    """At model load in a vLLM worker (the loader's return value): attach with vLLM's sizes."""
    try:
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        max_tokens = int(config.scheduler_config.max_num_batched_tokens)
        hidden = int(config.model_config.get_hidden_size())
    except Exception:
        max_tokens, hidden = DEFAULT_MAX_TOKENS, None
    if hidden is None:
        config = getattr(model, "config", None)
        hidden = getattr(getattr(config, "get_text_config", lambda: config)(), "hidden_size", None)
    if hidden:
        attach(model, int(hidden), max_tokens)
