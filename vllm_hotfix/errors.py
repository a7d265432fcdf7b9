"""The exceptions the package raises into its host, and only in strict mode (VLLMHOTFIX_STRICT).

A leaf module, exported as `vllm_hotfix.HotfixError`: a pipeline that must not run unpatched
catches it without importing the engine.
"""


class HotfixError(RuntimeError):
    """Strict mode only: a fix could not be applied, or a switch has an invalid value."""
