"""vLLM's `vllm.general_plugins` entry point: vLLM calls it in every process it starts.

vLLM calls plugins without error handling, so this never raises (strict mode aside: arming
errors are contained by containment.py, which raises only under VLLM_HOTFIX_STRICT). It is cheap and
re-entrant, and imports no vLLM model module: it arms post-import hooks and returns.
"""

from __future__ import annotations

import vllm_hotfix


def register() -> None:
    if vllm_hotfix._arming is not None:  # None: the install is broken, and the import said so
        vllm_hotfix._arming.arm()
