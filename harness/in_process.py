"""The environment a harness script needs to run vLLM's engine inside its own process on CPU.

Imported by scripts run by path (harness/model_states.py, forward_ab.py, engine_ab.py): their
directory is on sys.path. Defaults only, so a test can still override any of them.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "VLLM_MLA_DISABLE": "1",  # MLA attention is not implemented on CPU
    "VLLM_CPU_KVCACHE_SPACE": "1",  # 1 GiB of KV cache: enough for the tiny model
    "HF_HUB_OFFLINE": "1",  # the checkpoint is local
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: a hook can read the model
}


def set_defaults() -> None:
    """Set each of DEFAULTS that the environment does not set already; call before importing vLLM."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
