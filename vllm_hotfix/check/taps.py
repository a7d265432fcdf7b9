"""Taps: what each decoder layer of the model received, in the same forward as the aux states.

Id k is the residual stream entering layer k (id 0: the embeddings; the last id: the final norm's
input). Module hooks on the layers, or on the norm that reads a `(hidden_states, residual)` pair,
call one opaque custom op that writes fingerprints into preallocated tensors: no Python side effect,
no copy handed to the layer (docs/design.md, section 8, says why each choice).
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
import textwrap
import weakref
from collections.abc import Callable, Sequence
from typing import Any

OP = "vllm_hotfix_verify::tap"
SCHEMA = (
    "(Tensor? hidden, Tensor? residual, Tensor projection, Tensor(a!) fp_hidden, Tensor(b!) fp_residual,"
    " Tensor(c!) meta, int site, int form) -> ()"
)
# The form of what a site saw (meta[site, 2]): the stream is hidden + residual (PAIR), or hidden
# alone (STREAM: one tensor, `(hidden_states, None)`, or layer 0's input without a residual); OTHER:
# neither (e.g. DeepSeek-V4's hyper-connection streams), nothing compared.
PAIR, STREAM, OTHER = 1, 2, 3  # 0: not seen
META = 3  # calls, rows written, form

_registry: weakref.WeakKeyDictionary[Any, Taps] = weakref.WeakKeyDictionary()
_libraries: list[Any] = []  # the op's definition lives as long as its Library object


def _tap(
    hidden: Any, residual: Any, proj: Any, fp_hidden: Any, fp_residual: Any, meta: Any, site: int, form: int
) -> None:
    """Fingerprints of `hidden` and `residual` (None: zeros) into row `site` of the fingerprint
    tensors; meta[site] = (calls, rows written, form)."""
    meta[site, 0] += 1
    meta[site, 2].fill_(form)
    if hidden is None:  # OTHER: only the form is noted
        meta[site, 1].fill_(0)
        return
    hidden = hidden.flatten(0, -2)  # a Hugging Face layer's [1, tokens, hidden] (the transformers backend)
    residual = None if residual is None else residual.flatten(0, -2)
    rows = min(int(hidden.shape[0]), int(fp_hidden.shape[1]))
    from vllm_hotfix.check.reference import project

    project(hidden[:rows], proj, fp_hidden[site, :rows])
    if residual is None:
        fp_residual[site, :rows].zero_()
    else:
        project(residual[:rows], proj, fp_residual[site, :rows])
    meta[site, 1].fill_(int(hidden.shape[0]))


def tap_op() -> Any:
    """The custom op, registered once per process, outside any trace (module docstring). Through
    torch.library's low-level API, not `custom_op`: a call costs 2.3 us instead of 7.3 us."""
    import torch

    namespace, name = OP.split("::")
    if not hasattr(getattr(torch.ops, namespace), name):
        library = torch.library.Library(namespace, "FRAGMENT")
        library.define(name + SCHEMA)
        library.impl(name, _tap, "CompositeExplicitAutograd")
        torch.library.register_fake(OP, lambda *args: None, lib=library)
        _libraries.append(library)
    return getattr(getattr(torch.ops, namespace), name).default


class Taps:
    """The taps of one model (its module that holds `layers`): buffers, sites, what each site saw.
    A site is a requested id at a boundary of this rank's layers; `rows` maps the id to its row."""

    def __init__(
        self, holder: Any, start: int, count: int, ids: Sequence[int], max_tokens: int, hidden_size: int
    ) -> None:
        import torch

        from vllm_hotfix.check.reference import K, projection

        device = next((p.device for p in holder.parameters()), torch.device("cpu"))
        self.op = tap_op()  # before any trace: Dynamo refuses to register it inside one
        self.start = start
        self.sites = count + 1  # the boundaries start .. start + count of this rank's layers
        self.rows = {layer_id: row for row, layer_id in enumerate(sorted(set(ids)))}
        self.max_tokens = max_tokens
        self.hidden_size = hidden_size
        self.projection = projection(hidden_size, device)
        shape = (len(self.rows), max_tokens, K)
        self.fp_hidden = torch.zeros(shape, dtype=torch.float32, device=device)
        self.fp_residual = torch.zeros_like(self.fp_hidden)
        self.meta = torch.zeros(len(self.rows), META, dtype=torch.int64, device=device)
        self.seen = torch.zeros(len(self.rows), dtype=torch.int64, device=device)  # calls at the last check
        self.layer_names: dict[int, str] = {}  # row: the class of the layer its hook is on
        self.unread: dict[int, str] = {}  # row: why its pair form's stream is unknown (no source)
        self.bypassed: str | None = None  # why no hook on a layer can fire (split_layer_reason)
        self.after_norm: dict[int, str] = {}  # row: the norm that taps its pair form (_tap_norms)

    def form(self, row: int) -> str | None:
        """Why row `row` cannot be compared: no hook can fire (`bypassed`), or the layer's form."""
        if self.bypassed:
            return self.bypassed
        form = int(self.meta[row, 2])
        if form == PAIR and row in self.unread:
            return self.unread[row]
        if form != OTHER:
            return None
        name = self.layer_names.get(row, "the layer")
        return f"{name} returns neither (hidden_states, residual) nor one hidden_states tensor"

    def _tensor(self, value: Any) -> bool:
        """A stream: [tokens, hidden], or a Hugging Face layer's [1, tokens, hidden] (vLLM's
        transformers backend adds that batch dimension; the op flattens it)."""
        import torch

        if not isinstance(value, torch.Tensor) or value.shape[-1] != self.hidden_size:
            return False
        return bool(value.dim() == 2 or (value.dim() == 3 and value.shape[0] == 1))

    def _write(self, hidden: Any, residual: Any, row: int, form: int) -> None:
        self.op(hidden, residual, self.projection, self.fp_hidden, self.fp_residual, self.meta, row, form)

    def entry_hook(self, layer: Any, row: int) -> Any:
        names = list(inspect.signature(layer.forward).parameters)

        def pre(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            bound = dict(zip(names, args, strict=False)) | kwargs
            hidden, residual = bound.get("hidden_states"), bound.get("residual")
            if self._tensor(hidden) and residual is None:
                self._write(hidden, None, row, STREAM)
            elif self._tensor(hidden) and self._tensor(residual):
                self._write(hidden, residual, row, PAIR)
            else:
                self._write(None, None, row, OTHER)

        return pre

    def exit_hook(self, row: int, form_only: bool = False, stream_first: bool = False) -> Any:
        """What the layer returns, at `row`; `form_only`: only a form that is neither (the first
        layer, whose input the entry hook taps); `stream_first`: the reader discards the residual
        it is given (`discards_residual`). A pair is left to the norm that reads it, if any."""

        def post(module: Any, args: tuple[Any, ...], output: Any) -> None:
            # no Python side effect here (module docstring): what the hook learns goes through the op
            hidden, residual, form = None, None, OTHER
            if self._tensor(output):
                hidden, form = output, STREAM
            elif isinstance(output, tuple) and len(output) == 2 and self._tensor(output[0]):
                if output[1] is None or stream_first:
                    hidden, form = output[0], STREAM
                elif self._tensor(output[1]) and output[1].shape == output[0].shape:
                    if row in self.after_norm:
                        return None  # the norm's hook taps what the norm returns (docstring)
                    hidden, residual, form = output[0], output[1], PAIR
            if form == OTHER or not form_only:
                self._write(hidden, residual, row, form)

        return post

    def norm_hook(self, row: int) -> Any:
        """On the norm that reads row `row`'s pair: its second output, the sum it computed, is the
        stream (a fusion pattern's output: the graph fuses as without it, test_verify_fusion.py)."""

        def post(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            residual = args[1] if len(args) > 1 else kwargs.get("residual")
            if not self._tensor(residual) or not isinstance(output, tuple) or len(output) != 2:
                return None  # called without the pair (a stream form): the layer's exit hook taps
            if self._tensor(output[1]):
                self._write(output[1], None, row, STREAM)

        return post


# vLLM's transformers backend (models/transformers/base.py) keeps no `aux_hidden_state_layers`: its
# setter turns id k into this flag plus k for transformers' output recorder, which records what the
# Hugging Face decoder layer k-1 returns, and the layers are the Hugging Face model's (`_layer_names`,
# paths under its `model`, e.g. "layers.3")
BACKEND_FLAGS, BACKEND_FLAG = "_output_aux_hidden_states_kwargs", "output_aux_hidden_state_"


def aux_ids(module: Any) -> list[int] | None:
    """The aux ids `module` holds, in the order of the states it returns; None if it holds none."""
    ids = getattr(module, "aux_hidden_state_layers", None)
    if isinstance(ids, (list, tuple)) and all(isinstance(i, int) for i in ids):
        return list(ids) or None
    flags = getattr(module, BACKEND_FLAGS, None)
    if isinstance(flags, dict):
        keys = [k.removeprefix(BACKEND_FLAG) for k in flags if k.startswith(BACKEND_FLAG)]
        return [int(k) for k in keys if k.isdigit()] or None
    return None


def _layer_list(module: Any) -> tuple[Any, int, int] | None:
    """(the decoder layers `module` holds the aux ids of, this rank's first layer id and its end),
    or None."""
    import torch

    if hasattr(module, "aux_hidden_state_layers"):
        layers = getattr(module, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            return None
        start = int(getattr(module, "start_layer", 0) or 0)
        end = min(int(getattr(module, "end_layer", len(layers)) or len(layers)), len(layers))
    elif isinstance(getattr(module, BACKEND_FLAGS, None), dict) and getattr(module, "_layer_names", None):
        path = module._layer_names[min(module._layer_names)].rpartition(".")[0]
        try:
            layers = operator.attrgetter(path)(module.model)
        except AttributeError:
            return None
        if not isinstance(layers, torch.nn.ModuleList):
            return None
        # the backend puts a PPMissingLayer where another pipeline rank has the layer
        local = [i for i, layer in enumerate(layers) if type(layer).__name__ != "PPMissingLayer"]
        start, end = (local[0], local[-1] + 1) if local else (0, 0)
    else:
        return None
    return (layers, start, end) if len(layers) else None


def attach(model: Any, hidden_size: int, max_tokens: int, ids: Sequence[int] | None = None) -> Taps | None:
    """Register the taps on `model` (before compilation) for `ids` (None: every boundary of its
    layers) on this rank's layers; None when it has no decoder layers. The holder of the layers is
    the module whose aux ids are set (a multimodal model's language model, not its tower).
    `max_tokens`: the rows a tap keeps (the command's VLLMHOTFIX_VERIFY_TOKENS)."""
    found = [(module, found) for module in model.modules() if (found := _layer_list(module))]
    if not found:
        return None
    holder, (layers, start, end) = min(found, key=lambda entry: not aux_ids(entry[0]))
    if holder in _registry:
        return _registry[holder]
    if end <= start:
        return None
    wanted = range(start, end + 1) if ids is None else [int(i) for i in ids if start <= int(i) <= end]
    taps = Taps(holder, start, end - start, list(wanted), max_tokens, hidden_size)
    for layer_id, row in taps.rows.items():
        if layer_id == start:
            layer = layers[start]
            layer.register_forward_pre_hook(taps.entry_hook(layer, row), with_kwargs=True)
            layer.register_forward_hook(taps.exit_hook(row, form_only=True))
        else:
            layer = layers[layer_id - 1]
            # the layer that reads this stream (the last layer's own class for the final id)
            reader = layers[layer_id] if layer_id < len(layers) else layer
            discards = _from_source(type(reader), discards_residual)  # None: unknown, never guessed
            if discards is None:
                taps.unread[row] = (
                    f"the source of {type(reader).__name__}.forward cannot be read, so whether the stream"
                    " it receives is hidden_states + residual or hidden_states alone is unknown (install"
                    " vLLM with its .py files, not only compiled bytecode)"
                )
            layer.register_forward_hook(taps.exit_hook(row, stream_first=bool(discards)))
        taps.layer_names[row] = type(layer).__name__
    # every id n/a with this reason, not "the tap did not run" (no source: the hooks are the evidence)
    taps.bypassed = _from_source(type(holder), split_layer_reason, type(holder).__name__)
    _tap_norms(taps, holder, layers, end)
    _registry[holder] = taps
    return taps


def _tap_norms(taps: Taps, holder: Any, layers: Any, end: int) -> None:
    """Move each pair's tap (id k > the first local layer) from the exit of layer k-1 to the norm
    that reads the pair where it is known: layer k's first `self.X(hidden_states, residual)`
    (`reader_norm`), or the holder's final norm for the final id."""
    import torch

    for layer_id, row in taps.rows.items():
        if layer_id == taps.start:
            continue
        if layer_id < end:
            reader, owner = layers[layer_id], layers[layer_id]
        elif layer_id == len(layers):
            reader, owner = layers[layer_id - 1], holder
        else:
            continue  # the reader is on another pipeline rank
        if _from_source(type(reader), discards_residual) is not False:
            continue
        name = _from_source(type(owner), reader_norm)
        norm = getattr(owner, name, None) if name else None
        if not isinstance(norm, torch.nn.Module):
            continue
        norm.register_forward_hook(taps.norm_hook(row), with_kwargs=True)
        taps.after_norm[row] = f"{type(owner).__name__}.{name}"


def reader_norm(forward_source: str) -> str | None:
    """The attribute of the first module a forward calls as `self.X(hidden_states, residual)` (its
    input norm for a decoder layer, the final norm for a backbone), or None."""
    tree = ast.parse(textwrap.dedent(forward_source))
    found = [
        (n.lineno, n.col_offset, n.func.attr)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and ast.unparse(n) == f"self.{n.func.attr}(hidden_states, residual)"
    ]
    return min(found)[2] if found else None


def _read_source(cls: Any, reader: Callable[..., Any], *args: Any) -> Any:
    """`reader(source of cls.forward, *args)`, once per class: None when the source cannot be read
    or parsed (compiled bytecode only): what it would say is then unknown, never guessed."""
    try:
        return reader(inspect.getsource(cls.forward), *args)
    except Exception:
        return None


_from_source: Callable[..., Any] = functools.cache(_read_source)


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
    methods = {f.attr for f in calls if isinstance(f, ast.Attribute) and ast.unparse(f.value) in names}
    if not methods or any(isinstance(f, ast.Name) and f.id in names for f in calls):
        return None
    return (
        f"{owner}.forward calls its decoder layers' methods ({', '.join(sorted(methods))}), not the layers"
        " themselves, so the check's taps (module hooks) never see the stream a layer receives"
    )


def discards_residual(forward_source: str) -> bool:
    """Whether a decoder layer's forward overwrites its `residual` argument before it reads it
    (Cohere2-MoE, MuseGlimmer): the stream it receives is then `hidden_states` alone. Only an
    unconditional first assignment counts; an earlier read (`if residual is None`) does not."""
    tree = ast.parse(textwrap.dedent(forward_source))
    function = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    if function is None or "residual" not in [a.arg for a in function.args.args]:
        return False

    def mentions(node: Any, context: type) -> bool:
        return any(
            isinstance(n, ast.Name) and n.id == "residual" and isinstance(n.ctx, context)
            for n in ast.walk(node)
        )

    for statement in function.body:
        if isinstance(statement, ast.Assign) and not mentions(statement.value, ast.Load):
            if any(mentions(target, ast.Store) for target in statement.targets):
                return True
            continue
        if mentions(statement, ast.Load) or mentions(statement, ast.Store):
            return False
    return False


def hidden_size(model: Any) -> int | None:
    """The width of the model's residual stream, from its Hugging Face config (its text config for
    a multimodal model), else vLLM's current config."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    found = getattr(text, "hidden_size", None)
    if isinstance(found, int):
        return found
    try:
        from vllm.config import get_current_vllm_config

        return int(get_current_vllm_config().model_config.get_hidden_size())
    except Exception:
        return None
