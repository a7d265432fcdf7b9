"""The in-worker check's own code (vllm_hotfix/check/checks.py) on vLLM's real DeepseekV32Model at
TP=1 or TP=2, stock and patched, through the same tensor-parallel group vLLM's workers use.

The model is built as harness/child/v32_states.py builds it (its helpers: vLLM's forward, decoder layers,
TP groups over gloo, weight loaders; stand-in attention with DSA's tensor-parallel contract), dense
layers only. For each id list, stock (vLLM's function, kept by the hotfix as `__wrapped__`) and the
patched forward run on the same inputs, and each rank records what came back and the ranks' records
are judged together (harness/child/verify_group.py): every id
compared with what its decoder layer received (the package's taps, vllm_hotfix/check/taps.py,
attached as the engine's model loader attaches them). Then, on the patched states of the last id
list (which must hold the final id), faults are planted by this script, each checked on its own:
every state scaled by 1.5, each inner id taken after a norm (the final norm's eager forward), off
by one layer (id k given the state of id k+1), all-zero inner states, id 1 aliased to the final
state, the final state taken after the final norm (the model's output), and stale states (the
previous step's, on other tokens). With --gpu-norms T each forward also runs (labels
`<label>-gpu-norms`) under the GPU-only norm paths emulated (harness/child/gpu_norms.py: vLLM's
in-place fused add-RMSNorm first in its op priority; at TP>1 flashinfer's fused all-reduce + norm
stand-in for steps of at most T tokens), and no faults are planted: there the aliasing defects are
vLLM's own. Each rank saves its results to
OUT/rank<N>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from types import SimpleNamespace

import v32_states  # this script's directory is on sys.path
from tp_model import finish_loading, forward_step, rank_record, tp_groups


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ["VLLM_DIST_IDENT"] = f"verify-v32-{port}"
    import torch
    from verify_group import check_in_group  # this script's directory is on sys.path
    from vllm.distributed.parallel_state import get_tp_group

    import vllm_hotfix  # noqa: F401  (armed before vLLM: the model module is patched at its import)
    from vllm_hotfix.check import taps as taps_mod

    module = v32_states.model_module_with_stand_in(args.vendor)
    dtype = getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)
    results = []
    with tp_groups(world, rank, port) as vllm_config:
        model_config = SimpleNamespace(hf_config=v32_states._hf_config(args.layers), dtype=dtype)
        vllm_config.scheduler_config.max_num_batched_tokens = 64
        config = v32_states._ModelBuildConfig(vllm_config, model_config, vllm_config.parallel_config)
        model = module.DeepseekV32Model(vllm_config=config, prefix="model")
        model.load_weights(
            (name, v32_states._tensor(name, shape, kind, dtype))
            for name, shape, kind in v32_states._weights(args.layers)
        )
        if getattr(model, "replicated_embed", False):
            model.replicated_embed = False  # vLLM 0.29+'s Triton embed+norm has no CPU backend
        finish_loading(model)
        taps = taps_mod.attach(model, v32_states.HIDDEN, 64)
        forward = vars(type(model))["forward"]
        stock = getattr(forward, "__wrapped__", forward)

        def final_norm(state: torch.Tensor) -> torch.Tensor:  # the norm's eager forward, on a copy
            out = model.norm.forward_native(state.clone())
            return out[0] if isinstance(out, tuple) else out

        ids_tensor = torch.tensor(v32_states.PROMPT)
        positions = torch.arange(len(v32_states.PROMPT))
        step = functools.partial(forward_step, vllm_config, len(v32_states.PROMPT))

        def run(function: object, tokens: object) -> tuple[object, list]:
            with step():
                out = function(model, tokens, positions)
            return (out[0], list(out[1])) if isinstance(out, tuple) else (out, [])

        def check(label: str, ids: list[int], hidden: object, aux: list) -> None:
            found = check_in_group(
                aux, hidden, ids, v32_states.HIDDEN, get_tp_group(), taps=taps, final_id=args.layers
            )
            entry = dataclasses.asdict(found)
            entry.update(ids=ids, label=label, ok=found.ok, ranks_agree=found.ranks_agree)
            results.append(entry)

        with torch.no_grad():
            for variant in args.variants.split(";"):
                ids = [int(x) for x in variant.split(",")]
                model.aux_hidden_state_layers = tuple(ids)
                for label, function in (("stock", stock), ("patched", forward)):
                    hidden, aux = run(function, ids_tensor)
                    check(label, ids, hidden, aux)
                    if args.gpu_norms is not None:
                        import gpu_norms  # this script's directory is on sys.path

                        with gpu_norms.emulated(args.gpu_norms):
                            hidden, aux = run(function, ids_tensor)
                        check(f"{label}-gpu-norms", ids, hidden, aux)
        with torch.no_grad():
            # planted faults on the patched states of the last id list (ids ends with the final id);
            # each on a fresh forward, so that its taps ran in the step checked
            planted = {
                "scaled": lambda hidden, aux: [a * 1.5 for a in aux],
                "after-norm": lambda hidden, aux: [final_norm(a) for a in aux[:-1]] + [aux[-1]],
                "off-by-one": lambda hidden, aux: [*aux[1:], aux[-1]],
                "zero": lambda hidden, aux: [torch.zeros_like(a) for a in aux[:-1]] + [aux[-1]],
                "alias-final": lambda hidden, aux: [aux[-1], *aux[1:]],
                "final-after-norm": lambda hidden, aux: [*aux[:-1], hidden.clone()],
            }
            for name, plant in planted.items() if args.gpu_norms is None else ():
                hidden, aux = run(forward, ids_tensor)
                check(f"planted-{name}", ids, hidden, plant(hidden, aux))
            if args.gpu_norms is None:
                earlier = run(forward, ids_tensor.flip(0))[1]  # the previous step's states, other tokens
                hidden, aux = run(forward, ids_tensor)
                check("planted-stale", ids, hidden, earlier)
    record = rank_record(rank, world, patched=hasattr(forward, "__vllm_hotfix__"), results=results)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w", encoding="utf-8") as out_file:
        json.dump(record, out_file, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--vendor", default="nvidia")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", default="1,2,3;1,2,3,4")
    parser.add_argument(
        "--gpu-norms", type=int, default=None, help="emulate the GPU-only norm paths (fused up to T tokens)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from tp_ranks import run_ranks

    run_ranks(worker, args)


if __name__ == "__main__":
    main()
