"""vLLM's all-reduce + RMSNorm fusion patterns on a small Llama-shaped model, with and without the
check's taps and vLLM's aux capture: the matches per case (tests/test_verify_fusion.py says what
this shows, and names the stand-ins). Prints `RESULT {json}`; run on the vLLM under test with the
hotfix importable."""

from __future__ import annotations

import json

LAYERS = 3
FUSION_MODULES = ("rms_quant_fusion", "matcher_utils", "allreduce_rms_fusion")


def fusion_counts() -> dict:
    """Run in a fresh interpreter (it installs stand-ins process-wide): per case, the patterns
    matched, the all-reduces left and the largest difference from the eager model."""
    import types
    import typing
    import weakref

    import cpu_vllm_compile  # harness/child/, next to this script
    import torch
    import torch._inductor.pattern_matcher as pm
    import vllm.ir.ops
    from torch._dynamo.backends.common import aot_autograd
    from vllm.distributed import parallel_state
    from vllm.utils.torch_utils import direct_register_custom_op

    cpu_vllm_compile.register_missing_placeholder_ops(
        tuple(f"vllm.compilation.passes.fusion.{name}" for name in FUSION_MODULES)
    )
    from vllm.compilation.passes.fusion import allreduce_rms_fusion as fusion

    from vllm_hotfix.check import taps as taps_mod

    hidden, tokens, eps, group_name = 64, 8, 1e-6, "tp:fusion-test"

    class TwoRanks:  # the tensor-parallel group (module docstring)
        world_size, rank_in_group, unique_name, use_custom_op_call = 2, 0, group_name, True

        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.vllm.all_reduce(x, group_name=self.unique_name)

        def _all_reduce_out_place(self, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

    group = TwoRanks()
    parallel_state._groups[group_name] = weakref.ref(group)
    parallel_state._TP = group

    def fused_allreduce_norm(  # flashinfer's kernel (module docstring)
        allreduce_in: torch.Tensor,
        residual: torch.Tensor,
        rms_gamma: torch.Tensor,
        rms_eps: float,
        world_size: int,
        launch_with_pdl: bool,
        fp32_acc: bool,
        max_token_num: int,
        pattern_code: int,
        norm_out: torch.Tensor | None = None,
        quant_out: torch.Tensor | None = None,
        scale_out: torch.Tensor | None = None,
    ) -> None:
        # vLLM's call_trtllm_fused_allreduce_norm: without norm_out the norm goes to allreduce_in
        # and the sum to residual; with it, the sum goes to allreduce_in (harness/child/gpu_norms.py's
        # stand-in, which the engine runs, keeps that branch's contract too)
        out, summed = vllm.ir.ops.fused_add_rms_norm(allreduce_in, residual, rms_gamma, rms_eps)
        (residual if norm_out is None else allreduce_in).copy_(summed)
        (allreduce_in if norm_out is None else norm_out).copy_(out)

    # this module's annotations are strings (`from __future__`): the schema is inferred from types
    fused_allreduce_norm.__annotations__ = typing.get_type_hints(fused_allreduce_norm, {"torch": torch})
    fused_allreduce_norm.__annotations__["return"] = None
    direct_register_custom_op(
        op_name="flashinfer_trtllm_fused_allreduce_norm",
        op_func=fused_allreduce_norm,
        mutates_args=["allreduce_in", "residual", "norm_out", "quant_out", "scale_out"],
    )
    fusion.flashinfer_trtllm_fused_allreduce_norm = (
        torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm.default
    )
    fusion.flashinfer_comm = types.SimpleNamespace(
        AllReduceFusionPattern=types.SimpleNamespace(kARResidualRMSNorm=1)
    )

    patterns = pm.PatternMatcherPass(pass_name="all_reduce_fusion_pass")
    params = fusion.FlashInferFusedAllReduceParams(world_size=2, max_token_num=tokens)
    fusion.AllReduceRMSNormPattern(eps, torch.float32, "cpu", params).register(patterns)
    fusion.AllReduceFusedAddRMSNormPattern(eps, torch.float32, "cpu", params).register(patterns)

    class Norm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(hidden) + 0.5)

        def forward(self, x, residual=None):
            if residual is None:
                return vllm.ir.ops.rms_norm(x, self.weight, eps)
            return vllm.ir.ops.fused_add_rms_norm(x, residual, self.weight, eps)

    class Layer(torch.nn.Module):  # LlamaDecoderLayer's form; the MLP's row-parallel output reduced
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = Norm()
            self.down_proj = torch.nn.Linear(hidden, hidden, bias=False)

        def forward(self, positions, hidden_states, residual):
            if residual is None:
                residual = hidden_states
                hidden_states = self.input_layernorm(hidden_states)
            else:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
            hidden_states = parallel_state.get_tp_group().all_reduce(self.down_proj(hidden_states))
            return hidden_states, residual

    class Model(torch.nn.Module):  # LlamaModel's forward; the embedding's all-reduce first
        def __init__(self, ids: tuple[int, ...], capture: bool) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
            self.norm = Norm()
            self.aux_hidden_state_layers = ids
            self.capture = capture

        def forward(self, x):
            hidden_states, residual = parallel_state.get_tp_group().all_reduce(x), None
            aux = [hidden_states] if self.capture and 0 in self.aux_hidden_state_layers else []
            for idx, layer in enumerate(self.layers):
                hidden_states, residual = layer(None, hidden_states, residual)
                if self.capture and idx + 1 in self.aux_hidden_state_layers:
                    aux.append(hidden_states + residual)
            hidden_states, _ = self.norm(hidden_states, residual)
            return hidden_states, aux

    def all_reduces(graph) -> int:
        return sum(node.target == torch.ops.vllm.all_reduce.default for node in graph.nodes)

    def case(ids: tuple[int, ...], capture: bool, tapped: bool) -> dict:
        torch.manual_seed(0)
        model = Model(ids, capture)
        if tapped:
            assert taps_mod.attach(model, hidden, tokens, list(ids)) is not None
        seen: dict = {}

        def matched(gm, example_inputs):  # inductor's post-grad custom pass runs on this graph
            seen["all_reduces"] = all_reduces(gm.graph)
            seen["matched"] = patterns.apply(gm.graph)
            seen["left"] = all_reduces(gm.graph)
            gm.graph.lint()
            gm.recompile()
            return gm

        with torch.no_grad():
            x = torch.randn(tokens, hidden)
            eager = model(x)
            torch._dynamo.reset()
            fused = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=matched))(x)
        seen["difference"] = max(
            float((a - b).abs().max())
            for a, b in zip([eager[0], *eager[1]], [fused[0], *fused[1]], strict=True)
        )
        return seen

    return {
        f"capture={capture} ids={ids} taps={tapped}": case(ids, capture, tapped)
        for capture in (False, True)
        for ids in ((2,), (0, 1, 2, 3))
        for tapped in (False, True)
    }


def main() -> None:
    import vllm

    print("RESULT " + json.dumps({"vllm": vllm.__version__, "cases": fusion_counts()}))


if __name__ == "__main__":
    main()
