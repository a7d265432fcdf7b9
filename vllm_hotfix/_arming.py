"""Arm the fixes at almost no cost: nothing heavy is imported until vLLM itself is.

`import vllm_hotfix` runs in launch scripts, vLLM plugins and (through the site hook) in every
Python process of an environment, most of which never touch vLLM. wrapt costs about 25 ms to
import, so until `vllm` is imported only a tiny meta-path finder is installed; when the import
system asks for `vllm`, the finder arms the engine (wrapt post-import hooks on every target
module) and lets the import go on. It never changes how anything is found.
"""

import sys

TRIGGER = "vllm"


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


def _arm_engine() -> None:
    try:
        from vllm_hotfix import engine

        engine.arm()
    except Exception as error:  # a broken install must not break the host, unless strict
        from vllm_hotfix import settings

        if settings.read_settings(()).strict:
            raise
        sys.stderr.write(f"vllm-hotfix: not armed: {type(error).__name__}: {error}\n")


def arm() -> None:
    """Arm now if vLLM is loaded, else install the import trigger once."""
    if TRIGGER in sys.modules:
        _arm_engine()
        return
    if not any(isinstance(finder, _VllmImportTrigger) for finder in sys.meta_path):
        sys.meta_path.insert(0, _VllmImportTrigger())
