"""The in-worker check's log lines (`vllm-hotfix verify pid=... rank=R/W ... verdict=V`) read back
from an engine's log: by the tests and by the GPU check scripts."""

from __future__ import annotations

import re
from typing import Any

LINE = re.compile(r"vllm-hotfix verify pid=(\d+) rank=(\d+)/(\d+) .*? verdict=(PASS|FAIL|UNKNOWN|SKIPPED)")


def verify_lines(log: str) -> list[dict[str, Any]]:
    """One entry per verdict line, in log order (several processes may share a log)."""
    found = []
    for text in log.splitlines():
        match = LINE.search(text)
        if match:
            pid, rank, world, verdict = match.groups()
            line = text[match.start() :]
            found.append(
                {"pid": int(pid), "rank": int(rank), "world": int(world), "verdict": verdict, "line": line}
            )
    return found


def verdict_of(log: str, world: int = 1) -> str:
    """PASS when every rank of `world` logged PASS; FAIL when any logged FAIL; else what is missing."""
    lines = verify_lines(log)
    verdicts = {entry["verdict"] for entry in lines}
    if "FAIL" in verdicts:
        return "FAIL"
    ranks = {entry["rank"] for entry in lines if entry["verdict"] == "PASS" and entry["world"] == world}
    if ranks == set(range(world)):
        return "PASS"
    return f"no verdict from every rank ({sorted(verdicts) or 'no line'})"
