"""vllm-hotfix: run-time repairs of released vLLM bugs, applied on import.

`import vllm_hotfix` arms every fix. It imports neither vllm nor torch (nor wrapt) until vLLM is
imported; then each fix probes the loaded code and patches only the known buggy shape.
"""

from vllm_hotfix import _arming
from vllm_hotfix._version import __version__

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


_arming.arm()
