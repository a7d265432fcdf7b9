"""The registry: every fix this package knows. A new fix is one module and one line here.

Importing it registers the fixes with the runtime (`runtime.fix.register`), which never imports them.
"""

from __future__ import annotations

from vllm_hotfix.fixes.base import Fix
from vllm_hotfix.fixes.cpu_sampler_fp64_gumbel import CpuSamplerFp64Gumbel
from vllm_hotfix.fixes.deepseek_final_aux import DeepseekFinalAux
from vllm_hotfix.fixes.deepseek_v32_final_aux import DEEPSEEK_V32_FIXES
from vllm_hotfix.fixes.eagle3_nested_layer_ids import Eagle3NestedLayerIds
from vllm_hotfix.fixes.extract_dummy_run_slots import ExtractDummyRunSlots
from vllm_hotfix.fixes.extract_next_token import ExtractNextToken
from vllm_hotfix.fixes.hidden_states_hybrid_block import HiddenStatesHybridBlock
from vllm_hotfix.fixes.hidden_states_padding_slot import HiddenStatesPaddingSlot
from vllm_hotfix.fixes.hidden_states_prefix_cache import HiddenStatesPrefixCache
from vllm_hotfix.fixes.hidden_states_unfinished_prefill import HiddenStatesUnfinishedPrefill
from vllm_hotfix.fixes.minimax_m3_aux import MiniMaxM3Aux
from vllm_hotfix.fixes.pp_aux_layer_index import PP_AUX_LAYER_INDEX_FIXES
from vllm_hotfix.fixes.shared_capture_id0 import SharedCaptureId0
from vllm_hotfix.fixes.v1_dflash_layer_ids import V1DflashLayerIds
from vllm_hotfix.runtime.fix import register

ALL_FIXES: tuple[Fix, ...] = (
    DeepseekFinalAux(),
    CpuSamplerFp64Gumbel(),
    *DEEPSEEK_V32_FIXES,
    MiniMaxM3Aux(),
    SharedCaptureId0(),
    HiddenStatesPaddingSlot(),
    HiddenStatesHybridBlock(),
    Eagle3NestedLayerIds(),
    ExtractNextToken(),
    HiddenStatesPrefixCache(),
    V1DflashLayerIds(),
    ExtractDummyRunSlots(),
    *PP_AUX_LAYER_INDEX_FIXES,
    HiddenStatesUnfinishedPrefill(),
)
FIX_IDS: tuple[str, ...] = tuple(fix.fix_id for fix in ALL_FIXES)
register(ALL_FIXES)

__all__ = ["ALL_FIXES", "FIX_IDS", "Fix"]
