"""What the check and the audit read from vLLM's runtime in an engine's process: this process's
ranks, whether a forward is one of vLLM's dummy forwards, the compilation mode. Read only, never
raising: a fact that cannot be read has its neutral value."""

from __future__ import annotations

from typing import Any

from vllm_hotfix.runtime.errors import one_line


def ranks() -> dict[str, int]:
    """This process's place in every parallel dimension (read from vLLM's groups; 0 of 1 if absent)."""
    found = {}
    for name in ("tp", "pp", "dp"):
        try:
            from vllm.distributed import parallel_state

            group = getattr(parallel_state, f"get_{name}_group")()
            found[name], found[f"{name}_world"] = int(group.rank_in_group), int(group.world_size)
        except Exception:
            found[name], found[f"{name}_world"] = 0, 1
    return found


def dummy_forward() -> bool:
    """vLLM's forward context has no attention metadata: a dummy forward (`_dummy_run`), not a step."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        return is_forward_context_available() and get_forward_context().attn_metadata is None
    except Exception:
        return False


def compilation(config: Any = None) -> dict[str, Any]:
    """The compilation mode and CUDA-graph mode an engine runs with (the report says which ran):
    those of `config` (a vLLM config), else of this process's current one."""
    try:
        if config is None:
            from vllm.config import get_current_vllm_config

            config = get_current_vllm_config()
        compiled = config.compilation_config
        modes = {"mode": getattr(compiled, "mode", getattr(compiled, "level", None))}
        modes["cudagraph_mode"] = getattr(compiled, "cudagraph_mode", None)
        return {key: str(getattr(value, "name", value)) for key, value in modes.items()}
    except Exception as error:
        return {"mode": None, "cudagraph_mode": None, "error": one_line(error)}
