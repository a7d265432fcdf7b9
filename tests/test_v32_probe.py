"""The DeepSeek V3.2 probes (vllm_hotfix/fixes/deepseek_v32_final_aux.py) on hand-written shapes: no
test environment needed. On the real sources: test_v32_zero_collective_probe.py, test_stored_sources.py.
"""

from __future__ import annotations

import pytest

from tests.release_shapes import V32_FORWARD
from vllm_hotfix.fixes import ALL_FIXES, FIX_IDS
from vllm_hotfix.fixes.deepseek_v32_final_aux import DEEPSEEK_V32_FIXES, DeepseekV32FinalAux
from vllm_hotfix.runtime.decisions import Decision

V32_SP_CAPTURE = """
        if idx in self.aux_hidden_state_layers:
            aux_hidden_state = hidden_states + residual
            if aux_hidden_state.shape[0] != full_num_tokens:
                aux_hidden_state = tensor_model_parallel_all_gather(aux_hidden_state, 0)
            aux_hidden_states.append(aux_hidden_state)
"""


@pytest.mark.parametrize("probe", DEEPSEEK_V32_FIXES, ids=lambda fix: fix.fix_id)
def test_v32_probe_verdicts(probe: DeepseekV32FinalAux) -> None:
    assert probe.probe_source(V32_FORWARD).verdict is Decision.PATCHED
    capture = "        if idx in self.aux_hidden_state_layers:\n" + (
        "            aux_hidden_states.append(hidden_states + residual)\n"
    )
    sp_variant = V32_FORWARD.replace(capture, V32_SP_CAPTURE.lstrip("\n"))
    assert sp_variant != V32_FORWARD
    assert probe.probe_source(sp_variant).verdict is Decision.PATCHED
    for buggy in (V32_FORWARD, sp_variant):
        assert probe.probe_source(probe.transform_source(buggy)).verdict is Decision.FIXED_UPSTREAM
    # capturing the final layer while the in-loop sums stay per-rank partials is not a fix it knows
    final_only = V32_FORWARD.replace(
        "    hidden_states, _ = fused_allreduce",
        "    if self.end_layer in self.aux_hidden_state_layers:\n"
        "        aux_hidden_states.append(hidden_states + residual)\n"
        "    hidden_states, _ = fused_allreduce",
    )
    verdict = probe.probe_source(final_only)
    assert verdict.verdict is Decision.UNKNOWN and "un-reduced" in verdict.reason
    unfused = V32_FORWARD.replace(
        "fused_allreduce_rms_norm(hidden_states, residual, self.norm)", "self.norm(x)"
    )
    verdict = probe.probe_source(unfused)
    assert verdict.verdict is Decision.UNKNOWN and "fused_allreduce_rms_norm" in verdict.reason
    no_aux = "def forward(self, x):\n    return self.norm(x)\n"
    assert probe.probe_source(no_aux).verdict is Decision.NOT_AFFECTED


def test_v32_fixes_are_registered_for_both_vendor_files() -> None:
    for fix in DEEPSEEK_V32_FIXES:
        assert fix in ALL_FIXES and fix.fix_id in FIX_IDS
        assert fix.fixed_in is None
    assert [fix.module for fix in DEEPSEEK_V32_FIXES] == [
        "vllm.models.deepseek_v32.nvidia.model",
        "vllm.models.deepseek_v32.amd.model",
    ]
