"""VLLM_HOTFIX_VERIFY, VLLM_HOTFIX_VERIFY_REPORT and VLLM_HOTFIX_VERIFY_TIMEOUT, read once per
process; never raises.

Off by default: the check exchanges a small fingerprint over the tensor-parallel group on each
checked step, which a user must ask for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_hotfix import settings as settings_mod

VERIFY_VAR = "VLLM_HOTFIX_VERIFY"
REPORT_VAR = "VLLM_HOTFIX_VERIFY_REPORT"
TIMEOUT_VAR = "VLLM_HOTFIX_VERIFY_TIMEOUT"
DEFAULT_STEPS = 8
# The deadline of one exchange between the ranks (seconds). The ranks enter it right after the same
# forward (whose all-reduces keep them together), so a wait near it means a rank stalled or is not
# checking; vLLM's own RPC timeout (300 s) is far above it.
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class VerifySettings:
    """How many steps that carry aux states to check (0: off), where to write the JSON reports, and
    the deadline of one exchange between the ranks."""

    steps: int = 0
    report_dir: str | None = None
    problem: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S


def _timeout(env: dict[str, str] | os._Environ[str]) -> tuple[float, str | None]:
    raw = env.get(TIMEOUT_VAR, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S, None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value > 0 and value < float("inf"):
        return value, None
    return DEFAULT_TIMEOUT_S, (
        f"{TIMEOUT_VAR}={raw!r} is not valid: use a number of seconds > 0; the deadline is"
        f" {DEFAULT_TIMEOUT_S:g} s"
    )


def read(environ: dict[str, str] | None = None) -> VerifySettings:
    """`1`/true/yes/on: DEFAULT_STEPS steps; a whole number N >= 2: N steps;
    0/false/no/off or unset: off. Anything else is a problem reported by the caller; the check stays
    off (the safe default)."""
    env = os.environ if environ is None else environ
    raw = env.get(VERIFY_VAR, "")
    word = raw.strip().lower()
    report_dir = env.get(REPORT_VAR) or None
    timeout_s, timeout_problem = _timeout(env)
    if word in settings_mod.FALSE_WORDS:
        return VerifySettings(0, report_dir)
    if word in settings_mod.TRUE_WORDS:
        return VerifySettings(DEFAULT_STEPS, report_dir, timeout_problem, timeout_s)
    if word.isdigit() and int(word) >= 1:
        return VerifySettings(int(word), report_dir, timeout_problem, timeout_s)
    problem = (
        f"{VERIFY_VAR}={raw!r} is not valid: use 1/true/yes/on (check the first {DEFAULT_STEPS}"
        " steps that carry aux hidden states), a number of steps, or 0/false/no/off; the check is off"
    )
    return VerifySettings(0, report_dir, problem, timeout_s)
