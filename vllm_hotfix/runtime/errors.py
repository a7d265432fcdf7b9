"""The exceptions the package raises into its host, and only in strict mode (VLLMHOTFIX_STRICT).

A leaf module, exported as `vllm_hotfix.HotfixError`: a pipeline that must not run unpatched
catches it without importing the engine.
"""


class HotfixError(RuntimeError):
    """Strict mode only: a fix could not be applied, or a switch has an invalid value."""


def one_line(error: BaseException) -> str:
    """`Type: message` on one line, as the package reports an error it caught."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
