"""The check of one forward in a process group of its own, for the in-process TP harnesses
(verify_v32.py, minimax_m3_states.py beside it), which build a model without an engine.

Each rank makes the record the engine's forward hook makes (checks.record); the harness then hands
every rank all ranks' records (torch.distributed's all_gather_object over vLLM's CPU group of the
test, standing in for the report directory the command reads) and judges them as the command does
(checks.judge_step). The package itself exchanges nothing between ranks.
"""

from __future__ import annotations

from typing import Any


def check_in_group(
    aux: Any,
    hidden: Any,
    ids: list[int],
    hidden_size: int,
    group: Any,
    taps: Any = None,
    final_id: int | None = None,
    max_tokens: int = 4096,
) -> Any:
    import torch.distributed as dist

    from vllm_hotfix.check.checks import judge_step, record

    mine = record(aux, hidden, ids, hidden_size, max_tokens, taps)
    records: list[Any] = [None] * group.world_size
    dist.all_gather_object(records, mine, group=group.cpu_group)
    return judge_step(records, ids, group.rank_in_group, final_id)
