"""The switches `vllm-hotfix verify` sets for the engine it starts, read without torch; never raises.

The command sets all three of RUN_ID_VAR, REPORT_VAR and MODEL_VAR (a user never does): each process
of that engine then hooks that model class (hook.py) and writes its records under
`REPORT_VAR/RUN_ID_VAR/`. VERIFY_VAR was the in-server switch, now retired: it installs nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

VERIFY_VAR = "VLLMHOTFIX_VERIFY"  # retired: logs how to check instead (vllm_hotfix._arm_engine)
REPORT_VAR = "VLLMHOTFIX_VERIFY_REPORT"
RUN_ID_VAR = "VLLMHOTFIX_VERIFY_RUN_ID"
MODEL_VAR = "VLLMHOTFIX_VERIFY_MODEL"  # `module:Class`, the class vLLM's registry resolved
TOKENS_VAR = "VLLMHOTFIX_VERIFY_TOKENS"
DEFAULT_TOKENS = 4096  # the most tokens of a forward compared (its first): bounds the taps and records
RETIRED = (
    f"vllm-hotfix: {VERIFY_VAR} is retired and installs nothing: the check no longer runs inside a"
    " server. Check the aux states before serving with `vllm-hotfix verify MODEL -- <this server's"
    " engine flags>`."
)


@dataclass(frozen=True)
class VerifySettings:
    """The run this process belongs to (None: not started by `vllm-hotfix verify`)."""

    run_id: str | None = None
    report_dir: str | None = None
    model: str | None = None
    tokens: int = DEFAULT_TOKENS
    problem: str | None = None

    @property
    def armed(self) -> bool:
        return bool(self.run_id and self.report_dir and self.model)


def read(environ: dict[str, str] | None = None) -> VerifySettings:
    env = os.environ if environ is None else environ
    raw = env.get(TOKENS_VAR, "").strip()
    tokens, problem = DEFAULT_TOKENS, None
    if raw:
        if raw.isdigit() and int(raw) > 0:
            tokens = int(raw)
        else:
            problem = f"{TOKENS_VAR}={raw!r} is not valid: use a whole number of tokens > 0"
    return VerifySettings(
        env.get(RUN_ID_VAR) or None, env.get(REPORT_VAR) or None, env.get(MODEL_VAR) or None, tokens, problem
    )


def retired_switch_set(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(VERIFY_VAR, "").strip().lower() not in ("", "0", "false", "no", "off", "none")
