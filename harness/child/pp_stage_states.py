"""Run vLLM's real LlamaModel or ApertusModel as pipeline stages on CPU and save the aux states the
last stage's forward returns, stock and (with --hotfix) patched, for the pp-aux-layer-index tests.

--world 1: the whole model (PP=1); --world 2: two spawned processes, vLLM's pipeline-parallel group of
size 2 over gloo (vLLM's own `init_distributed_environment` / `initialize_model_parallel`), each
building its stage as vLLM does (`make_layers` and `get_pp_indices` set `start_layer`/`end_layer`; the
other stage's layers are `PPMissingLayer`). The first stage runs its forward on the prompt and sends
its `IntermediateTensors` to the last stage with vLLM's own `send_tensor_dict`; the last stage
receives them (`recv_tensor_dict`) and runs its forward for every id list. Only the last stage's aux
states reach EAGLE3's drafter in these releases (earlier stages' are discarded): they are recorded.

Real: the model's __init__ and forward (LlamaModel, or ApertusModel: xIELU, QK norm), its decoder
layers, attention projections and rotary embedding, RMSNorm, MLP, VocabParallelEmbedding, vLLM's PP
groups and transport, and the weights of a tiny checkpoint written by transformers
(harness/child/zoo_checkpoint.py's family with --build layers) loaded through the *ForCausalLM's
load_weights (stacked qkv/gate-up mappings; a stage skips the other stage's weights as vLLM does).
Stand-in: the paged `Attention` layer, which needs the engine's KV cache and attention metadata
(there is no engine here), is replaced by `CausalAttention` with its contract: `attn(q, k, v)` over
one sequence, causal softmax attention with grouped KV heads and vLLM's scale, the heads' outputs
concatenated. PP=1 and PP=2 run the same stand-in, so the oracle (the PP=1 model's state at each
global id) is comparable.

Stock and patched run in the same process, on the same model and inputs: with --hotfix the hotfix is
imported before vLLM, and stock is the original forward it keeps as `__wrapped__`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from types import SimpleNamespace

from model_states import parse_variants
from tp_model import finish_loading, forward_states, forward_step, rank_record
from v32_states import PROMPT, _ModelBuildConfig

OUTER = {"llama": "LlamaForCausalLM", "apertus": "ApertusForCausalLM"}  # --family -> its vLLM class


def _causal_attention() -> type:
    import torch

    class CausalAttention(torch.nn.Module):
        """The paged Attention layer's contract on one sequence, without a KV cache (docstring)."""

        def __init__(
            self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None, **_: object
        ) -> None:
            super().__init__()
            self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
            self.num_kv_heads = num_kv_heads or num_heads

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            tokens = q.shape[0]
            q = q.view(tokens, self.num_heads, self.head_size).transpose(0, 1)
            k = k.view(tokens, self.num_kv_heads, self.head_size).transpose(0, 1)
            v = v.view(tokens, self.num_kv_heads, self.head_size).transpose(0, 1)
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.transpose(0, 1).reshape(tokens, self.num_heads * self.head_size)

    return CausalAttention


def _checkpoint_weights(path: str) -> list[tuple[str, object]]:
    """The checkpoint's tensors, named as in the file (the *ForCausalLM's load_weights maps them)."""
    from safetensors.torch import load_file

    return list(load_file(os.path.join(path, "model.safetensors")).items())


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ["VLLM_DIST_IDENT"] = f"pp-{port}"  # vLLM's CPU communicator names its shm group by it
    import torch

    if args.hotfix:
        import vllm_hotfix  # noqa: F401  (armed before vLLM: the model module is patched at its import)

    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.sequence import IntermediateTensors

    module = importlib.import_module(f"vllm.model_executor.models.{args.family}")
    module.Attention = _causal_attention()

    torch.set_default_dtype(torch.float32)
    vllm_config = VllmConfig()
    vllm_config.parallel_config.pipeline_parallel_size = world
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world)
        hf = AutoConfig.from_pretrained(args.checkpoint)
        model_config = SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=torch.float32)
        config = _ModelBuildConfig(vllm_config, model_config, vllm_config.parallel_config)
        outer = getattr(module, OUTER[args.family])(vllm_config=config, prefix="")
        loaded = outer.load_weights(_checkpoint_weights(args.checkpoint))
        finish_loading(outer)
        model = outer.model  # LlamaModel / ApertusModel: the forward under test

        forward = vars(type(model))["forward"]
        stock = getattr(forward, "__wrapped__", forward)
        functions = {"stock": stock, "patched": forward} if args.hotfix else {"stock": stock}
        ids = torch.tensor(PROMPT)
        positions = torch.arange(len(PROMPT))
        step = functools.partial(forward_step, vllm_config, len(PROMPT))
        pp = get_pp_group()
        with torch.no_grad():
            intermediate = None
            if not pp.is_first_rank:
                intermediate = IntermediateTensors(pp.recv_tensor_dict())
            results = []
            for variant in parse_variants(args.variants):
                model.aux_hidden_state_layers = variant
                entry: dict = {"ids": variant}
                for label, function in functions.items():
                    call = functools.partial(function, model, ids, positions, intermediate)
                    if pp.is_last_rank:
                        entry[label] = forward_states(call, step, [0])
                    else:
                        with step():
                            out = call()
                        entry[label] = {"aux": [], "returned_aux": False, "sent": out}
                results.append(entry)
            if not pp.is_last_rank:  # the stage's output as the engine hands it on (stock's, variant 1)
                pp.send_tensor_dict(results[0]["stock"].pop("sent").tensors)
                for entry in results:
                    for label in functions:
                        entry[label].pop("sent", None)

    record = rank_record(
        rank,
        world,
        results=results,
        start_layer=model.start_layer,
        end_layer=model.end_layer,
        first=pp.is_first_rank,
        last=pp.is_last_rank,
        loaded=sorted(loaded or []),
        patched_file=forward.__code__.co_filename,
        status=__import__("vllm_hotfix").status() if args.hotfix else None,
    )
    torch.save(record, os.path.join(args.out, f"rank{rank}.pt"))


def build_checkpoint(family: str, out_dir: str, layers: int) -> str:
    """zoo_checkpoint.py's tiny checkpoint of `family` (hidden 128, GQA 4/2 heads, seeded N(0, 0.05))
    with `layers` layers."""
    import zoo_checkpoint  # this script's directory is on sys.path

    zoo_checkpoint.COMMON["num_hidden_layers"] = layers  # part of the recipe its marker records
    return zoo_checkpoint.build(family, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--family", choices=sorted(OUTER), default="llama")
    parser.add_argument("--checkpoint", required=True, help="written first with --build LAYERS")
    parser.add_argument("--build", type=int, default=0, help="write a tiny Llama of this many layers, exit")
    parser.add_argument("--variants", default="1,2,3")
    parser.add_argument("--hotfix", action="store_true")
    parser.add_argument("--out", default="", help="a directory: one rank<N>.pt per stage")
    args = parser.parse_args()
    if args.build:
        print(build_checkpoint(args.family, args.checkpoint, args.build))
        return

    from tp_ranks import run_ranks  # this script's directory is on sys.path

    run_ranks(worker, args)
    sys.exit(0)


if __name__ == "__main__":
    main()
