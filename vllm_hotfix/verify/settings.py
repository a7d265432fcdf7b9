"""VLLM_HOTFIX_VERIFY, VLLM_HOTFIX_VERIFY_REPORT and VLLM_HOTFIX_VERIFY_RUN_ID, read once per process;
never raises.

Off by default: the check exchanges a small fingerprint over the tensor-parallel group on each
checked step, which a user must ask for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_hotfix import settings as settings_mod

VERIFY_VAR = "VLLM_HOTFIX_VERIFY"
REPORT_VAR = "VLLM_HOTFIX_VERIFY_REPORT"
# Set by `vllm-hotfix verify` to a fresh value per run and written into every worker's report, so
# that a report left in the directory by an earlier run is never counted as this run's.
RUN_ID_VAR = "VLLM_HOTFIX_VERIFY_RUN_ID"
DEFAULT_STEPS = 8


@dataclass(frozen=True)
class VerifySettings:
    """How many steps that carry aux states to check (0: off), where to write the JSON reports, and
    the run they belong to (None: not started by `vllm-hotfix verify`)."""

    steps: int = 0
    report_dir: str | None = None
    problem: str | None = None
    run_id: str | None = None


def read(environ: dict[str, str] | None = None) -> VerifySettings:
    """`1`/true/yes/on: DEFAULT_STEPS steps; a whole number N >= 2: N steps;
    0/false/no/off or unset: off. Anything else is a problem reported by the caller; the check stays
    off (the safe default)."""
    env = os.environ if environ is None else environ
    raw = env.get(VERIFY_VAR, "")
    word = raw.strip().lower()
    report_dir = env.get(REPORT_VAR) or None
    run_id = env.get(RUN_ID_VAR) or None
    if word in settings_mod.FALSE_WORDS:
        return VerifySettings(0, report_dir, run_id=run_id)
    if word in settings_mod.TRUE_WORDS:
        return VerifySettings(DEFAULT_STEPS, report_dir, run_id=run_id)
    if word.isdigit() and int(word) >= 1:
        return VerifySettings(int(word), report_dir, run_id=run_id)
    problem = (
        f"{VERIFY_VAR}={raw!r} is not valid: use 1/true/yes/on (check the first {DEFAULT_STEPS}"
        " steps that carry aux hidden states), a number of steps, or 0/false/no/off; the check is off"
    )
    return VerifySettings(0, report_dir, problem, run_id)
