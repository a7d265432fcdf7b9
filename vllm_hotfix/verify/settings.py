"""VLLM_HOTFIX_VERIFY and VLLM_HOTFIX_VERIFY_REPORT, read once per process; never raises.

Off by default: the check exchanges a small fingerprint over the tensor-parallel group on each
checked step, which a user must ask for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_hotfix import settings as settings_mod

VERIFY_VAR = "VLLM_HOTFIX_VERIFY"
REPORT_VAR = "VLLM_HOTFIX_VERIFY_REPORT"
DEFAULT_STEPS = 8


@dataclass(frozen=True)
class VerifySettings:
    """How many steps that carry aux states to check (0: off), where to write the JSON reports."""

    steps: int = 0
    report_dir: str | None = None
    problem: str | None = None


def read(environ: dict[str, str] | None = None) -> VerifySettings:
    """`1`/true/yes/on: DEFAULT_STEPS steps; a whole number N >= 2: N steps;
    0/false/no/off or unset: off. Anything else is a problem reported by the caller; the check stays
    off (the safe default)."""
    env = os.environ if environ is None else environ
    raw = env.get(VERIFY_VAR, "")
    word = raw.strip().lower()
    report_dir = env.get(REPORT_VAR) or None
    if word in settings_mod.FALSE_WORDS:
        return VerifySettings(0, report_dir)
    if word in settings_mod.TRUE_WORDS:
        return VerifySettings(DEFAULT_STEPS, report_dir)
    if word.isdigit() and int(word) >= 1:
        return VerifySettings(int(word), report_dir)
    problem = (
        f"{VERIFY_VAR}={raw!r} is not valid: use 1/true/yes/on (check the first {DEFAULT_STEPS}"
        " steps that carry aux hidden states), a number of steps, or 0/false/no/off; the check is off"
    )
    return VerifySettings(0, report_dir, problem)
