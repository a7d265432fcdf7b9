"""The audit's input side and command without an engine: safetensors' reader on malformed files,
the files that cannot be audited named before the engine starts (and never costing another file its
judgement), links counted once, the report directory kept out of DATA, exit 3 with a document for
the command's own failures, the ids in vLLM's order, the sample and its bound, --max-tokens, shards
and their merge. Files and states are made here (safetensors, torch)."""

from __future__ import annotations

import argparse
import json
import math
import struct
import types
from pathlib import Path
from typing import Any

import pytest

from vllm_hotfix.audit import bound, compare, files, merge, selection, verdict
from vllm_hotfix.commands import audit as audit_command
from vllm_hotfix.commands import cli, session
from vllm_hotfix.judging import precision

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors.torch")

IDS = [1, 2, 4]
HIDDEN = 16


def write(
    path: Path, tokens: int = 6, ids: int = 3, hidden: int = HIDDEN, rows: int | None = None, **kw: Any
) -> Path:
    states = torch.randn(tokens if rows is None else rows, ids, hidden).to(kw.get("dtype", torch.float32))
    token_ids = torch.arange(tokens, dtype=torch.int64) + kw.get("first", 0)
    safetensors.save_file({"hidden_states": states, "token_ids": token_ids}, str(path))
    return path


def raw(path: Path, header: dict[str, Any], body: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return path


@pytest.fixture(autouse=True)
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here starts vLLM: where one would, it fails instead."""

    def refused(self: object) -> int:
        pytest.fail("the audit would start an engine here")

    monkeypatch.setattr(session.Session, "__enter__", refused)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A checkpoint directory as far as the audit reads it before vLLM: its config.json."""
    directory = tmp_path / "model"
    directory.mkdir()
    config = {"hidden_size": HIDDEN, "vocab_size": 1000, "num_hidden_layers": 4}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def args(data: Path, model: Path, *more: str) -> argparse.Namespace:
    return cli.parse(["audit", str(data), str(model), "--ids", ",".join(map(str, IDS)), *more])


# -- reading the files -------------------------------------------------------------------------
def test_every_malformed_header_is_na_with_the_readers_reason(tmp_path: Path) -> None:
    tokens = {"dtype": "I64", "shape": [1], "data_offsets": [4, 12]}
    raw(tmp_path / "string.safetensors", {"hidden_states": "abc", "token_ids": tokens}, bytes(12))
    one = {"dtype": "F32", "shape": [1, 1, 1], "data_offsets": [0]}
    raw(tmp_path / "one-offset.safetensors", {"hidden_states": one, "token_ids": tokens}, bytes(12))
    short = {"dtype": "F32", "shape": [1, 1, 2], "data_offsets": [0, 4]}
    raw(tmp_path / "offsets.safetensors", {"hidden_states": short, "token_ids": tokens}, bytes(12))
    odd = {"dtype": "Q9", "shape": [1, 1, 1], "data_offsets": [0, 4]}
    raw(tmp_path / "unknown-dtype.safetensors", {"hidden_states": odd, "token_ids": tokens}, bytes(12))
    write(tmp_path / "int8.safetensors", dtype=torch.int8)
    good = write(tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "padded.safetensors").write_bytes(good + b"xx")
    said = {p.name: files.read_header(p).na for p in (path for _, path in files.listing(tmp_path).files)}
    assert said.pop("good.safetensors") is None
    assert said.pop("int8.safetensors") == (
        "hidden_states stored as I8: not a precision the audit reads (F64, F32, F16, BF16, F8_E4M3, F8_E5M2)"
    )
    expected = {
        "string.safetensors": 'invalid type: string "abc"',
        "one-offset.safetensors": "invalid length 1",
        "offsets.safetensors": "invalid shape, data type, or offset",
        "unknown-dtype.safetensors": "unknown variant `Q9`",
        "padded.safetensors": "file not fully covered",
    }
    for name, part in expected.items():
        assert said[name].startswith("unreadable header: SafetensorError: ") and part in said[name], said[
            name
        ]


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (torch.float32, "F32"),
        (torch.bfloat16, "BF16"),
        (torch.float16, "F16"),
        (torch.float8_e4m3fn, "F8_E4M3"),
        (torch.float8_e5m2, "F8_E5M2"),
    ],
)
def test_each_stored_precision_is_read_and_its_dtype_carried(tmp_path: Path, dtype: Any, name: str) -> None:
    found = files.read_header(write(tmp_path / "a.safetensors", dtype=dtype))
    assert (found.na, found.wrong, found.dtype, found.tokens, found.rows) == (None, None, name, 6, 6)
    assert files.token_ids(found) == list(range(6))


def test_fewer_state_rows_than_tokens_is_wrong_with_the_likely_cause(tmp_path: Path) -> None:
    found = files.read_header(write(tmp_path / "a.safetensors", tokens=40, rows=8))
    assert found.na is None and found.wrong is not None
    assert (
        found.wrong.startswith("8 state rows for 40 tokens: rows are missing")
        and "vLLM #44485" in found.wrong
        and "hidden-states-unfinished-prefill" in found.wrong  # 0.24-0.34: an aborted prefill's file
    )
    more = files.read_header(write(tmp_path / "b.safetensors", tokens=4, rows=6))
    assert more.wrong is None and more.na == "6 state rows for 4 tokens: more rows than tokens"


def test_a_link_to_a_listed_file_counts_once(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    write(data / "a.safetensors")
    write(data / "b.safetensors", first=10)
    (data / "sub" / "link-to-a.safetensors").symlink_to(data / "a.safetensors")
    (data / "sub" / "link-to-link.safetensors").symlink_to(data / "sub" / "link-to-a.safetensors")
    outside = write(tmp_path / "outside.safetensors", first=20)
    (data / "c.safetensors").symlink_to(outside)  # a link to a file not listed otherwise: kept
    found = files.listing(data)
    assert [name for name, _ in found.files] == ["a.safetensors", "b.safetensors", "c.safetensors"]
    assert found.links == 2


# -- choosing the files: sample, shards ---------------------------------------------------------
NAMES = [f"shard-{i // 100:02d}/hs_{i}.safetensors" for i in range(1000)]


def test_the_sample_depends_on_the_names_and_seed_alone() -> None:
    picked = files.choose(NAMES, 30, seed=7)
    assert len(picked) == 30 and picked == [n for n in NAMES if n in picked]  # the dataset's order
    assert files.choose(list(reversed(NAMES)), 30, seed=7) == list(reversed(picked))
    # adding files keeps every chosen one that still ranks among the smallest hashes
    assert set(files.choose([*NAMES, "new.safetensors"], 30, seed=7)) - {"new.safetensors"} <= set(picked)
    assert files.choose(NAMES, 30, seed=8) != picked
    # sha256 of the path: the same on any machine and Python (hash() would vary per process)
    assert files.choose(["a", "b", "c", "d"], 2, seed=0) == ["c", "d"]
    assert files.choose(NAMES, 4, seed=0) == [
        "shard-03/hs_316.safetensors",
        "shard-03/hs_354.safetensors",
        "shard-03/hs_370.safetensors",
        "shard-08/hs_858.safetensors",
    ]
    assert [files.shard(name, 4) for name in ("a", "b", "c", "d")] == [2, 2, 2, 1]


def test_shards_partition_the_sample_exactly() -> None:
    picked = files.choose(NAMES, 300, seed=0)
    parts = [[n for n in picked if files.shard(n, 4) == rank] for rank in range(4)]
    assert sorted(n for part in parts for n in part) == sorted(picked)
    assert all(40 < len(part) < 110 for part in parts), [len(p) for p in parts]


# -- the bound ----------------------------------------------------------------------------------
# scipy.stats.beta.ppf(0.95, k + 1, n - k), scipy 1.17.1 (the test env has no scipy)
SCIPY = {
    (0, 300): 0.009936081944457708,
    (1, 300): 0.01571455489158395,
    (5, 300): 0.03472224430129498,
    (1, 2): 0.9746794344808963,
    (3, 10): 0.6066242161054123,
    (100, 50000): 0.002361158343857336,
}


def test_the_bound_is_the_exact_clopper_pearson_one() -> None:
    assert bound.upper_bound(0, 300) == pytest.approx(1 - 0.05 ** (1 / 300), rel=1e-12)
    assert f"{bound.upper_bound(0, 300):.2%}" == "0.99%"
    for (k, n), expected in SCIPY.items():
        assert bound.upper_bound(k, n) == pytest.approx(expected, rel=1e-9), (k, n)
    assert bound.upper_bound(7, 7) == 1.0
    with pytest.raises(ValueError):
        bound.upper_bound(3, 2)
    try:
        from scipy.stats import beta
    except ImportError:
        return
    for k, n in [(0, 1), (2, 50), (10, 1000), (50, 400)]:
        assert bound.upper_bound(k, n) == pytest.approx(float(beta.ppf(0.95, k + 1, n - k)), rel=1e-9)


def test_the_binomial_cdf_sums_to_its_definition() -> None:
    for k, n, p in [(0, 10, 0.1), (3, 10, 0.25), (9, 10, 0.9)]:
        direct = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
        assert bound.binomial_cdf(k, n, p) == pytest.approx(direct, rel=1e-12)


def test_a_row_marked_as_the_runs_own_fault_is_exit_3() -> None:
    rows = [{"file": "a", "status": "ok"}, {"file": "b", "status": "n/a", "error": True, "why": "not finite"}]
    assert verdict.verdict({"ok": 1, "wrong": 0, "n/a": 1}, rows, "PASS") == (
        "UNKNOWN",
        3,
        "not finite (b); 1 ok, 0 wrong, 1 n/a of 2 files audited",
    )
    assert verdict.verdict({"ok": 1, "wrong": 0, "n/a": 0}, rows[:1], "PASS")[:2] == ("PASS", 0)


def test_the_estimate_says_the_bound_or_the_exact_count() -> None:
    found = verdict.estimate({"ok": 299, "wrong": 0, "n/a": 1}, 50_000, 300, seed=0)
    assert (found["judged"], found["wrong"], found["n/a"], found["sampled"]) == (299, 0, 1, True)
    assert found["wrong_fraction_at_most"] == pytest.approx(1 - 0.05 ** (1 / 299))
    line = verdict.estimate_line(found)
    assert "0 wrong of 299 judged (1 n/a, outside the estimate) of 300 chosen at random" in line
    assert line.endswith("at 95% confidence at most 1.00% of the files in DATA are wrong")
    every = verdict.estimate({"ok": 1, "wrong": 1, "n/a": 0}, 2, None, seed=0)
    assert every["wrong_fraction_at_most"] is None and not every["sampled"]
    assert verdict.estimate_line(every) == "every file: 1 wrong of 2 judged, of 2 files in DATA"


# -- the command before the engine ----------------------------------------------------------------
def dataset(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        write(data / f"ok-{i}.safetensors", tokens=6 + i, first=10 * i)
    write(data / "short.safetensors", tokens=40, rows=8, first=100)
    write(data / "two-ids.safetensors", ids=2, first=200)
    write(data / "wide.safetensors", hidden=HIDDEN * 2, first=300)
    raw(data / "string.safetensors", {"hidden_states": "abc"}, b"")
    (data / "link.safetensors").symlink_to(data / "ok-0.safetensors")
    return data


def test_each_file_that_cannot_be_audited_is_named_before_the_engine(tmp_path: Path, model: Path) -> None:
    chosen = selection.choose(args(dataset(tmp_path), model, "--all"))
    assert sorted(f.path.name for f in chosen.audited) == [f"ok-{i}.safetensors" for i in range(4)]
    assert [f.path.name for f in chosen.wrong] == ["short.safetensors"]
    na = {f.path.name: f.na for f in chosen.na}
    assert na == {
        "string.safetensors": na["string.safetensors"],
        "two-ids.safetensors": "holds 2 ids per token, not the 3 of --ids [1, 2, 4]",
        "wide.safetensors": f"hidden size {2 * HIDDEN}, not the model's {HIDDEN}",
    }
    assert na["string.safetensors"].startswith("unreadable header")
    assert (chosen.total, chosen.links) == (8, 1)  # the link to ok-0 counted once


class _Session:
    """An engine session as the audit's files see it, without vLLM: `llm` set by the test."""

    def __init__(self, vocab: int = 1000, max_len: int = 256) -> None:
        self.llm: Any = None
        self.vocab, self.max_len, self.phase = vocab, max_len, ""

    def records(self) -> Any:
        return types.SimpleNamespace(consume=lambda: None)


def _audit(chosen: selection.Chosen, tmp_path: Path, **more: Any) -> tuple[audit_command.Audit, _Session]:
    """The audit of `chosen` and its engine's session as they are before the engine (no vLLM)."""
    namespace = argparse.Namespace(model="m", json=True, engine_args=[], **more)
    audit = audit_command.Audit(namespace, chosen)
    audit.begin(str(tmp_path / "reports" / "run"))
    return audit, _Session()


def test_each_file_is_read_once_and_keyed_on_its_first_k_tokens(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The headers before the engine; each file's tokens once, when its batch is prompted: the
    prompt and the worker's key are its first --max-tokens; a token id beyond the vocabulary
    makes that file alone n/a."""
    data = dataset(tmp_path)
    write(data / "beyond.safetensors", tokens=6, first=995)
    reads: list[str] = []
    token_ids = files.token_ids
    monkeypatch.setattr(files, "token_ids", lambda found: reads.append(found.path.name) or token_ids(found))
    chosen = selection.choose(args(data, model, "--all", "--max-tokens", "7"))
    assert reads == []
    audit, _ = _audit(chosen, tmp_path)
    prompts, entries = audit._prompts(list(range(len(chosen.audited))), vocab=1000)
    assert sorted(reads) == sorted(f.path.name for f in chosen.audited)  # once each
    kept = [f for f in chosen.audited if f.path.name != "beyond.safetensors"]
    for found, prompt, entry in zip(kept, prompts, entries, strict=True):
        assert prompt["prompt_token_ids"] == token_ids(found)[:7] and entry["rows"] == min(found.tokens, 7)
        assert entry["tokens_key"] == files.tokens_key(token_ids(found)[:7])
    (row,) = audit.results.rows
    assert row["file"].endswith("beyond.safetensors") and row["status"] == "n/a"
    assert row["why"] == "token ids [1000] beyond the vocabulary (1000)"


def test_ids_in_another_order_are_read_in_vllms(tmp_path: Path, model: Path) -> None:
    chosen = selection.choose(cli.parse(["audit", str(dataset(tmp_path)), str(model), "--ids", "4,1,2"]))
    assert chosen.ids == [1, 2, 4] and chosen.ids_given == [4, 1, 2]
    assert chosen.ids_note is not None and "read in vLLM's order 1,2,4" in chosen.ids_note
    # what reading the files in the typed order would do to a right file: call it wrong
    references = {i: torch.randn(5, HIDDEN) for i in range(5)}
    right = torch.stack([references[i] for i in sorted(IDS)], dim=1)
    rule = precision.rule(torch.float32, torch.float32, 5, False)
    assert {e["status"] for e in compare.judge_file(right, chosen.ids, references, rule)} == {"ok"}
    assert "wrong" in {e["status"] for e in compare.judge_file(right, chosen.ids_given, references, rule)}


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as done:
        code = int(done.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_report_dir_inside_data_is_refused(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = dataset(tmp_path)
    for inside in (data, data / "reports", data / "ok-0.safetensors" / ".." / "x"):
        argv = ["audit", str(data), str(model), "--ids", "1,2,4", "--report-dir", str(inside), "--json"]
        code, out, err = _main(argv, capsys)
        assert code == 4 and "is inside DATA" in err and json.loads(out)["exit_code"] == 4, err
    assert not (data / "reports").exists()


def test_a_rank_outside_the_world_and_repeated_ids_are_usage_errors(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = dataset(tmp_path)
    code, _, err = _main(
        ["audit", str(data), str(model), "--ids", "1,2,4", "--world-size", "2", "--rank", "2"], capsys
    )
    assert code == 4 and "--rank 2: must be 0 to 1" in err
    code, _, err = _main(["audit", str(data), str(model), "--ids", "1,2,2"], capsys)
    assert code == 4 and "[2]" in err and "Traceback" not in err


def test_the_commands_own_failure_is_exit_3_with_a_document(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = dataset(tmp_path)

    def broken(root: Path) -> Any:
        raise RuntimeError("planted")

    monkeypatch.setattr(files, "listing", broken)
    code, out, err = _main(["audit", str(data), str(model), "--ids", "1,2,4", "--json"], capsys)
    assert code == 3 and "Traceback" not in err
    document = json.loads(out)
    assert (document["exit_code"], document["verdict"]) == (3, "UNKNOWN") and "planted" in document["reason"]


def test_without_files_for_the_engine_the_verdict_needs_none(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only a short file and n/a ones: exit 1 at once, each named; a shard with none of the files
    exits 0 with its document (merge.py needs every rank's)."""
    data = tmp_path / "data"
    data.mkdir()
    write(data / "short.safetensors", tokens=40, rows=8)
    raw(data / "string.safetensors", {"hidden_states": "abc"}, b"")
    code, out, _ = _main(["audit", str(data), str(model), "--ids", "1,2,4", "--all", "--json"], capsys)
    document = json.loads(out)
    assert (code, document["exit_code"], document["verdict"], document["check"]) == (1, 1, "FAIL", None)
    rows = {Path(r["file"]).name: r for r in document["files"]}
    assert rows["short.safetensors"]["status"] == "wrong" and "#44485" in rows["short.safetensors"]["why"]
    assert rows["string.safetensors"]["status"] == "n/a"
    code, out, _ = _main(["audit", str(data), str(model), "--ids", "1,2,4", "--all"], capsys)
    assert code == 1 and "wrong " + str(data / "short.safetensors") + ": 8 state rows for 40 tokens" in out


# -- the judgement: one file never costs another its own ------------------------------------------
def _manifest(tmp_path: Path, entries: list[dict[str, Any]]) -> str:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    manifest = {"ids": IDS, "tolerance": None, "out": str(out), "files": entries}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    return str(path)


def test_a_file_that_fails_inside_a_forward_costs_no_other_its_judgement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_hotfix.audit.worker import Auditor

    monkeypatch.setenv("VLLMHOTFIX_VERIFY_TOKENS", "6")
    engine = [0, 1, 2, 3, 4]
    references = {i: torch.randn(12, HIDDEN) for i in engine}
    tokens = {"a": list(range(5)), "b": list(range(100, 107))}
    right = tmp_path / "a.safetensors"
    states = torch.stack([references[i][:5] for i in IDS], dim=1)
    safetensors.save_file({"hidden_states": states, "token_ids": torch.tensor(tokens["a"])}, str(right))
    # b's states have another hidden size than the engine's: its comparison raises
    wide = write(tmp_path / "b.safetensors", tokens=7, hidden=HIDDEN * 2, first=100)
    entries = [
        {"path": str(wide), "tokens_key": files.tokens_key(tokens["b"]), "rows": 7, "dtype": "F32"},
        {"path": str(right), "tokens_key": files.tokens_key(tokens["a"]), "rows": 5, "dtype": "F32"},
    ]
    auditor = Auditor(_manifest(tmp_path, entries), engine)
    positions = torch.tensor([*range(7), *range(5)])  # b then a, in one forward of 12 tokens
    aux = [torch.cat([torch.randn(7, HIDDEN), references[i][:5]]) for i in engine]
    auditor.forward(torch.tensor(tokens["b"] + tokens["a"]), positions, aux)
    b, a = (json.loads((tmp_path / "out" / f"{i}.json").read_text()) for i in (0, 1))
    assert b["status"] == "n/a" and b["why"].startswith("not judged: ")
    assert a["status"] == "ok"
    # the pre-flight compares the forward's first 6 tokens: b's 7th and all of a's 5 are beyond
    assert (b["not_preflighted_tokens"], a["not_preflighted_tokens"]) == (1, 5)


def test_max_tokens_judges_the_first_k_rows_only(tmp_path: Path) -> None:
    """A defect past the K-th token is missed (the docs say so); one before it is found."""
    from vllm_hotfix.audit.worker import Auditor

    engine = [0, 1, 2, 3, 4]
    references = {i: torch.randn(10, HIDDEN) for i in engine}
    tokens = list(range(10))
    for name, row in (("late", 8), ("early", 2)):
        states = torch.stack([references[i] for i in IDS], dim=1)
        states[row] = 0
        path = tmp_path / f"{name}.safetensors"
        safetensors.save_file({"hidden_states": states, "token_ids": torch.tensor(tokens)}, str(path))
        entry = {"path": str(path), "tokens_key": files.tokens_key(tokens[:5]), "rows": 5, "dtype": "F32"}
        (tmp_path / "out").mkdir(exist_ok=True)
        auditor = Auditor(_manifest(tmp_path, [entry]), engine)
        aux = [references[i][:5] for i in engine]
        auditor.forward(torch.tensor(tokens[:5]), torch.arange(5), aux)
        found = json.loads((tmp_path / "out" / "0.json").read_text())
        assert found["status"] == ("ok" if name == "late" else "wrong"), (name, found)
        assert found["per_id"][0]["tokens"] == 5


# -- shards and their merge ---------------------------------------------------------------------
def _judged_run(tmp_path: Path, model: Path, statuses: dict[str, str], *more: str) -> dict[str, Any]:
    """The document of one run (or shard) whose engine-side results say `statuses` per file name."""
    from vllm_hotfix.check.outcome import Outcome

    chosen = selection.choose(args(tmp_path / "data", model, *more))
    out = tmp_path / f"out-{'-'.join(more)}"
    out.mkdir()
    for index, found in enumerate(chosen.audited):
        status = statuses[found.path.name]
        per_id = [{"id": i, "status": status, "max_rel_diff": 0.5 if status == "wrong" else 0.0} for i in IDS]
        (out / f"{index}.json").write_text(
            json.dumps({"file": str(found.path), "status": status, "per_id": per_id})
        )
    namespace = argparse.Namespace(model=str(model), json=True, engine_args=[])
    audit = audit_command.Audit(namespace, chosen)
    audit.out = str(out)
    return audit.document(None, Outcome("PASS", 0, "checked", [], 0), False)


def _data(tmp_path: Path, count: int = 40) -> dict[str, str]:
    data = tmp_path / "data"
    data.mkdir()
    statuses = {}
    for i in range(count):
        write(data / f"hs_{i}.safetensors", tokens=5, first=10 * i)
        statuses[f"hs_{i}.safetensors"] = "wrong" if i in (3, 17) else "ok"
    return statuses


def test_two_shards_merged_give_the_verdict_and_bound_of_one_run(tmp_path: Path, model: Path) -> None:
    statuses = _data(tmp_path)
    one = _judged_run(tmp_path, model, statuses, "--sample", "30", "--seed", "5")
    shards = [
        (
            f"rank{r}.json",
            _judged_run(
                tmp_path,
                model,
                statuses,
                "--sample",
                "30",
                "--seed",
                "5",
                "--world-size",
                "2",
                "--rank",
                str(r),
            ),
        )
        for r in (0, 1)
    ]
    assert 0 < len(shards[0][1]["files"]) < 30
    merged = merge.merge(shards)
    for key in ("verdict", "exit_code", "reason", "estimate"):
        assert merged[key] == one[key], key
    assert sorted(r["file"] for r in merged["files"]) == sorted(r["file"] for r in one["files"])
    # a shard that failed: its reason once, the counts once (the merged ones), not the shard's again
    failed = shards[0][1] | {
        "exit_code": 3,
        "reason": f"vLLM failed; {verdict.summary(shards[0][1]['counts'])}",
    }
    merged = merge.merge([("rank0.json", failed), shards[1]])
    assert merged["exit_code"] == 3 and merged["reason"].count(" audited") == 1, merged["reason"]
    assert merged["reason"] == f"rank 0: vLLM failed; {verdict.summary(merged['counts'])}"


def test_a_merge_refuses_shards_of_other_audits_and_says_a_missing_rank(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    statuses = {name: "ok" for name in _data(tmp_path, 12)}
    paths = []
    for rank in (0, 1):
        document = _judged_run(tmp_path, model, statuses, "--all", "--world-size", "2", "--rank", str(rank))
        paths.append(tmp_path / f"rank{rank}.json")
        paths[-1].write_text(json.dumps(document))
    code, out, _ = _main(["audit-merge", *map(str, paths), "--json"], capsys)
    merged = json.loads(out)
    assert (code, merged["verdict"], merged["counts"]) == (0, "PASS", {"ok": 12, "wrong": 0, "n/a": 0})
    assert [(e["id"], e["ok"], e["wrong"]) for e in merged["per_id"]] == [(i, 12, 0) for i in IDS]
    older = json.loads(paths[1].read_text()) | {"schema": 2}  # a shard of an earlier vllm-hotfix
    (tmp_path / "older.json").write_text(json.dumps(older))
    code, _, err = _main(["audit-merge", str(paths[0]), str(tmp_path / "older.json")], capsys)
    assert code == 4 and "schema 2, not 3: made by another version" in err, err
    code, out, _ = _main(["audit-merge", str(paths[0])], capsys)
    assert code == 2 and "ranks [1] of 2 missing" in out
    code, _, err = _main(["audit-merge", str(paths[0]), str(paths[0])], capsys)
    assert code == 4 and f"REPORT {paths[0]} given twice" in err
    (tmp_path / "copy.json").write_text(paths[0].read_text())
    code, _, err = _main(["audit-merge", str(paths[0]), str(tmp_path / "copy.json")], capsys)
    assert code == 4 and "are both rank 0" in err
    for key, value in (("model", "other"), ("ids", [1, 2, 3])):
        other = json.loads(paths[1].read_text()) | {key: value}
        (tmp_path / "other.json").write_text(json.dumps(other))
        code, _, err = _main(["audit-merge", str(paths[0]), str(tmp_path / "other.json")], capsys)
        assert code == 4 and f"{key} " in err and "not a shard of the same audit" in err, err
    other = json.loads(paths[1].read_text())
    other["dataset"]["listing_sha256"] = "0" * 64  # another dataset (or this one changed)
    (tmp_path / "other.json").write_text(json.dumps(other))
    code, _, err = _main(["audit-merge", str(paths[0]), str(tmp_path / "other.json")], capsys)
    assert code == 4 and "dataset" in err


def test_a_file_that_breaks_after_it_was_chosen_costs_no_other_its_prompt(
    tmp_path: Path, model: Path
) -> None:
    chosen = selection.choose(args(dataset(tmp_path), model, "--all"))
    audit, run = _audit(chosen, tmp_path)
    broken = chosen.audited[1].path
    broken.write_bytes(b"")  # after its header was read

    class Engine:
        def __init__(self) -> None:
            self.prompts: list[Any] = []

        def generate(self, prompts: list[Any], params: Any, use_tqdm: bool) -> None:
            self.prompts += prompts

    run.llm = engine = Engine()
    audit.run_files(run, lambda **kw: kw)  # type: ignore[arg-type]
    assert len(engine.prompts) == len(chosen.audited) - 1
    rows = {r["file"]: r for r in audit.judgement(None)[1]}
    assert rows[str(broken)]["status"] == "n/a" and rows[str(broken)]["why"].startswith(
        "unreadable token ids"
    )


def test_each_generate_call_fits_the_tokens_the_preflight_compares() -> None:
    """No forward can then hold a judged token past the check's first ones, except a file longer
    than them, alone in its call."""
    found = [
        files.DataFile(Path(f"{i}"), tokens=n) for i, n in enumerate([3000, 1000, 96, 1, 5000, 10, 4096])
    ]
    calls = list(audit_command.batches(found, lambda f: f.tokens, 4096))
    assert [[f.tokens for f in call] for call in calls] == [[3000, 1000, 96], [1], [5000], [10], [4096]]
    many = [files.DataFile(Path(f"{i}"), tokens=1) for i in range(130)]
    assert [len(c) for c in audit_command.batches(many, lambda f: f.tokens, 4096)] == [64, 64, 2]


def test_a_sample_without_an_auditable_file_is_each_file_na_not_a_usage_error(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Of a sample, only the sampled files were read: none auditable says nothing of DATA, so each
    is `n/a` with why (exit 2), as a shard's files are; every file of DATA unauditable is exit 4."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        write(data / f"two-ids-{i}.safetensors", ids=2, first=10 * i)
    code, out, err = _main(
        ["audit", str(data), str(model), "--ids", "1,2,4", "--sample", "2", "--json"], capsys
    )
    found = json.loads(out)
    assert code == found["exit_code"] == 2 and found["counts"] == {"ok": 0, "wrong": 0, "n/a": 2}, err
    assert [row["why"] for row in found["files"]] == [
        "holds 2 ids per token, not the 3 of --ids [1, 2, 4]"
    ] * 2
    code, _, err = _main(["audit", str(data), str(model), "--ids", "1,2,4", "--all"], capsys)
    assert code == 4 and "no file of DATA" in err


def test_data_that_is_a_file_says_so(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "one.safetensors")
    code, _, err = _main(["audit", str(path), str(model), "--ids", "1,2,4"], capsys)
    assert code == 4 and f"DATA {path}: a file, not a directory" in err, err
