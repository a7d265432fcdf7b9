"""The audit's reading of a dataset's headers and its per-id judgement, on files and states made
here: every planted defect is `wrong` on exactly its id, with the cause its pattern shows."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from vllm_hotfix.audit import compare, files
from vllm_hotfix.judging import precision

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors.torch")

IDS = [1, 2, 4]
TOL = 1e-4


def at(tolerance: float, allowed: int = 0) -> precision.Rule:
    """A rule of `tolerance`, `allowed` tokens over it per id (as --tolerance gives, or a MoE's)."""
    return precision.Rule("float32", "float32", "float32", tolerance, allowed, "test")


def states(tokens: int = 12, hidden: int = 64, seed: int = 0) -> dict[int, object]:
    generator = torch.Generator().manual_seed(seed)
    return {i: torch.randn(tokens, hidden, generator=generator) for i in (0, 1, 2, 3, 4)}


def stored_from(references: dict[int, object], ids: list[int] = IDS) -> object:
    return torch.stack([references[i] for i in ids], dim=1).clone()


def test_correct_states_are_ok_on_every_id() -> None:
    references = states()
    found = compare.judge_file(stored_from(references).to(torch.bfloat16), IDS, references, at(2e-2))
    assert [(e["id"], e["status"], e["tokens_over"]) for e in found] == [
        (1, "ok", 0),
        (2, "ok", 0),
        (4, "ok", 0),
    ]


@pytest.mark.parametrize(
    ("plant", "cause"),
    [
        (lambda s, r: s[:, 1].zero_(), "zeros"),
        (lambda s, r: s[:, 1].mul_(1.5), "scaled by 1.5"),
        (lambda s, r: s[:, 1].copy_(r[1]), "an alias of id 1"),
        (lambda s, r: s[:, 1].copy_(r[4]), "an alias of id 4"),
        (lambda s, r: s[:, 1].copy_(r[3]), "the state of layer 3, a neighbouring layer (an id off by one)"),
        (lambda s, r: s[:, 1].add_(0.3 * torch.randn_like(s[:, 1])), None),  # e.g. a partial sum
        (lambda s, r: s[5:, 1].zero_(), "wrong on 7 of 12 tokens: zeros"),
        (lambda s, r: s[11, 1].copy_(r[2][3]), "wrong on 1 of 12 tokens"),  # a padding row's overwrite
    ],
)
def test_a_planted_defect_is_wrong_on_exactly_its_id(plant, cause: str | None) -> None:
    references = states()
    stored = stored_from(references)
    plant(stored, references)
    found = {e["id"]: e for e in compare.judge_file(stored, IDS, references, at(TOL))}
    assert [i for i, e in found.items() if e["status"] == "wrong"] == [2]
    assert found[2]["cause"] == cause and found[2]["max_rel_diff"] > TOL


def test_a_non_finite_state_is_wrong() -> None:
    references = states()
    stored = stored_from(references)
    stored[3, 0, 7] = float("nan")
    found = compare.judge_file(stored, IDS, references, at(TOL))
    assert found[0]["status"] == "wrong" and found[0]["first_wrong_token"] == 3


def write(path: Path, tokens: int = 6, ids: int = 3, hidden: int = 16) -> Path:
    safetensors.save_file(
        {"hidden_states": torch.zeros(tokens, ids, hidden), "token_ids": torch.arange(tokens)}, str(path)
    )
    return path


def test_a_good_header_gives_the_shapes(tmp_path: Path) -> None:
    found = files.read_header(write(tmp_path / "a.safetensors"))
    assert (found.tokens, found.ids, found.hidden, found.dtype, found.na) == (6, 3, 16, "F32", None)


def test_bad_files_are_na_with_why(tmp_path: Path) -> None:
    good = write(tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(good[:-10])
    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    safetensors.save_file({"hidden_states": torch.zeros(2, 3, 4)}, str(tmp_path / "no-tokens.safetensors"))
    safetensors.save_file(
        {"hidden_states": torch.zeros(2, 4), "token_ids": torch.arange(2)}, str(tmp_path / "flat.safetensors")
    )
    header = json.dumps(
        {
            "hidden_states": {"dtype": "F32", "shape": [2, 1, 1], "data_offsets": [0, 8]},
            "token_ids": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
        }
    ).encode()
    (tmp_path / "float-ids.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    said = {p.name: files.read_header(p).na for p in (path for _, path in files.listing(tmp_path).files)}
    assert said["good.safetensors"] is None
    assert said["cut.safetensors"] == (
        "unreadable header: SafetensorError: Error while deserializing header: incomplete metadata, file"
        " not fully covered"
    )
    for name in ("empty.safetensors", "junk.safetensors"):
        assert said[name].startswith("unreadable header: SafetensorError: "), said[name]
    assert said["no-tokens.safetensors"].startswith("no token_ids tensor")
    assert "not [tokens, ids, hidden]" in said["flat.safetensors"]
    assert said["float-ids.safetensors"] == "token_ids has dtype F32, not an integer type"


def test_a_sample_is_reproducible_and_keeps_the_order() -> None:
    names = [f"{i:03d}.safetensors" for i in range(50)]
    first, again = files.choose(names, 7, seed=3), files.choose(names, 7, seed=3)
    assert first == again and len(first) == 7 and first == sorted(first)
    assert files.choose(names, 7, seed=4) != first
    assert files.choose(names, None, seed=0) == names == files.choose(names, 99, seed=0)


def test_token_ids_and_their_key_without_torch(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    for dtype in (torch.int64, torch.int32):
        safetensors.save_file(
            {"hidden_states": torch.zeros(3, 1, 2), "token_ids": torch.tensor([7, 1024, 3], dtype=dtype)},
            str(path),
        )
        found = files.read_header(path)
        assert files.token_ids(found) == [7, 1024, 3]
        assert files.tokens_key([7, 1024, 3]) == files.tokens_key(files.token_ids(found))
    assert files.tokens_key([7, 1024, 3]) != files.tokens_key([7, 1024])


def test_the_auditor_matches_a_forwards_prompts_to_files_and_judges_each(tmp_path: Path) -> None:
    from vllm_hotfix.audit.worker import Auditor, segments

    engine_ids = [0, 1, 2, 3, 4]
    first, second = states(tokens=5, seed=1), states(tokens=3, seed=2)
    tokens = {"a": [5, 6, 7, 8, 9], "b": [11, 12, 13]}
    planted = stored_from(second)
    planted[:, 2].copy_(second[3])  # id 4 holds layer 3's state
    paths = {}
    for name, stored in (("a", stored_from(first)), ("b", planted)):
        paths[name] = str(tmp_path / f"{name}.safetensors")
        safetensors.save_file({"hidden_states": stored, "token_ids": torch.tensor(tokens[name])}, paths[name])
    out = tmp_path / "out"
    out.mkdir()
    manifest = {
        "ids": IDS,
        "tolerance": TOL,
        "out": str(out),
        "files": [
            {
                "path": paths[n],
                "tokens_key": files.tokens_key(tokens[n]),
                "rows": len(tokens[n]),
                "dtype": "F32",
            }
            for n in ("a", "b")
        ],
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    auditor = Auditor(str(tmp_path / "manifest.json"), engine_ids)

    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])  # b then a, in one forward
    assert segments(positions) == [(0, 3), (3, 8)]
    input_ids = torch.tensor(tokens["b"] + tokens["a"])
    aux = [torch.cat([second[i], first[i]]) for i in engine_ids]
    auditor.forward(input_ids, positions, aux)
    a, b = (json.loads((out / f"{i}.json").read_text()) for i in (0, 1))
    assert a["status"] == "ok" and [e["status"] for e in a["per_id"]] == ["ok"] * 3
    assert b["status"] == "wrong" and [e["status"] for e in b["per_id"]] == ["ok", "ok", "wrong"]
    assert b["per_id"][2]["cause"] == "the state of layer 3, a neighbouring layer (an id off by one)"


def _audit_of(tmp_path: Path, statuses: list[str]) -> object:
    """The audit's judgement of files whose engine-side results say `statuses` (no engine)."""
    import argparse

    from vllm_hotfix.audit.selection import Chosen
    from vllm_hotfix.commands.audit import Audit

    data = tmp_path / "data"
    data.mkdir()
    chosen = Chosen(data, IDS)
    out = tmp_path / "out"
    out.mkdir()
    for index, status in enumerate(statuses):
        path = write(data / f"{index}.safetensors", ids=3)
        chosen.audited.append(files.read_header(path))
        per_id = [{"id": i, "status": status} for i in IDS]
        (out / f"{index}.json").write_text(
            json.dumps({"file": str(path), "status": status, "per_id": per_id})
        )
    namespace = argparse.Namespace(model="m", json=True, engine_args=[], list_every_file=True)
    audit = Audit(namespace, chosen)
    audit.out = str(out)
    return audit


@pytest.mark.parametrize(
    ("check", "statuses", "verdict", "code"),
    [
        ("PASS", ["ok", "ok"], "PASS", 0),
        ("PASS", ["ok", "wrong"], "FAIL", 1),
        ("FAIL", ["ok", "wrong"], "UNKNOWN", 2),  # the reference unproven: nothing called ok or wrong
        ("UNKNOWN", ["ok", "ok"], "UNKNOWN", 2),
    ],
)
def test_no_file_is_ok_or_wrong_unless_the_check_passed(
    tmp_path: Path, check: str, statuses: list[str], verdict: str, code: int
) -> None:
    from vllm_hotfix.check.outcome import Outcome

    audit = _audit_of(tmp_path, statuses)
    judged = Outcome(check, {"PASS": 0, "FAIL": 1, "UNKNOWN": 2}[check], "why", [], 0)
    audit.collect()
    counts, rows, _ = audit.judgement(judged)
    assert (
        audit.verdict(judged, counts, rows)[:2] == (verdict, code)
        and audit.said(None, judged, False).code == code
    )
    if check != "PASS":
        assert all(r["status"] == "n/a" and "unproven" in r["why"] for r in rows)
        assert [r["measured"] for r in rows] == statuses
    else:
        assert [r["status"] for r in rows] == statuses


def test_a_file_never_recomputed_says_whether_the_run_ended_early(tmp_path: Path) -> None:
    """vLLM failing at start-up leaves every file without a result: its why must say so, not
    blame the file."""
    from vllm_hotfix.check.outcome import Outcome

    audit = _audit_of(tmp_path, ["ok"])
    (Path(audit.out) / "0.json").unlink()
    failed = Outcome("UNKNOWN", 3, "vLLM failed", [], 0, error="vLLM failed while starting vLLM: ...")
    assert "the run ended before its prompt ran" in audit.judgement(failed)[1][0]["why"]
    finished = Outcome("PASS", 0, "all checked", [], 0)
    assert "no forward of the engine carried its tokens whole" in audit.judgement(finished)[1][0]["why"]
