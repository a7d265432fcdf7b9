"""vllm-hotfix: run-time repairs of released vLLM bugs, applied on import.

`import vllm_hotfix` arms every fix. It imports neither vllm nor torch (nor wrapt) until vLLM is
imported; then each fix probes the loaded code and patches only the known buggy shape.
"""

import os as _os
import sys as _sys

__version__ = "unknown"  # replaced below, unless the install is broken

try:
    from vllm_hotfix import _arming
    from vllm_hotfix._version import __version__
except Exception as _error:  # a broken install must not break the host, unless strict
    # VLLM_HOTFIX_STRICT read with nothing imported: _arming itself may be what is broken.
    if _os.environ.get("VLLM_HOTFIX_STRICT", "").strip().lower() in ("1", "true", "yes", "on", "all"):
        raise
    _arming = None  # type: ignore[assignment]
    try:
        _message = f"{type(_error).__name__}: {_error}".replace("\n", " ")
        _sys.stderr.write(f"vllm-hotfix: not armed: {_message}\n")
    except Exception:
        pass

__all__ = ["__version__", "apply", "remove", "status"]


def apply() -> list[dict[str, object]]:
    """Arm every fix (idempotent): patch now where vLLM's module is loaded, else on its import."""
    from vllm_hotfix import engine, report

    engine.arm()
    return report.fix_statuses()


def remove() -> list[dict[str, object]]:
    """Restore the original functions and stop patching in this process."""
    from vllm_hotfix import engine, report

    engine.remove()
    return report.fix_statuses()


def status() -> dict[str, object]:
    """What this process has decided, per fix, and about its environment. Imports nothing heavy."""
    from vllm_hotfix import report

    return report.process_status()


if _arming is not None:
    _arming.arm()  # raises only in strict mode
