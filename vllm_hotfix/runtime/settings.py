"""The user's switches, read from the environment each time a decision is made.

Invalid values never stop the host: they are reported (naming the variable and what it accepts)
and the safe default is used instead. Strict mode turns them into errors.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

# Every switch of this package starts with PREFIX. vLLM treats every `VLLM_` name as its own (it
# warns about each one it does not know, and refuses to start under --fail-on-environ-validation),
# so the package's names stay out of that namespace; a name of the old prefix still set is reported
# with its new name instead of being read.
PREFIX = "VLLMHOTFIX_"
OLD_PREFIX = "VLLM_HOTFIX_"
DISABLE_VAR = "VLLMHOTFIX_DISABLE"
STRICT_VAR = "VLLMHOTFIX_STRICT"
FORCE_VAR = "VLLMHOTFIX_FORCE"
# The switches read_settings() parses.
SWITCHES = (DISABLE_VAR, STRICT_VAR, FORCE_VAR)
# What `import vllm_hotfix` reads when one of them is set: the switches and the check's token bound
# (TOKENS_VAR, below); vllm_hotfix/__init__.py keeps a copy (tests/test_cli.py).
READ_AT_IMPORT = (*SWITCHES, "VLLMHOTFIX_VERIFY_TOKENS")
CACHE_DIR_VAR = "VLLMHOTFIX_CACHE_DIR"

TRUE_WORDS = frozenset({"1", "true", "yes", "on", "all"})
FALSE_WORDS = frozenset({"", "0", "false", "no", "off", "none"})


@dataclass(frozen=True)
class Settings:
    """What the environment asks for, plus the problems found while reading it."""

    disable_all: bool = False
    disabled_ids: frozenset[str] = frozenset()
    strict: bool = False
    problems: tuple[str, ...] = field(default=())
    forced_ids: frozenset[str] = frozenset()

    def is_disabled(self, fix_id: str) -> bool:
        return self.disable_all or fix_id in self.disabled_ids


def renamed_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per variable of the old prefix still set: it is not read; its new name is said."""
    env = os.environ if environ is None else environ
    return [
        f"{name} is no longer read: rename it to {PREFIX}{name[len(OLD_PREFIX) :]}"
        " (vLLM claims every VLLM_ name)"
        for name in sorted(env)
        if name.startswith(OLD_PREFIX)
    ]


def read_settings(known_fix_ids: tuple[str, ...], environ: dict[str, str] | None = None) -> Settings:
    """Parse VLLMHOTFIX_DISABLE, VLLMHOTFIX_STRICT and VLLMHOTFIX_FORCE; never raises."""
    env = os.environ if environ is None else environ
    problems: list[str] = renamed_variables(env)

    strict_raw = env.get(STRICT_VAR, "")
    strict_word = strict_raw.strip().lower()
    if strict_word in TRUE_WORDS:
        strict = True
    elif strict_word in FALSE_WORDS:
        strict = False
    else:
        strict = False
        problems.append(
            f"{STRICT_VAR}={strict_raw!r} is not valid: use 1/true/yes/on or 0/false/no/off;"
            " using the default (not strict)"
        )

    disable_raw = env.get(DISABLE_VAR, "")
    disable_word = disable_raw.strip().lower()
    disable_all = False
    disabled: set[str] = set()
    if disable_word in TRUE_WORDS:
        disable_all = True
    elif disable_word not in FALSE_WORDS:
        for item in (part.strip() for part in disable_raw.split(",")):
            if not item:
                continue
            if item in known_fix_ids:
                disabled.add(item)
            else:
                problems.append(
                    f"{DISABLE_VAR}: {item!r} is not a fix id; accepted values: 1/true/yes/on/all"
                    f" (every fix), 0/false/no/off (none), or a comma-separated list of"
                    f" {', '.join(known_fix_ids)}; ignoring {item!r}"
                )
    forced: set[str] = set()
    for item in (part.strip() for part in env.get(FORCE_VAR, "").split(",")):
        if item in known_fix_ids:
            forced.add(item)
        elif item:
            problems.append(
                f"{FORCE_VAR}: {item!r} is not a fix id; accepted values: a comma-separated list of"
                f" {', '.join(known_fix_ids)}; ignoring {item!r}"
            )
    return Settings(disable_all, frozenset(disabled), strict, tuple(problems), frozenset(forced))


_reported: set[str] = set()


def unreported(problems: tuple[str, ...]) -> list[str]:
    """The lines vLLM's log shows for the problems not logged yet in this process: each once, worded
    as `import vllm_hotfix` and `vllm-hotfix status` word them."""
    lines = [f"vllm-hotfix: settings problem: {p}" for p in problems if p not in _reported]
    _reported.update(problems)
    return lines


def check_at_import(fix_ids: tuple[str, ...]) -> None:
    """Read the switches at `import vllm_hotfix` (`fix_ids`: the registry's): each problem is one
    line on stderr (vLLM's logger may not exist yet). Strict mode raises later, when the fixes are
    decided inside vLLM's import of the model's module: raised here, vLLM's plugin loader would
    swallow the error and run vLLM unpatched, the opposite of strict."""
    problems = [*read_settings(fix_ids).problems, read_verify().problem]
    for problem in filter(None, problems):  # vLLM's log says the switches' again, once, as ERRORs
        sys.stderr.write(f"vllm-hotfix: settings problem: {problem}\n")


def cache_root(environ: dict[str, str] | None = None) -> tuple[str, tuple[str, ...]]:
    """The cache directory as (a base used as given, the directories this package creates in it):
    (VLLMHOTFIX_CACHE_DIR, ()), else (the user's cache directory, ("vllm-hotfix",))."""
    env = os.environ if environ is None else environ
    explicit = env.get(CACHE_DIR_VAR)
    if explicit:
        return explicit, ()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return base, ("vllm-hotfix",)


def cache_dir(environ: dict[str, str] | None = None) -> str:
    """Where generated sources live: VLLMHOTFIX_CACHE_DIR, else the user's cache directory."""
    base, parts = cache_root(environ)
    return os.path.join(base, *parts)


# -- the check's run: what `vllm-hotfix verify` sets for the engine it starts ----------------------
# The command sets all three of RUN_ID_VAR, REPORT_VAR and MODEL_VAR (a user never does): each process
# of that engine then hooks that model class (check/hook.py) and writes its records under
# `REPORT_VAR/RUN_ID_VAR/`. VERIFY_VAR was the in-server switch, now retired: it installs nothing.
VERIFY_VAR = "VLLMHOTFIX_VERIFY"  # retired: logs how to check instead (vllm_hotfix._arm_engine)
REPORT_VAR = "VLLMHOTFIX_VERIFY_REPORT"
RUN_ID_VAR = "VLLMHOTFIX_VERIFY_RUN_ID"
MODEL_VAR = "VLLMHOTFIX_VERIFY_MODEL"  # `module:Class`, the class vLLM's registry resolved
TOKENS_VAR = "VLLMHOTFIX_VERIFY_TOKENS"
# the module (under vllm_hotfix.) whose `attach(model, ids)` the hooked model runs too: the command
# names the audit's worker for its engine, so that the check never imports the audit
WORKER_VAR = "VLLMHOTFIX_VERIFY_WORKER"
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


def read_verify(environ: dict[str, str] | None = None) -> VerifySettings:
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
    return env.get(VERIFY_VAR, "").strip().lower() not in FALSE_WORDS
