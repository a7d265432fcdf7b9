"""A stand-in `vllm` package, for tests of the hotfix's own machinery (arming, the generated-source
store, broken installs) that would otherwise wait seconds for each import of the real vLLM.

It holds only what those paths touch: `__version__` (a release with the bug), a "vllm" logger that
prints to stdout as vLLM's does, `vllm.plugins.load_general_plugins` (as in vLLM: filtered by
VLLM_PLUGINS, loading a plugin is guarded, calling it is not), and
`vllm.model_executor.models.deepseek_v2` with a small `DeepseekV2Model.forward` written for these
tests in the buggy shape the probe knows: with the fix, the final layer's state (id `end_layer`)
is captured too. Nothing of vLLM is copied. Tests of
the real model use the test environment (harness/testenv.py).
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

from harness.testenv import REPO

FILES = {
    "vllm/__init__.py": """
        import logging
        import sys

        __version__ = "0.24.0"
        _handler = logging.StreamHandler(sys.stdout)
        _handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logging.getLogger("vllm").addHandler(_handler)
        logging.getLogger("vllm").setLevel(logging.INFO)
        logging.getLogger("vllm").propagate = False
        """,
    "vllm/plugins/__init__.py": """
        import logging
        import os
        from importlib.metadata import entry_points

        logger = logging.getLogger(__name__)


        def load_general_plugins():
            allowed = os.environ.get("VLLM_PLUGINS")
            plugins = {}
            for plugin in entry_points(group="vllm.general_plugins"):
                if allowed is not None and plugin.name not in allowed.split(","):
                    continue
                try:
                    plugins[plugin.name] = plugin.load()
                except Exception:
                    logger.exception("Failed to load plugin %s", plugin.name)
            for func in plugins.values():
                func()
        """,
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/models/__init__.py": "",
    "vllm/model_executor/models/deepseek_v2.py": """
        class _Group:
            is_last_rank = True


        def get_pp_group():
            return _Group()


        class DeepseekV2Model:
            def __init__(self, layers=4, aux=(1, 4)):
                self.end_layer = layers
                self.layers = [lambda h, r: (h * 2, r + h)] * layers
                self.aux_hidden_state_layers = tuple(aux)

            def norm(self, hidden_states, residual):
                return hidden_states + residual, residual

            def forward(self, hidden_states):
                residual = 0
                aux_hidden_states = []
                for idx, layer in enumerate(self.layers):
                    if idx in self.aux_hidden_state_layers:
                        aux_hidden_states.append(hidden_states + residual)
                    hidden_states, residual = layer(hidden_states, residual)
                if not get_pp_group().is_last_rank:
                    return hidden_states
                hidden_states, _ = self.norm(hidden_states, residual)
                if len(aux_hidden_states) > 0:
                    return hidden_states, aux_hidden_states
                return hidden_states
        """,
}

# Whether the fix is in place, from inside a process: the forward carries the hotfix's marker and
# returns the final layer's state as a second aux state for ids (1, 4).
FIX_APPLIED = (
    "(lambda m: hasattr(vars(m.DeepseekV2Model)['forward'], '__vllm_hotfix__')"
    " and len(m.DeepseekV2Model().forward(1)[1]) == 2)"
    "(__import__('vllm.model_executor.models.deepseek_v2', fromlist=['_']))"
)

ENTRY_POINT = 'vllm_hotfix = "vllm_hotfix.plugin:register"'


def write(root: Path) -> Path:
    """Write the stand-in under `root` (put `root` on PYTHONPATH); returns `root`."""
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def copy_hotfix(target: Path) -> Path:
    """Copy this checkout's package under `target` with the dist-info that makes its
    `vllm.general_plugins` entry point visible (as pip would install it); returns the package."""
    assert ENTRY_POINT in (REPO / "pyproject.toml").read_text(), "the entry point moved: update this copy"
    package = target / "vllm_hotfix"
    shutil.copytree(REPO / "vllm_hotfix", package, ignore=shutil.ignore_patterns("__pycache__"))
    info = target / "vllm_hotfix-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-hotfix\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\n" + ENTRY_POINT.replace('"', "") + "\n")
    return package
