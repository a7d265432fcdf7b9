"""The harness's TP ranks meet at a port found free by binding port 0 and closing it; another process
can take it before rank 0's TCP store binds it (CI lost a run of tests/test_v32_states.py to that,
EADDRINUSE, 2026-12-03). harness/child/tp_ranks.py then starts the ranks again on a new port; any
other error is raised at once."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from harness.child import tp_ranks

TAKEN = (
    "The server socket has failed to listen on any local network address. port: 37339, useIpv6: false,"
    " code: -98, name: EADDRINUSE, message: address already in use"
)


def test_a_port_taken_before_rank_0_binds_it_is_tried_again(tmp_path: Path) -> None:
    ports = []

    def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
        ports.append(port)
        if len(ports) == 1:
            raise RuntimeError(TAKEN)  # what torch's TCPStore raised in CI

    tp_ranks.run_ranks(worker, argparse.Namespace(world=1, out=str(tmp_path / "out")))
    assert len(ports) == 2


def test_other_errors_and_a_port_taken_every_time_are_raised(tmp_path: Path) -> None:
    calls = []

    def broken(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
        calls.append(port)
        raise ValueError("not a port")

    with pytest.raises(ValueError):
        tp_ranks.run_ranks(broken, argparse.Namespace(world=1, out=str(tmp_path / "a")))
    assert len(calls) == 1

    def taken(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
        calls.append(port)
        raise RuntimeError(TAKEN)

    with pytest.raises(RuntimeError, match="EADDRINUSE"):
        tp_ranks.run_ranks(taken, argparse.Namespace(world=1, out=str(tmp_path / "b")))
    assert len(calls) == 1 + tp_ranks.ATTEMPTS
