"""What a fix is to the runtime, the mark its installed function carries, and which fixes there are.

The runtime decides, patches and reports fixes it is given: it never imports them (they build on
it). The registry, `vllm_hotfix/fixes/__init__.py`, hands its fixes to `register()` when it is
imported; the entry points (`vllm_hotfix/__init__.py`) import it before they arm or report.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FunctionType, ModuleType
from typing import Any

from vllm_hotfix.runtime.decisions import Decision


@dataclass(frozen=True)
class Probe:
    """What a probe concluded about a source: one of decisions.VERDICTS, and why."""

    verdict: Decision
    reason: str


@dataclass
class Marker:
    """Carried by every installed function as `__vllm_hotfix__`: who made it, from what."""

    fix_id: str
    version: str
    digest: str
    filename: str


class Fix(ABC):
    """One repair of one function. Subclasses set the class attributes and the two methods."""

    fix_id: str  # stable, used in VLLMHOTFIX_DISABLE, logs and markers
    title: str
    module: str  # the module whose import triggers the fix
    owner: str | None  # class that holds the function, or None for a module-level function
    attribute: str  # the function's name
    affected: tuple[str, str]  # first and last release known to carry the bug (corroboration only)
    fixed_in: str | None  # the first release with upstream's fix; None while upstream has none
    upstream: str  # where upstream fixed it, or that it has not
    related: tuple[str, ...] = ()  # other modules whose source the probe reads (never imported)
    absent: Decision = Decision.UNKNOWN  # the verdict when the target does not exist at all
    # Model architectures (keys of vLLM's model registry) whose model lives in `module`. Release
    # tooling only: it reads each wheel's registry to say whether they reach `module` by default
    # or only through `model_class_overrides`. Empty: no such claim (the table says just "patched").
    architectures: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        owner = f"{self.owner}." if self.owner else ""
        return f"{self.module}.{owner}{self.attribute}"

    @abstractmethod
    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        """Classify the target function's source text (as inspect.getsource returns it).

        `related` maps each module named in `self.related` to its source text (None if absent).
        """

    @abstractmethod
    def transform_source(self, source: str) -> str:
        """Return the fixed function's source, dedented. Only called on a PATCHED verdict."""

    # -- where the function lives; fixes with extra references override put() --------------
    def holder(self, module: ModuleType) -> Any:
        return module if self.owner is None else getattr(module, self.owner)

    def current(self, module: ModuleType) -> Any:
        """The object installed now, read without descriptors (a plain function, or whatever)."""
        holder = self.holder(module)
        if self.owner is None:
            return holder.__dict__.get(self.attribute)
        return vars(holder).get(self.attribute)

    def put(self, module: ModuleType, function: FunctionType, replacing: FunctionType) -> None:
        """Put `function` where `replacing` is now: the fixed function in place of the original
        (patching.patch), and the original back in place of the fixed one (patching.unpatch)."""
        setattr(self.holder(module), self.attribute, function)

    def class_cell(self, module: ModuleType, function: FunctionType) -> type | None:
        """The owner class, when it is what the method's only closure cell holds: the `__class__`
        cell the compiler makes for zero-argument `super()`. None for any other closure.

        Such a method is no closure in the sense that matters: its fixed source is built with
        `__class__` bound to that class (patching.patch), so its `super()` resolves as vLLM's did."""
        if self.owner is None or function.__code__.co_freevars != ("__class__",):
            return None
        closure = function.__closure__ or ()
        try:
            held = closure[0].cell_contents if len(closure) == 1 else None
        except ValueError:  # an empty cell
            return None
        return held if held is self.holder(module) else None

    def bindings(self, module: ModuleType) -> dict[str, Any]:
        """Names the fixed source uses that the target's module does not define (none by default)."""
        return {}


_registered: tuple[Fix, ...] | None = None


def register(fixes: Sequence[Fix]) -> None:
    """Make `fixes` the ones this process arms and reports (the registry calls it when imported)."""
    global _registered
    _registered = tuple(fixes)


def registered() -> tuple[Fix, ...]:
    """The fixes given to register(); an error if none were: arming nothing would be silent."""
    if _registered is None:
        raise RuntimeError("no fixes registered: vllm_hotfix.fixes was not imported")
    return _registered


def registered_ids() -> tuple[str, ...]:
    return tuple(fix.fix_id for fix in registered())
