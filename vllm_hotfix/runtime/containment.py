"""Error containment: no error of the hotfix reaches the host (vLLM's import, start-up or model
runner) unless strict mode (VLLMHOTFIX_STRICT) asks for it.

A leaf module: it imports nothing from the package, so deciding whether an error may reach the
host cannot fail because another module is broken (runtime/settings.py, which parses the switches fully,
may be the very module that is).
"""

import os
import sys

# Every Python process of an environment with the site hook imports this module: nothing beyond what
# a bare interpreter already has (os, sys) may load here, not even `__future__` or `typing`
# (tests/test_startup_imports.py). The annotation's names exist for type checkers only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

STRICT_VAR = "VLLMHOTFIX_STRICT"
STRICT_WORDS = ("1", "true", "yes", "on", "all")  # settings.TRUE_WORDS, without importing settings


def strict_requested() -> bool:
    """Whether VLLMHOTFIX_STRICT asks for errors to be raised; never raises itself."""
    try:
        return os.environ.get(STRICT_VAR, "").strip().lower() in STRICT_WORDS
    except Exception:
        return False


def report_error(what: str, error: BaseException) -> None:
    """One line on stderr (`vllm-hotfix: WHAT: Error: message`); never raises."""
    try:
        message = f"{type(error).__name__}: {error}".replace("\n", " ")
        sys.stderr.write(f"vllm-hotfix: {what}: {message}\n")
    except Exception:
        pass


def contain(
    what: str, action: "Callable[[], object]", passthrough: tuple[type[Exception], ...] = ()
) -> Exception | None:
    """Run `action`; return the error it raised, reported on stderr, unless strict mode re-raises it.

    `passthrough` errors (those meant for the host, such as strict mode's own) always propagate.
    """
    try:
        action()
    except passthrough:
        raise
    except Exception as error:
        if strict_requested():
            raise
        report_error(what, error)
        return error
    return None
