"""The MiniMax-M3 probe and transform against the real vLLM sources of the test environment (0.24.0,
0.25.0, newest) and shapes derived from them; the states themselves: test_minimax_m3_states.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.releases.classify import function_source
from harness.testenv import BUG, FIXED, NEWEST, TestEnv
from vllm_hotfix.fixes.minimax_m3_aux import MiniMaxM3Aux
from vllm_hotfix.runtime.decisions import Decision

pytestmark = pytest.mark.vllm
FIX = MiniMaxM3Aux()
AMD = "vllm.models.minimax_m3.amd.model"


@pytest.fixture(scope="module")
def modules(testenv: TestEnv) -> dict[tuple[str, str], str]:
    """(release, vendor) -> the model module's text."""
    newest = next((testenv.root / "newest" / "venv" / "lib").glob("python*/site-packages"))
    roots = {BUG: testenv.site_packages(), FIXED: testenv.root / f"vllm-{FIXED}", NEWEST: newest}
    return {
        (version, vendor): Path(root, "vllm/models/minimax_m3", vendor, "model.py").read_text()
        for version, root in roots.items()
        for vendor in ("nvidia", "amd")
    }


def _probe(module_text: str, forward: str | None = None) -> tuple[str, Decision, str]:
    source = forward or function_source(module_text, "MiniMaxM3Model", "forward")
    assert source is not None
    probe = FIX.probe_source(source, {FIX.module: module_text})
    return source, probe.verdict, probe.reason


@pytest.mark.parametrize("version", [BUG, FIXED, NEWEST])
def test_the_nvidia_forward_is_patched_and_its_transform_is_what_the_probe_calls_fixed(
    modules, version
) -> None:
    module_text = modules[version, "nvidia"]
    source, verdict, reason = _probe(module_text)
    assert verdict is Decision.PATCHED, reason
    fixed = FIX.transform_source(source)
    compile(fixed, version, "exec")
    assert FIX.probe_source(fixed, {FIX.module: module_text}).verdict is Decision.FIXED_UPSTREAM
    # the all-reduce only for a requested id: _maybe_add_hidden_state takes the value for every layer
    assert "idx + 1 in self.aux_hidden_state_layers and" in fixed
    final_from_norm = "self._maybe_add_hidden_state(aux_hidden_states, self.end_layer, final_state, None)"
    assert (final_from_norm in fixed) == (version != BUG)  # 0.24.0's final norm is not fused


@pytest.mark.parametrize("version", [BUG, FIXED, NEWEST])
def test_the_amd_file_reduces_first_and_is_not_affected(modules, version) -> None:
    _, verdict, reason = _probe(modules[version, "amd"])
    assert verdict is Decision.NOT_AFFECTED and "no norm of this file" in reason


def test_unknown_shapes_are_left_alone(modules) -> None:
    text = modules[NEWEST, "nvidia"]
    source = function_source(text, "MiniMaxM3Model", "forward")
    assert source is not None
    shifted = source.replace(
        "aux_hidden_states, idx + 1, hidden_states", "aux_hidden_states, idx, hidden_states"
    )
    assert shifted != source
    assert _probe(text, shifted)[1] is Decision.UNKNOWN
    unfused = source.replace("fused_allreduce_gemma_rms_norm(", "other_norm(")
    assert _probe(text, unfused)[1] is Decision.UNKNOWN
    # the nvidia forward with a module whose layers never fuse their input reduce: not a known shape
    assert _probe(modules[NEWEST, "amd"], source)[1] is Decision.UNKNOWN
    assert FIX.probe_source(source, {}).verdict is Decision.UNKNOWN  # the module could not be read
    plain = "def forward(self, x):\n    return self.norm(x)\n"
    assert _probe(text, plain)[1] is Decision.NOT_AFFECTED
