"""vLLM's `vllm.general_plugins` entry point: vLLM calls it in every process it starts.

vLLM calls plugins without error handling, so this never raises (strict mode aside); it is cheap,
re-entrant, and imports no vLLM model module: it arms the post-import hooks and returns.
"""

from __future__ import annotations


def register() -> None:
    try:
        import vllm_hotfix  # arming happens on import (idempotent)

        vllm_hotfix._arming.arm()
    except Exception as error:
        from vllm_hotfix import settings
        from vllm_hotfix.fixes import FIX_IDS

        if settings.read_settings(FIX_IDS).strict:
            raise
        import logging

        logging.getLogger("vllm.hotfix").warning("vllm-hotfix plugin could not arm: %r", error)
