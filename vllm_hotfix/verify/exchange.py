"""The one exchange per checked step between the ranks of a tensor-parallel group, never a stall.

Every rank calls `exchange` once per checked step, also a rank whose check raised (it sends no
body, only why), so no rank waits in a collective its peers skipped. What it rests on, measured
with gloo at TP=2 (torch 2.11, tests/test_verify_exchange.py):

- the step's exchange is one all-gather of a float32 payload (header: protocol, error flag, entry
  time, a short error text; then the body) sized by the step (its checked tokens, the same on every
  rank of a TP group, which runs one batch), in buffers kept for the window and grown when a step
  needs more, over vLLM's CPU group (`cpu_group`, gloo),
  waited on with a deadline (`Work.wait(timeout)`), never over the device group (pynccl on CUDA
  has no timeout);
- a gloo all-gather that timed out stays pending and completes when the late rank joins it; the
  group is then usable again. So the timed-out rank keeps the pending work (and its buffers)
  alive, and every rank that completes an exchange ends the window when the ranks joined it more
  than half a deadline apart: the late rank then stops with the one that gave up, and neither
  issues a collective the other will not join;
- a gloo all-gather that a peer never joins leaves the group dead (the next all-reduce on it
  times out on both ranks). So the first-step handshake (protocol and the facts
  every rank must share: ids, hidden size, window length) goes through the group's rendezvous
  store (set + wait with the deadline), which consumes no collective: a rank that is not armed
  (the check off, or no vllm-hotfix there) costs its peers one deadline and leaves the group intact.

A deadline hit, a handshake mismatch or a late rank is the `problem` of the result; after it every
later call returns the same problem without touching the group.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROTOCOL = 2  # 2: the body sized by the step, not the window's capacity
ERROR_BYTES = 240  # the error text each rank can send, UTF-8, cut to this length
_HEADER = 5 + ERROR_BYTES  # protocol, error flag, entry time (two floats), text length, text
_TIME_SPLIT = 65536.0  # entry time = hi * 65536 + lo: float32 keeps ~4 ms of it


@dataclass
class Exchanged:
    """What came back: every rank's body (NaN rows where a rank sent none), every rank's error
    (None where it had none), and a problem that makes the bodies unusable (None when they are)."""

    bodies: Any  # CPU float32 [world, size]
    errors: list[str | None]
    problem: str | None = None


@dataclass
class _Session:
    """One window of exchanges over one group: its handshake's facts and preallocated buffers."""

    hello: dict[str, Any]
    send: Any = None
    received: Any = None
    problem: str | None = None
    handshaken: bool = False


_sessions: dict[int, _Session] = {}  # id(cpu_group): its current window
_pending: list[tuple[Any, Any, Any]] = []  # timed-out works with their buffers: they complete later
_handshakes = 0  # per process: store keys of one handshake never meet another's


def exchange(
    body: Any,
    size: int,
    error: str | None,
    group: Any,
    deadline_s: float,
    hello: Mapping[str, Any] | None = None,
) -> Exchanged:
    """This step's exchange. `body`: 1-D float32 of `size` elements (any device), None when this
    rank could not build it (`error` says why); `group`: vLLM's GroupCoordinator (None: alone);
    `size` is the step's and must be the same on every rank; `hello`: what every rank must share
    (ids, hidden size, window length), checked at the first call of a window: a call with another
    hello starts a new window."""
    import torch

    body, error = _own_body(body, size, error)
    world = 1 if group is None else int(group.world_size)
    if world == 1:
        row = torch.full((1, size), float("nan")) if body is None else body.detach().float().cpu()[None]
        return Exchanged(row, [error])
    rank = int(group.rank_in_group)
    cpu_group = group.cpu_group
    facts = {"protocol": PROTOCOL, **dict(hello or {})}
    session = _sessions.get(id(cpu_group))
    if session is None or session.hello != facts:
        session = _sessions[id(cpu_group)] = _Session(facts)
    nan = torch.full((world, size), float("nan"))
    if session.problem is not None:
        return Exchanged(nan, [None] * world, session.problem)
    if not session.handshaken:
        errors, problem = _handshake(cpu_group, rank, world, facts, error, deadline_s)
        if problem is not None or any(errors):
            # every rank read the same hellos: all skip the all-gather, none waits in it
            failed = [r for r, e in enumerate(errors) if e]
            session.problem = problem or f"not run: rank(s) {failed} could not start the check"
            return Exchanged(nan, errors, session.problem)
        session.handshaken = True
    if session.send is None or session.send.numel() < _HEADER + size:  # grown, never per step
        session.send = torch.empty(_HEADER + size, dtype=torch.float32)
        session.received = torch.empty(world * (_HEADER + size), dtype=torch.float32)
    send, received = session.send[: _HEADER + size], session.received[: world * (_HEADER + size)]
    _fill(send, body, error)
    started = time.monotonic()
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    work = gather(received, send, group=cpu_group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=deadline_s))
    except Exception as failure:  # the deadline (gloo: "Operation timed out!") or the group's own error
        _pending.append((work, session.send, session.received))
        session.send = session.received = None  # kept alive in _pending: gloo may still write them
        waited = time.monotonic() - started
        session.problem = (
            f"the exchange over the TP group's CPU group did not complete within {deadline_s:g} s"
            f" (waited {waited:.1f} s: a rank stalled or is not checking; {type(failure).__name__}:"
            f" {str(failure)[:120]})"
        )
        return Exchanged(nan, [None] * world, session.problem)
    rows = received.view(world, _HEADER + size)
    errors = [_text(row) if row[1] > 0 else None for row in rows]
    problem = _late(rows, deadline_s) or _protocol(rows)
    if problem is not None:
        session.problem = problem
        return Exchanged(nan, errors, problem)
    return Exchanged(rows[:, _HEADER:].clone(), errors)


def _own_body(body: Any, size: int, error: str | None) -> tuple[Any, str | None]:
    """A body of the wrong shape is this rank's error, sent as such, never a collective of a
    different size."""
    if body is None:
        return None, error or "no body (no reason given)"
    if body.dim() != 1 or body.numel() != size:
        return None, error or f"exchange: body of shape {tuple(body.shape)}, expected [{size}]"
    return body, error


def _fill(send: Any, body: Any, error: str | None) -> None:
    now = time.time()
    send.fill_(0.0)
    send[0] = PROTOCOL
    send[1] = 0.0 if error is None else 1.0
    send[2], send[3] = now // _TIME_SPLIT, now % _TIME_SPLIT
    if error is not None:
        data = error.encode("utf-8", "replace")[:ERROR_BYTES]
        send[4] = len(data)
        send[5 : 5 + len(data)] = send.new_tensor(list(data))
    if body is None:
        send[_HEADER:] = float("nan")
    else:
        send[_HEADER:].copy_(body.detach().reshape(-1))  # the one device-to-host copy of the step


def _text(row: Any) -> str:
    length = int(row[4])
    return bytes(int(b) for b in row[5 : 5 + length].tolist()).decode("utf-8", "replace")


def _late(rows: Any, deadline_s: float) -> str | None:
    """When the ranks joined more than half a deadline apart, one may have given up: every rank
    sees the same times and ends the window together."""
    times = [float(r[2]) * _TIME_SPLIT + float(r[3]) for r in rows]
    spread = max(times) - min(times)
    if spread <= deadline_s / 2:
        return None
    late, early = times.index(max(times)), times.index(min(times))
    return (
        f"rank {late} joined the exchange {spread:.1f} s after rank {early} (deadline {deadline_s:g} s):"
        " a rank may have given up waiting, so the check stops on every rank"
    )


def _protocol(rows: Any) -> str | None:
    versions = sorted({int(r[0]) for r in rows})
    return None if versions == [PROTOCOL] else f"ranks speak exchange protocols {versions}"


def _handshake(
    cpu_group: Any, rank: int, world: int, facts: dict[str, Any], error: str | None, deadline_s: float
) -> tuple[list[str | None], str | None]:
    """Every rank's hello through the group's rendezvous store: the errors per rank and the problem
    (a peer missing at the deadline, ranks armed differently, ranks far apart in time)."""
    global _handshakes
    import torch

    _handshakes += 1
    errors: list[str | None] = [None] * world
    try:
        store = torch.distributed.distributed_c10d._get_process_group_store(cpu_group)
    except Exception as failure:
        return (
            errors,
            f"the TP group's rendezvous store is not reachable ({type(failure).__name__}: {failure})",
        )
    prefix = f"vllm-hotfix/verify/v{PROTOCOL}/handshake{_handshakes}"
    own = {"facts": facts, "error": error, "time": time.time()}
    keys = [f"{prefix}/rank{r}" for r in range(world)]
    try:
        store.set(keys[rank], json.dumps(own))
        store.wait(keys, datetime.timedelta(seconds=deadline_s))
        hellos = [json.loads(store.get(key)) for key in keys]
    except Exception as failure:
        missing = []
        for r, key in enumerate(keys):
            try:
                if not store.check([key]):
                    missing.append(r)
            except Exception:
                missing.append(r)
        return errors, (
            f"rank(s) {missing or '?'} did not join the check's handshake within {deadline_s:g} s"
            f" (the check off there, or vllm-hotfix missing; {type(failure).__name__})"
        )
    errors = [h.get("error") for h in hellos]
    differ = [r for r, h in enumerate(hellos) if h.get("facts") != hellos[0].get("facts")]
    if differ and not any(errors):
        described = "; ".join(
            f"rank {r}: {json.dumps(h.get('facts'), sort_keys=True)}" for r, h in enumerate(hellos)
        )
        return errors, f"ranks armed differently ({described})"
    times = [float(h.get("time", 0.0)) for h in hellos]
    if max(times) - min(times) > deadline_s / 2:
        late = times.index(max(times))
        return errors, (
            f"rank {late} joined the check's handshake {max(times) - min(times):.1f} s after the first"
            f" (deadline {deadline_s:g} s): a rank may have given up waiting, so the check stops on"
            " every rank"
        )
    return errors, None


def reset() -> None:
    """Forget every window (tests: a fresh window over the same group)."""
    _sessions.clear()
