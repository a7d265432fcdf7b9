"""The DeepseekV32 fix's choice of form, on the test environment's real sources: where the decoder
layer takes a pre-normed input (`attn_in`, nvidia 0.29+) the loop runs the layer's own fused input
norm (no collective added), elsewhere one all-reduce per requested inner layer; the final state is
the final fused norm's second output everywhere. The states themselves: test_v32_states.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.releases.classify import function_source
from harness.testenv import FIXED, NEWEST, TestEnv
from vllm_hotfix.fixes.deepseek_v32_final_aux import (
    DEEPSEEK_V32_FIXES,
    LAYER_INPUT_NORM,
    DeepseekV32FinalAux,
)
from vllm_hotfix.runtime.decisions import Decision

pytestmark = pytest.mark.vllm
NVIDIA, AMD = DEEPSEEK_V32_FIXES
FREE_CAPTURE = (
    "attn_in, hidden_states = fused_allreduce_rms_norm(hidden_states, residual, layer.input_layernorm)"
)
FINAL = "hidden_states, final_state = fused_allreduce_rms_norm(hidden_states, residual, self.norm)"


@pytest.fixture(scope="module")
def modules(testenv: TestEnv) -> dict[tuple[str, str], str]:
    newest = next((testenv.root / "newest" / "venv" / "lib").glob("python*/site-packages"))
    found = {(FIXED, "nvidia"): testenv.root / f"vllm-{FIXED}"}
    found |= {(NEWEST, "nvidia"): newest, (NEWEST, "amd"): newest}
    return {
        key: Path(root, "vllm/models/deepseek_v32", key[1], "model.py").read_text()
        for key, root in found.items()
    }


def _fixed(fix: DeepseekV32FinalAux, module_text: str) -> str:
    source = function_source(module_text, "DeepseekV32Model", "forward")
    assert source is not None
    probe = fix.probe_source(source, {fix.module: module_text})
    assert probe.verdict is Decision.PATCHED, probe.reason
    fixed = fix.transform_source(source)
    compile(fixed, fix.fix_id, "exec")
    assert fix.probe_source(fixed, {fix.module: module_text}).verdict is Decision.FIXED_UPSTREAM
    return fixed


@pytest.mark.parametrize(
    ("version", "vendor", "free"),
    [(NEWEST, "nvidia", True), (FIXED, "nvidia", False), (NEWEST, "amd", False)],
)
def test_the_form_follows_the_decoder_layer(modules, version: str, vendor: str, free: bool) -> None:
    fix = NVIDIA if vendor == "nvidia" else AMD
    fixed = _fixed(fix, modules[version, vendor])
    assert (FREE_CAPTURE in fixed) is free
    assert FINAL in fixed  # the final state: free on every release


def test_an_unknown_decoder_layer_leaves_the_newest_nvidia_forward_alone(modules) -> None:
    text = modules[NEWEST, "nvidia"]
    source = function_source(text, "DeepseekV32Model", "forward")
    assert source is not None
    changed = text.replace(
        "self.input_layernorm\n            )", "self.post_attention_layernorm\n            )", 1
    )
    assert LAYER_INPUT_NORM.split("(")[0] in text and changed != text
    probe = NVIDIA.probe_source(source, {NVIDIA.module: changed})
    assert probe.verdict is Decision.UNKNOWN and "DeepseekV32DecoderLayer" in probe.reason
    assert NVIDIA.probe_source(source, {}).verdict is Decision.UNKNOWN  # the module could not be read
