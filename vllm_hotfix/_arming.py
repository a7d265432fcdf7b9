"""Arm the fixes at almost no cost: nothing heavy is imported until vLLM itself is.

`import vllm_hotfix` runs in launch scripts, vLLM plugins and (through the site hook) in every
Python process of an environment, most of which never touch vLLM. wrapt costs about 25 ms to
import, so until `vllm` is imported only a tiny meta-path finder is installed; when the import
system asks for `vllm`, the finder arms the engine (wrapt post-import hooks on every target
module) and lets the import go on. It never changes how anything is found. An error while arming
is contained (containment.py): it reaches the host only in strict mode.
"""

import os
import sys

from vllm_hotfix import containment

TRIGGER = "vllm"


class _VllmImportTrigger:
    """A finder that finds nothing: it only notices the first import of `vllm`."""

    fired = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == TRIGGER and not self.fired:
            self.fired = True  # stays in sys.meta_path, inert: removing it mid-lookup is unsafe
            _arm_engine()
        return None


def _verify_requested() -> bool:
    """VLLM_HOTFIX_VERIFY set to anything but off: the check's own module reads it fully."""
    return os.environ.get("VLLM_HOTFIX_VERIFY", "").strip().lower() not in (
        "",
        "0",
        "false",
        "no",
        "off",
        "none",
    )


def _arm_engine() -> None:
    containment.contain("not armed", _arm_now)  # a broken install must not break the host


def _arm_now() -> None:
    from vllm_hotfix import engine

    engine.arm()
    if _verify_requested():
        from vllm_hotfix.verify import seam

        seam.arm()


def arm() -> None:
    """Arm now if vLLM is loaded, else install the import trigger once."""
    if TRIGGER in sys.modules:
        _arm_engine()
        return
    if not any(isinstance(finder, _VllmImportTrigger) for finder in sys.meta_path):
        sys.meta_path.insert(0, _VllmImportTrigger())
