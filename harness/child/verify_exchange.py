"""The in-worker check's exchange (vllm_hotfix/verify/exchange.py, through checks.check_step) at TP=2
over vLLM's own TP group (gloo, `init_distributed_environment` + `initialize_model_parallel`), with
a fault planted on rank 1 in each scenario (after a clean step and a window whose steps differ in
size): an exception at each stage of a step, a stall past the
deadline (at the handshake and at a later step), ranks armed with other ids, a rank not armed at
all. After each scenario both ranks run vLLM's own collectives on the group (its device group's
all-reduce and its CPU group's) with a deadline: the check must leave them usable. The last
scenario is the contrast that shows why the handshake is no collective: a gloo all-gather that a
peer never joins, after which the same all-reduce times out.

Each rank saves {scenario: what its check_step returned, and whether the group was usable} to
OUT/rank<N>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import time
from typing import Any

DEADLINE_S = 2.0
STALL_S = 8.0  # well past the deadline, so that no load on the machine makes the stall look on time
IDS = [1, 2, 4]
HIDDEN = 16
TOKENS = 5
MAX_TOKENS = 7


def _usable(group: Any) -> bool:
    """vLLM's own collectives on the group complete: an all-reduce on its device group (gloo here)
    and one on its CPU group, each waited on with a deadline."""
    import torch

    for backend_group in (group.device_group, group.cpu_group):
        value = torch.ones(1)
        work = torch.distributed.all_reduce(value, group=backend_group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=10))
        except Exception:
            return False
        if float(value) != group.world_size:
            return False
    return True


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ["VLLM_DIST_IDENT"] = f"verify-exchange-{port}"
    import torch
    from tp_model import tp_groups  # this script's directory is on sys.path
    from vllm.distributed.parallel_state import get_tp_group

    from vllm_hotfix.verify import checks, exchange

    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(TOKENS + 1, HIDDEN, generator=generator) for _ in IDS]
    weight = 1.0 + 0.1 * torch.randn(HIDDEN, generator=generator)

    def norm(x: Any) -> Any:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    hidden = norm(states[-1])
    results: dict[str, Any] = {}

    def step(
        window: int,
        ids: list[int] = IDS,
        final_norm: Any = norm,
        error: str | None = None,
        tokens: int = TOKENS,
    ) -> Any:
        group = get_tp_group()
        return checks.check_step(
            states if error is None else None,
            hidden,
            ids,
            tokens,
            HIDDEN,
            group,
            len(ids) - 1,
            final_norm,
            max_tokens=MAX_TOKENS,
            window=window,
            deadline_s=DEADLINE_S,
            error=error,
        )

    def record(name: str, check: Any) -> None:
        entry = dataclasses.asdict(check)
        entry.update(ok=check.ok, complete=check.complete, failed=check.failed)
        entry["usable"] = _usable(get_tp_group())
        results[name] = entry

    def planted(stage: str) -> Any:
        def raising(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"planted at {stage}")

        return raising

    with tp_groups(world, rank, port):
        group = get_tp_group()
        window = 0

        def fresh() -> int:
            nonlocal window
            torch.distributed.barrier(group=group.cpu_group)
            window += 1  # another window: another handshake
            return window

        record("clean", step(fresh()))
        # one window whose steps carry 1, 5, then 1 tokens: each all-gather sized by its step
        number = fresh()
        name = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else None
        name = name or "all_gather_into_tensor"
        gather, sizes = getattr(torch.distributed, name), []

        def counted(output: Any, sent: Any, *args: Any, **kwargs: Any) -> Any:
            sizes.append(int(sent.numel()))
            return gather(output, sent, *args, **kwargs)

        setattr(torch.distributed, name, counted)
        try:
            steps = [step(number, tokens=tokens) for tokens in (1, TOKENS, 1)]
        finally:
            setattr(torch.distributed, name, gather)
        record("sized-by-step", steps[-1])
        results["sized-by-step"].update(sent=sizes, every_ok=[check.ok for check in steps])
        # an exception on rank 1 at each stage of a step inside check_step (its function replaced),
        # after a good first step: the error goes through the all-gather (its error flag and text)
        plants = (("shapes", "shapes"), ("projection", "projection"), ("float32", "fingerprints"))
        for stage, name in (*plants, ("payload", "payload")):
            number = fresh()
            first = step(number)
            original = getattr(checks, name)
            if rank == 1:
                setattr(checks, name, planted(stage))
            try:
                record(f"raise-{stage}", step(number))
            finally:
                setattr(checks, name, original)
            results[f"raise-{stage}"]["first_ok"] = first.ok
        # at the first step of a window: the error goes through the handshake
        number = fresh()
        original = checks.projection
        if rank == 1:
            checks.projection = planted("projection")
        try:
            record("raise-first-projection", step(number))
        finally:
            checks.projection = original
        # before check_step: the step record (token count) and the _Step itself (seam.py)
        number = fresh()
        first = step(number)
        record("raise-record", step(number, error="record: ValueError: planted" if rank == 1 else None))
        results["raise-record"]["first_ok"] = first.ok
        number = fresh()
        if rank == 1:  # what seam._joined_only sends when _Step could not be built
            check = checks.check_step(
                None,
                None,
                [],
                0,
                0,
                group,
                window=number,
                deadline_s=DEADLINE_S,
                error="step: KeyError: planted",
            )
        else:
            check = step(number)
        record("raise-step", check)
        # the final norm raising on rank 1: the final id is n/a there, the step completes
        number = fresh()
        record("raise-final-norm", step(number, final_norm=planted("final-norm") if rank == 1 else norm))
        # a stall on rank 1 past the deadline: at the handshake, then at a later step
        number = fresh()
        if rank == 1:
            time.sleep(STALL_S)
        record("stall-handshake", step(number))
        number = fresh()
        first = step(number)
        if rank == 1:
            time.sleep(STALL_S)
        record("stall-step", step(number))
        results["stall-step"]["first_ok"] = first.ok
        # ranks armed differently: other ids on rank 1
        number = fresh()
        record("other-ids", step(number, ids=[1, 4] if rank == 1 else IDS))
        # rank 1 not armed at all: it never calls the exchange
        number = fresh()
        if rank == 1:
            time.sleep(DEADLINE_S * 2)
            results["not-armed"] = {"usable": _usable(group)}
        else:
            record("not-armed", step(number))
        # the contrast: a collective that rank 1 never joins leaves the group unusable
        torch.distributed.barrier(group=group.cpu_group)
        if rank == 0:
            out = torch.empty(2 * 4)
            work = torch.distributed.all_gather_into_tensor(
                out, torch.ones(4), group=group.cpu_group, async_op=True
            )
            try:
                work.wait(timeout=datetime.timedelta(seconds=DEADLINE_S))
            except Exception:
                pass
            exchange._pending.append((work, out, None))
        results["contrast-collective-never-joined"] = {"usable": _usable(group)}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w", encoding="utf-8") as out_file:
        json.dump(results, out_file, indent=2)
    os._exit(0)  # the contrast left a collective pending: do not wait for gloo at exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from tp_ranks import run_ranks

    run_ranks(worker, args)


if __name__ == "__main__":
    main()
