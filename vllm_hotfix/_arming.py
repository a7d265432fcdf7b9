"""Arm the fixes at almost no cost: nothing heavy is imported until vLLM itself is.

`import vllm_hotfix` runs in launch scripts, vLLM plugins and (through the site hook) in every
Python process of an environment, most of which never touch vLLM. wrapt costs about 25 ms to
import, so until `vllm` is imported only a tiny meta-path finder is installed; when the import
system asks for `vllm`, the finder arms the engine (wrapt post-import hooks on every target
module) and lets the import go on. It never changes how anything is found.
"""

import os
import sys

TRIGGER = "vllm"
STRICT_VAR = "VLLM_HOTFIX_STRICT"
STRICT_WORDS = ("1", "true", "yes", "on", "all")  # settings.TRUE_WORDS, without importing settings


def strict_requested() -> bool:
    """Whether VLLM_HOTFIX_STRICT asks for errors to be raised, read with nothing imported.

    Deciding whether an error may reach the host must not fail itself: settings.py, which parses
    the switches fully, may be the very module that is broken.
    """
    try:
        return os.environ.get(STRICT_VAR, "").strip().lower() in STRICT_WORDS
    except Exception:
        return False


def report_error(what: str, error: BaseException) -> None:
    """One line on stderr; never raises."""
    try:
        message = f"{type(error).__name__}: {error}".replace("\n", " ")
        sys.stderr.write(f"vllm-hotfix: {what}: {message}\n")
    except Exception:
        pass


class _VllmImportTrigger:
    """A finder that finds nothing: it only notices the first import of `vllm`."""

    fired = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == TRIGGER and not self.fired:
            self.fired = True  # stays in sys.meta_path, inert: removing it mid-lookup is unsafe
            _arm_engine()
        return None

    def invalidate_caches(self) -> None:
        pass


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
    try:
        from vllm_hotfix import engine

        engine.arm()
        if _verify_requested():
            from vllm_hotfix.verify import seam

            seam.arm()
    except Exception as error:  # a broken install must not break the host, unless strict
        if strict_requested():
            raise
        report_error("not armed", error)


def arm() -> None:
    """Arm now if vLLM is loaded, else install the import trigger once."""
    if TRIGGER in sys.modules:
        _arm_engine()
        return
    if not any(isinstance(finder, _VllmImportTrigger) for finder in sys.meta_path):
        sys.meta_path.insert(0, _VllmImportTrigger())
