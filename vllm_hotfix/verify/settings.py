"""VLLMHOTFIX_VERIFY, VLLMHOTFIX_VERIFY_REPORT, VLLMHOTFIX_VERIFY_TIMEOUT,
VLLMHOTFIX_VERIFY_TOKENS and VLLMHOTFIX_VERIFY_RUN_ID, read once per process; never raises.

Off by default: the check exchanges a small fingerprint over the tensor-parallel group on each
checked step, which a user must ask for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_hotfix import settings as settings_mod

VERIFY_VAR = "VLLMHOTFIX_VERIFY"
REPORT_VAR = "VLLMHOTFIX_VERIFY_REPORT"
TIMEOUT_VAR = "VLLMHOTFIX_VERIFY_TIMEOUT"
# Set by `vllm-hotfix verify` to a fresh value per run and written into every worker's report, so
# that a report left in the directory by an earlier run is never counted as this run's.
RUN_ID_VAR = "VLLMHOTFIX_VERIFY_RUN_ID"
DEFAULT_STEPS = 8
# The deadline of one exchange between the ranks (seconds). The ranks enter it right after the same
# forward (whose all-reduces keep them together), so a wait near it means a rank stalled or is not
# checking; vLLM's own RPC timeout (300 s) is far above it.
DEFAULT_TIMEOUT_S = 60.0
TOKENS_VAR = "VLLMHOTFIX_VERIFY_TOKENS"
# The most tokens of one step the check compares (a longer step: its first ones). It bounds what
# the check holds whatever the scheduler's max_num_batched_tokens: the taps' buffers (1 MiB at 4
# ids) and a step's exchange (about 1.6 MB sent per rank at 4 ids, 13 MB received at TP=8), where a
# 128k-token prefill checked whole would send 52 MB per rank and receive 420 MB at TP=8.
DEFAULT_TOKENS = 4096


@dataclass(frozen=True)
class VerifySettings:
    """How many steps that carry aux states to check (0: off), where to write the JSON reports, and
    the deadline of one exchange between the ranks, the run they belong to (None: not started
    by `vllm-hotfix verify`), and the most tokens of a step compared."""

    steps: int = 0
    report_dir: str | None = None
    problem: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    run_id: str | None = None
    tokens: int = DEFAULT_TOKENS


def _number(
    env: dict[str, str] | os._Environ[str], var: str, default: float, unit: str, whole: bool
) -> tuple[float, str | None]:
    """A number > 0 (a whole one if `whole`) from `var`, or the default with the problem."""
    raw = env.get(var, "").strip()
    if not raw:
        return default, None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if 0 < value < float("inf") and (not whole or value.is_integer()):
        return value, None
    kind = "a whole number of" if whole else "a number of"
    return default, f"{var}={raw!r} is not valid: use {kind} {unit} > 0; it is {default:g}"


def read(environ: dict[str, str] | None = None) -> VerifySettings:
    """`1`/true/yes/on: DEFAULT_STEPS steps; a whole number N >= 2: N steps;
    0/false/no/off or unset: off. Anything else is a problem reported by the caller; the check stays
    off (the safe default)."""
    env = os.environ if environ is None else environ
    raw = env.get(VERIFY_VAR, "")
    word = raw.strip().lower()
    report_dir = env.get(REPORT_VAR) or None
    timeout_s, timeout_problem = _number(env, TIMEOUT_VAR, DEFAULT_TIMEOUT_S, "seconds", whole=False)
    tokens, tokens_problem = _number(env, TOKENS_VAR, DEFAULT_TOKENS, "tokens", whole=True)
    problems = "; ".join(p for p in (timeout_problem, tokens_problem) if p) or None
    run_id = env.get(RUN_ID_VAR) or None
    if word in settings_mod.FALSE_WORDS:
        return VerifySettings(0, report_dir, run_id=run_id)
    if word in settings_mod.TRUE_WORDS:
        return VerifySettings(DEFAULT_STEPS, report_dir, problems, timeout_s, run_id, int(tokens))
    if word.isdigit() and int(word) >= 1:
        return VerifySettings(int(word), report_dir, problems, timeout_s, run_id, int(tokens))
    problem = (
        f"{VERIFY_VAR}={raw!r} is not valid: use 1/true/yes/on (check the first {DEFAULT_STEPS}"
        " steps that carry aux hidden states), a number of steps, or 0/false/no/off; the check is off"
    )
    return VerifySettings(0, report_dir, problem, timeout_s, run_id, int(tokens))
