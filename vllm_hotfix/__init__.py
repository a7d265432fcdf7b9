"""vllm-hotfix: run-time repairs of released vLLM bugs, applied on import.

`import vllm_hotfix` arms every fix. It imports neither vllm nor torch (nor wrapt) until vLLM is
imported; then each fix probes the loaded code and patches only the known buggy shape.

This file is all that `import vllm_hotfix` and the site hook load before vLLM is imported: they
run in every Python process of an environment with the hook, most of which never touch vLLM, and
each module file more costs a lookup and a read in every one of them (benchmarks/startup.py). So
the import trigger lives here, and the version (_version.py), the error policy (runtime/containment.py)
and the engine are imported only when first needed. Nothing here imports beyond what a bare
interpreter already has (os, sys): not even `__future__` or `typing` (tests/test_startup_imports.py).
"""

import os as _os
import sys as _sys

__all__ = ["HotfixError", "__version__", "apply", "remove", "status"]

_TRIGGER = "vllm"
# containment.STRICT_VAR and STRICT_WORDS, read here with nothing imported: arming must not break
# the host even when runtime/containment.py itself is what is broken (tests/test_containment.py
# compares them).
_STRICT_VAR = "VLLMHOTFIX_STRICT"
_STRICT_WORDS = ("1", "true", "yes", "on", "all")
# settings.READ_AT_IMPORT and OLD_PREFIX (tests/test_cli.py compares them): with one of them set,
# the settings are read at import, so that a bad value is reported at once, the same way everywhere.
_READ_AT_IMPORT = ("VLLMHOTFIX_DISABLE", "VLLMHOTFIX_STRICT", "VLLMHOTFIX_FORCE", "VLLMHOTFIX_VERIFY_TOKENS")
_OLD_PREFIX = "VLLM_HOTFIX_"


def __getattr__(name: str) -> object:
    """`__version__` (from _version.py, the one place it is written) and `HotfixError`, imported
    when first asked for."""
    if name == "__version__":
        from vllm_hotfix._version import __version__

        return __version__
    if name == "HotfixError":
        from vllm_hotfix.runtime.errors import HotfixError

        return HotfixError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply() -> list[dict[str, object]]:
    """Arm every fix (idempotent): patch now where vLLM's module is loaded, else on its import."""
    import vllm_hotfix.fixes  # noqa: F401  # the registry: registers the fixes with the runtime
    from vllm_hotfix.runtime import arming
    from vllm_hotfix.runtime import status as report

    arming.arm()
    return report.fix_statuses()


def remove() -> list[dict[str, object]]:
    """Restore the original functions and stop patching in this process."""
    import vllm_hotfix.fixes  # noqa: F401  # the registry
    from vllm_hotfix.runtime import arming
    from vllm_hotfix.runtime import status as report

    arming.remove()
    return report.fix_statuses()


def status() -> dict[str, object]:
    """What this process has decided, per fix, and about its environment. Imports nothing heavy."""
    import vllm_hotfix.fixes  # noqa: F401  # the registry
    from vllm_hotfix.runtime import status as report

    return report.process_status()


class _VllmImportTrigger:
    """A finder that finds nothing: it only notices the first import of `vllm` and arms the engine
    (wrapt costs about 25 ms to import, so nothing waits on it before vLLM is imported)."""

    fired = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == _TRIGGER and not self.fired:
            self.fired = True  # stays in sys.meta_path, inert: removing it mid-lookup is unsafe
            _arm_engine()
        return None


def _arm_engine() -> None:
    """Arm the registered fixes (in the engine of `vllm-hotfix verify`, the check's hooks too); an
    error, even an import error of the policy module itself, reaches the host only in strict mode:
    runtime/containment.py's policy, applied inline."""
    try:
        import vllm_hotfix.fixes  # noqa: F401  # the registry: registers the fixes with the runtime
        from vllm_hotfix.runtime import arming, settings

        arming.arm()
        if settings.read_verify().armed:  # the engine `vllm-hotfix verify` started
            from vllm_hotfix.check import hook

            hook.arm()
        if settings.retired_switch_set():  # the in-server check is retired: say how to check
            _sys.stderr.write(settings.RETIRED + "\n")
    except Exception as error:
        if _os.environ.get(_STRICT_VAR, "").strip().lower() in _STRICT_WORDS:
            raise
        try:
            message = f"{type(error).__name__}: {error}".replace("\n", " ")
            _sys.stderr.write(f"vllm-hotfix: not armed: {message}\n")
        except Exception:
            pass


def _arm() -> None:
    """Arm now if vLLM is loaded, else install the import trigger once (the plugin calls it too)."""
    if _TRIGGER in _sys.modules:
        _arm_engine()
        return
    if not any(isinstance(finder, _VllmImportTrigger) for finder in _sys.meta_path):
        _sys.meta_path.insert(0, _VllmImportTrigger())


def _check_settings() -> None:
    """A setting set: report its problems now (settings.check_at_import); nothing is imported when
    none is set. Never raises: strict mode raises when the fixes are decided."""
    environ = _os.environ
    if not any(name in environ for name in _READ_AT_IMPORT) and not any(
        name.startswith(_OLD_PREFIX) for name in environ
    ):
        return
    try:
        from vllm_hotfix.fixes import FIX_IDS
        from vllm_hotfix.runtime import settings

        settings.check_at_import(FIX_IDS)
    except Exception:
        pass  # a module that cannot be read is reported once (raised in strict mode) by the arming


_check_settings()  # never raises
_arm()  # raises only in strict mode
