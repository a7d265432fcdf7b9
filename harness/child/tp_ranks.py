"""Run one harness worker per tensor-parallel rank, as vLLM does: spawned processes that meet at a
free local TCP port (gloo). Shared by the harness scripts that build a model at TP=1 and TP=2
(v32_states, minimax_m3_states, verify_v32); imported by path, with no torch at import."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable

ATTEMPTS = 3


def run_ranks(worker: Callable[[int, int, int, argparse.Namespace], None], args: argparse.Namespace) -> None:
    """`worker(rank, world, port, args)` for every rank of `args.world`, in this process at TP=1;
    `args.out` is created first (each rank writes its file there). The free port is found by binding
    port 0 and closing it, so another process can take it before rank 0's TCP store binds it (CI lost
    a run to that, EADDRINUSE, 2026-12-03): then all ranks start again on a new port, up to ATTEMPTS
    times. Any other error is raised at once."""
    import torch.multiprocessing as mp

    os.makedirs(args.out, exist_ok=True)
    for attempt in range(ATTEMPTS):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            if args.world == 1:
                worker(0, 1, port, args)
            else:
                mp.start_processes(
                    worker, args=(args.world, port, args), nprocs=args.world, start_method="spawn"
                )
            return
        except Exception as error:
            if "EADDRINUSE" not in str(error) or attempt == ATTEMPTS - 1:
                raise
            print(f"tp_ranks: port {port} was taken before rank 0 bound it; again on a new port", flush=True)
