"""The checked program is the served program: the check's taps cost no fusion of vLLM's. At TP>1
on GPUs vLLM fuses each layer's all-reduce into the next fused add-RMSNorm (AllReduceFusionPass,
inductor's pattern matcher), and a pattern does not match when an intermediate of it (the
all-reduce output, which Llama-family and DeepSeek layers return as their `hidden_states`) has a
user outside it. Here vLLM's own pattern classes (AllReduceRMSNormPattern,
AllReduceFusedAddRMSNormPattern, from vllm/compilation/passes/fusion/allreduce_rms_fusion.py)
registered in inductor's PatternMatcherPass run on the post-AOTAutograd graph of a small
Llama-shaped model traced by Dynamo (fullgraph, as vLLM traces), with and without the taps
(vllm_hotfix/check/taps.py, through `attach`), with and without vLLM's own aux-state capture
(`hidden_states + residual` after layer k, interfaces.py's `_maybe_add_hidden_state`), on vLLM
0.24.0 and 0.32.0. Figures (3 layers: 4 all-reduces, 4 fusion sites):

- no capture: 4 matches with the taps as without them, at ids (2,) and (0, 1, 2, 3). Taps that read
  the pair a layer returns (the design before this test) gave 3 and 1: the tap was then the only
  user outside the pattern;
- capture at ids (2,): 3 with and without the taps; at ids (0, 1, 2, 3): 1 with and without. vLLM's
  own capture reads the all-reduce output (`hidden_states + residual`), so at each captured id the
  fusion is lost with the check off too, whatever the taps read;
- the fused graph computes what the eager model computes (difference 0).

Stand-ins, each keeping the contract of what it replaces (nothing here runs on a GPU):
- the tensor-parallel group: an object of world size 2 whose `all_reduce` calls vLLM's own op
  `torch.ops.vllm.all_reduce(x, group_name=...)`, as GroupCoordinator.all_reduce does at world size
  > 1 (at world size 1 vLLM skips the op and the pattern has nothing to match); the op's kernel,
  found by the group's name, returns a copy: the sum over two ranks of which the other gives zeros;
- flashinfer's fused kernel `vllm.flashinfer_trtllm_fused_allreduce_norm` (the replacement's op),
  registered with vLLM's `direct_register_custom_op` under vLLM's name, arguments and mutated
  arguments, with a CPU body: the one-rank all-reduce (identity), then residual += input and the
  norm into `norm_out` (or into `allreduce_in` when none), as the kernel's kARResidualRMSNorm;
  `flashinfer_comm` (absent on CPU) is a namespace holding only that pattern code;
- the CUDA-only `_C` kernels that the fusion modules look up at import: never-called placeholders
  (harness/child/cpu_vllm_compile.py, register_missing_placeholder_ops);
- the norm module calls `vllm.ir.ops.fused_add_rms_norm` (and `rms_norm` without a residual), the
  default overload that vLLM's RMSNorm becomes after its VllmIRInplaceFunctionalizationPass, before
  AOTAutograd: the graph the pattern is matched on has the same ops as vLLM's.
"""

from __future__ import annotations

import pytest

from harness.testenv import BUG, NEWEST, child_result

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("version", [BUG, NEWEST])
def test_the_taps_cost_no_all_reduce_norm_fusion(testenv, version: str) -> None:
    """vLLM's AllReduceFusionPass patterns match as many sites with the taps as without, with and
    without vLLM's own aux capture, and the fused graph computes what the eager model does
    (module docstring: the figures, and the stand-ins)."""
    done = testenv.run([testenv.script("fusion_counts")], version=version, hotfix=True, timeout=600)
    result = child_result(done.stdout)
    assert done.returncode == 0 and result is not None, done.stderr[-4000:]
    assert result["vllm"] == version
    found = result["cases"]
    expected = {  # (capture, ids): matches, the same with and without the taps
        (False, (2,)): 4,
        (False, (0, 1, 2, 3)): 4,
        (True, (2,)): 3,
        (True, (0, 1, 2, 3)): 1,
    }
    for (capture, ids), matches in expected.items():
        for tapped in (False, True):
            seen = found[f"capture={capture} ids={ids} taps={tapped}"]
            assert seen == {"all_reduces": 4, "matched": matches, "left": 4 - matches, "difference": 0.0}, (
                capture,
                ids,
                tapped,
                found,
            )
