"""What a fix's declared facts (`affected`, `fixed_in`) say its probe must conclude about a release.

One rule for every test that holds probes to the registry: the stored sources of every published
release (test_stored_sources.py) and the installed vLLM of the test environment
(test_engine_behaviour.py). A new fix is covered by declaring its range, not by editing tests.
"""

from __future__ import annotations

from typing import Any

from vllm_hotfix.decisions import Decision
from vllm_hotfix.fixes import Fix
from vllm_hotfix.releases import version_key


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
