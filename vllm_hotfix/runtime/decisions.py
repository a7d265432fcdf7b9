"""The one vocabulary of decisions: what a probe concludes, and what the hotfix did, per fix.

A probe's verdict about a source is one of VERDICTS; the decision recorded for a fix in a process
can also be one of the others. The values are what logs, `vllm-hotfix status` (text and JSON) and
the compatibility table show. PROBLEMS are the decisions that leave a fix out where it may be
needed: logged as a WARNING, an error in strict mode, exit code 2 of `vllm-hotfix status`.
"""

from __future__ import annotations

import enum


class Decision(str, enum.Enum):
    """What was concluded about a fix; the value is what users read."""

    PATCHED = "patched"  # the known buggy shape: the fix is (to be) installed
    FIXED_UPSTREAM = "fixed upstream"
    NOT_AFFECTED = "not affected"
    UNKNOWN = "unknown"  # not a shape the fix knows: left alone
    DISABLED = "disabled"  # VLLMHOTFIX_DISABLE
    FAILED = "failed"  # an error while patching: left alone
    REMOVED = "removed"  # restored by remove()
    PENDING = "pending"  # the fix's module is not imported in this process yet

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # type: ignore[assignment]  # f"{decision}": the value on every Python

    @property
    def is_problem(self) -> bool:
        """Whether this decision leaves the fix out where it may be needed (see PROBLEMS)."""
        return self in PROBLEMS


VERDICTS: frozenset[Decision] = frozenset(
    {Decision.PATCHED, Decision.FIXED_UPSTREAM, Decision.NOT_AFFECTED, Decision.UNKNOWN}
)
"""What a probe can conclude from a source (`Fix.probe_source`, and every release's wheel)."""

PROBLEMS: frozenset[Decision] = frozenset({Decision.UNKNOWN, Decision.FAILED})
"""Decisions logged as a WARNING, raised in strict mode, and exit code 2 of `vllm-hotfix status`."""
