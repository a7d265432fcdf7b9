"""How a harness script runs vLLM's engine inside its own process on CPU: environment, engine, prompt.

Imported by scripts run by path (harness/child/model_states.py, forward_ab.py, engine_ab.py): their
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

# The 12-token prompt the in-process scripts prefill (token ids inside the tiny checkpoint's vocabulary).
PROMPT = [5, 17, 42, 99, 123, 7, 300, 512, 64, 800, 11, 256]

# The engine size for the tiny test checkpoint (harness/child/tiny_checkpoint.py): eager, float32, one
# short prompt at a time; the A/B scripts' two sides share one such engine.
TINY_ENGINE = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 128,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 4,
    "seed": 0,
}


def set_defaults() -> None:
    """Set each of DEFAULTS that the environment does not set already; call before importing vLLM."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
