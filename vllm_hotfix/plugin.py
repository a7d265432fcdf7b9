"""vLLM's `vllm.general_plugins` entry point: vLLM calls it in every process it starts.

vLLM calls plugins without error handling, so this never raises (strict mode aside: arming
errors follow runtime/containment.py's policy, raised only under VLLMHOTFIX_STRICT). It is cheap and
re-entrant, and imports no vLLM model module: it arms post-import hooks and returns.
"""

from __future__ import annotations

import vllm_hotfix


def register() -> None:
    vllm_hotfix._arm()
