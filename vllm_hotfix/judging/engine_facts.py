"""What the check and the audit know of vLLM: in an engine's process, this process's ranks, whether
a forward is one of vLLM's dummy forwards, the compilation mode (read only, never raising: a fact
that cannot be read has its neutral value); and the order in which vLLM returns aux states."""

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


def in_vllm_order(ids: list[int]) -> tuple[list[int], str | None]:
    """The ids in the order vLLM returns their states (ascending layer), and a note when the user's
    order differs: every release captures by a membership test inside the layer loop, so slot i of
    the states (and of the files `extract_hidden_states` writes) is the i-th smallest id."""
    ordered = sorted(ids)
    if ordered == ids:
        return ordered, None
    return ordered, (
        f"--ids {','.join(map(str, ids))} read in vLLM's order {','.join(map(str, ordered))}: vLLM"
        " returns and stores aux states in ascending layer order whatever order its config lists"
        " them; slot i of the states (and of the files' columns) is the i-th smallest id"
    )
