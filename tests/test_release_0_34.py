"""What vLLM 0.34.0 changed for the fixes, on its stored sources (tests/sources/), offline.

- MiniMax-M3 (nvidia) is fixed upstream: the probe recognises 0.34.0's capture (the cloned residual
  each layer's input norm returns, and the final norm's second output), and any of its three parts
  undone makes the forward `unknown` again, never `fixed upstream` nor `not affected`.
- DeepSeek V3.2 (nvidia and amd) is still affected: the probe says `patched`, the transform makes the
  same edits as on 0.33.0 (only pipeline-parallel transport changed around them), and its result is
  what the probe calls fixed, with id 0 a copy.
"""

from __future__ import annotations

import difflib
import textwrap

import pytest

from tests.stored_sources import Case, case
from vllm_hotfix.fixes import ALL_FIXES, Fix
from vllm_hotfix.fixes.minimax_m3_aux import CLONED_CAPTURE, INPUT_NORM, MiniMaxM3Aux
from vllm_hotfix.runtime.decisions import Decision

RELEASE = "0.34.0"
PREVIOUS = "0.33.0"
MINIMAX = MiniMaxM3Aux()


def _fix(fix_id: str) -> Fix:
    (found,) = [fix for fix in ALL_FIXES if fix.fix_id == fix_id]
    return found


def _minimax(dist: str = "vllm") -> Case:
    return case(MINIMAX, dist, RELEASE)


def test_minimax_m3_0_34_is_recognised_as_fixed_upstream() -> None:
    stored = _minimax()
    assert stored.function is not None
    probe = MINIMAX.probe_source(stored.function, stored.related)
    assert probe.verdict is Decision.FIXED_UPSTREAM, probe.reason
    assert "input norm" in probe.reason
    assert MINIMAX.fixed_in == RELEASE and MINIMAX.affected == ("0.24.0", PREVIOUS)
    previous = case(MINIMAX, "vllm", PREVIOUS)
    assert previous.function is not None
    assert MINIMAX.probe_source(previous.function, previous.related).verdict is Decision.PATCHED


LOOP_COPY = (
    "aux_hidden_states.append(residual.clone())\n            hidden_states, residual = layer.forward_after"
)
FINAL_ID = "if self.end_layer in self.aux_hidden_state_layers:\n" + " " * 12 + CLONED_CAPTURE + "\n"


def _capture_before_the_norm(source: str) -> str:
    """The loop's capture moved above the input norm: it reads the partial sum again."""
    lines = source.splitlines(keepends=True)
    (norm_at,) = [i for i, line in enumerate(lines) if line.strip() == INPUT_NORM]
    capture = next(i for i, line in enumerate(lines) if line.strip() == CLONED_CAPTURE)
    block = lines[capture - 3 : capture + 1]  # the `if idx in ...` test (3 lines) and the append
    del lines[capture - 3 : capture + 1]
    lines[norm_at:norm_at] = block
    return "".join(lines)


UNDONE = {
    "the loop's copy": lambda s: s.replace(LOOP_COPY, LOOP_COPY.replace(".clone()", "")),
    "the capture after the input norm": _capture_before_the_norm,
    "the final id": lambda s: s.replace(FINAL_ID, ""),
}


@pytest.mark.parametrize("undone", list(UNDONE))
def test_minimax_m3_0_34_with_a_part_undone_is_unknown(undone: str) -> None:
    """The probe reads 0.34.0's model file only where the forward is not the fixed shape, so that
    file is not stored: 0.33.0's stands in (its decoder layer fuses the input all-reduce, the bug's
    condition). The verdict then comes from the shape check: neither fixed nor a known buggy shape."""
    stored, previous = _minimax(), case(MINIMAX, "vllm", PREVIOUS)
    assert stored.function is not None
    assert previous.related[MINIMAX.module] is not None  # the model file the probe reads
    assert MINIMAX.probe_source(stored.function, previous.related).verdict is Decision.FIXED_UPSTREAM
    mutated = UNDONE[undone](stored.function)
    assert mutated != stored.function, undone
    probe = MINIMAX.probe_source(mutated, previous.related)
    assert probe.verdict is Decision.UNKNOWN, f"{undone}: {probe.verdict.value} ({probe.reason})"
    assert probe.reason.startswith("forward captures aux hidden states but is not a known buggy shape")


def _added(before: str, after: str) -> list[str]:
    """The lines a transform added, stripped (what it replaced may be written otherwise: the amd file's
    stock id-0 capture became `hidden_states if residual is None else hidden_states + residual`)."""
    diff = difflib.ndiff(before.splitlines(), after.splitlines())
    return [line[2:].strip() for line in diff if line.startswith("+ ")]


@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_deepseek_v32_0_34_is_patched_with_the_same_edits_as_0_33(vendor: str) -> None:
    fix = _fix(f"deepseek-v32-final-aux-{vendor}")
    now, before = case(fix, "vllm", RELEASE), case(fix, "vllm", PREVIOUS)
    assert now.function is not None and before.function is not None
    assert now.function != before.function  # 0.34.0 changed pipeline-parallel transport
    probe = fix.probe_source(now.function, now.related)
    assert probe.verdict is Decision.PATCHED, probe.reason
    fixed = fix.transform_source(now.function)
    assert fix.probe_source(fixed, now.related).verdict is Decision.FIXED_UPSTREAM
    assert "hidden_states.clone() if residual is None else" in fixed  # id 0 a copy
    added = _added(textwrap.dedent(now.function), fixed)
    assert added and added == _added(textwrap.dedent(before.function), fix.transform_source(before.function))


def test_the_check_says_why_it_cannot_tap_minimax_m3_0_34() -> None:
    """0.34.0's forward calls each layer's halves, so no module hook on a layer fires: every id is
    `n/a` with this reason (check/taps.py), where 0.33.0's and V3.2's forwards call the layers."""
    from vllm_hotfix.check.taps import split_layer_reason

    now, before = _minimax(), case(MINIMAX, "vllm", PREVIOUS)
    assert now.function is not None and before.function is not None
    reason = split_layer_reason(now.function, "MiniMaxM3Model")
    assert reason is not None and "forward_after_input_norm, forward_input_norm" in reason
    assert split_layer_reason(before.function, "MiniMaxM3Model") is None
    for vendor in ("nvidia", "amd"):
        v32 = case(_fix(f"deepseek-v32-final-aux-{vendor}"), "vllm", RELEASE)
        assert v32.function is not None and split_layer_reason(v32.function, "DeepseekV32Model") is None


def test_a_model_whose_forward_calls_layer_halves_gets_that_reason_at_attach() -> None:
    """The wiring: `taps.attach` reads the holder's forward and gives every id the reason."""
    torch = pytest.importorskip("torch")
    from vllm_hotfix.check import taps

    class Layer(torch.nn.Module):
        def first(self, hidden_states, residual):
            return hidden_states, hidden_states if residual is None else hidden_states + residual

        def forward(self, hidden_states, residual):
            return hidden_states * 2, residual

    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(2))
            self.aux_hidden_state_layers = (1, 2)

        def forward(self, x):
            residual = None
            for layer in self.layers:
                x, residual = layer.first(x, residual)
            return x

    class Whole(Split):
        def forward(self, x):
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual)
            return x

    split = taps.attach(Split(), hidden_size=4, max_tokens=8)
    whole = taps.attach(Whole(), hidden_size=4, max_tokens=8)
    assert split is not None and whole is not None
    assert split.bypassed is not None and "(first)" in split.bypassed
    assert all(split.form(row) == split.bypassed for row in split.rows.values())
    assert whole.bypassed is None and whole.form(whole.rows[1]) is None
