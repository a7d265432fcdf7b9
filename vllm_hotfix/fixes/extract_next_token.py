"""`extract_hidden_states` feeds back the first sampled token, not the last valid one (V1 runner).

Why: `ExtractHiddenStatesProposer.prepare_next_token_ids_padded`
(vllm/v1/spec_decode/extract_hidden_states.py) reads only column 0 of `sampled_token_ids`. Under
async scheduling (the default for this method on GPUs) an accepted step then gives the proposed
token and a count of 1 instead of the bonus token and 2: the next step runs the wrong token at the
wrong position, text repeats tokens, and the output tokens' stored states come from those inputs
(vLLM issue #56417).

How: the three statements that read column 0 become the count of valid tokens per row and the
token at the last valid column, in torch (what the EAGLE proposer's Triton kernel computes, so it
runs where Triton does not); the fallback to the backup token and the discard mask are unchanged.
A function that calls the EAGLE kernel, or already takes the last valid token, is `fixed upstream`.

Affected releases: vLLM 0.17.0 to 0.33.0 (0.34.0 has no V1 proposer).

Upstream: vLLM PR #56442 (open) calls the EAGLE kernel; the patch offered is in
upstream/extract-next-token/.

When to drop: when the project no longer supports vLLM 0.17.0 to 0.33.0, or when a release with
upstream's fix is the oldest supported one.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.base import Fix, Probe, contains_code, parse_function, parse_or_unknown, same_code
from vllm_hotfix.runtime.decisions import Decision

PARAMETERS = ("self", "sampled_token_ids", "requests", "gpu_input_batch", "discard_request_mask")
# 0.17.0-0.18.1 also take the step's attention metadata (for the backup tokens) first.
OLD_PARAMETERS = (PARAMETERS[0], "common_attn_metadata", *PARAMETERS[1:])
# The buggy statements, in order: the first column, its validity, and a count of at most one.
FIRST_COLUMN = "sampled = sampled_token_ids[:, 0]"
IS_VALID = "is_valid = (sampled >= 0) & (sampled < gpu_input_batch.vocab_size)"
COUNT = "valid_sampled_tokens_count = is_valid.to(torch.int32)"
# What the fix keeps and relies on: the fallback to the backup token and the return.
USE_SAMPLED = "use_sampled = is_valid & ~discard_request_mask[:num_reqs]"
NEXT = "next_token_ids = torch.where(use_sampled, sampled.to(torch.int32), backup_tokens_gpu)"
RETURN = "return next_token_ids, valid_sampled_tokens_count"
STOCK_COMMENT = "# With num_speculative_tokens == 1, there is exactly one token"
# The fixed statements (vLLM's style: ruff format, line length 88, at the method's indent).
FIXED = """\
# Each row holds the accepted proposed tokens, then the bonus or recovered
# token; rejected slots are -1. Feed back the last valid token of each row.
is_valid_token = (sampled_token_ids >= 0) & (
    sampled_token_ids < gpu_input_batch.vocab_size
)
valid_sampled_tokens_count = is_valid_token.sum(dim=1).to(torch.int32)
is_valid = valid_sampled_tokens_count > 0
last_valid = (valid_sampled_tokens_count.long() - 1).clamp(min=0)
sampled = sampled_token_ids.gather(1, last_valid.unsqueeze(1)).squeeze(1)
"""
FIXED_MARK = "sampled = sampled_token_ids.gather(1, last_valid.unsqueeze(1)).squeeze(1)"
EAGLE_KERNEL = "eagle_prepare_next_token_padded"  # part of the kernel's names (0.17.0-0.33.0)


def _calls_eagle_kernel(function: ast.FunctionDef) -> bool:
    """The EAGLE proposer's kernel (or its 0.31.0+ dispatcher) called, as vLLM PR #56442 does."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            callee = node.func.value if isinstance(node.func, ast.Subscript) else node.func
            name = callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", "")
            if EAGLE_KERNEL in name:
                return True
    return False


class Shape:
    """Where the known buggy statements are, or what is missing."""

    def __init__(self, function: ast.FunctionDef) -> None:
        self.missing: list[str] = []
        self.first: ast.stmt | None = None
        self.last: ast.stmt | None = None
        names = tuple(a.arg for a in function.args.args)
        if names not in (PARAMETERS, OLD_PARAMETERS):
            self.missing.append(f"the parameters {', '.join(PARAMETERS)} (found {', '.join(names)})")
        body = function.body
        start = next((i for i, s in enumerate(body) if same_code(s, FIRST_COLUMN)), None)
        if start is None or len(body) < start + 6:
            self.missing.append(f"`{FIRST_COLUMN}` followed by five statements")
            return
        expected = (FIRST_COLUMN, IS_VALID, COUNT, USE_SAMPLED, NEXT, RETURN)
        found = body[start : start + 6]
        for statement, code in zip(found, expected, strict=True):
            if not same_code(statement, code):
                self.missing.append(f"`{code}`")
        if body[start + 5] is not body[-1]:
            self.missing.append(f"`{RETURN}` last")
        if not self.missing:
            self.first, self.last = found[0], found[2]


class ExtractNextToken(Fix):
    """ExtractHiddenStatesProposer.prepare_next_token_ids_padded: the last valid token, all counted."""

    fix_id = "extract-next-token"
    title = "extract_hidden_states feeds back the last valid sampled token (async scheduling)"
    module = "vllm.v1.spec_decode.extract_hidden_states"
    owner = "ExtractHiddenStatesProposer"
    attribute = "prepare_next_token_ids_padded"
    affected = ("0.17.0", "0.33.0")
    fixed_in = None
    upstream = "vLLM PR #56442 (open; vLLM issue #56417)"
    absent = Decision.NOT_AFFECTED  # releases before the proposer have no such method to fix

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if _calls_eagle_kernel(function):
            return Probe(
                Decision.FIXED_UPSTREAM,
                "calls the EAGLE proposer's kernel, which feeds back each row's last valid token",
            )
        if contains_code(function, FIXED_MARK):
            return Probe(Decision.FIXED_UPSTREAM, "feeds back each row's last valid token")
        shape = Shape(function)
        if shape.missing:
            return Probe(
                Decision.UNKNOWN,
                "not the known shape of prepare_next_token_ids_padded; missing: " + "; ".join(shape.missing),
            )
        return Probe(
            Decision.PATCHED,
            "feeds back column 0 of the sampled tokens: under async scheduling a step whose proposed"
            " token was accepted gives the next step the wrong token and count; fixed: the last"
            " valid token of each row, and all valid tokens counted",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        shape = Shape(parse_function(text))
        assert shape.first is not None and shape.last is not None and shape.last.end_lineno is not None
        lines = text.splitlines(keepends=True)
        first = shape.first.lineno - 1
        if first > 0 and lines[first - 1].strip() == STOCK_COMMENT:
            first -= 1  # the comment says there is one token: it goes with the statements
        indent = " " * shape.first.col_offset
        lines[first : shape.last.end_lineno] = [textwrap.indent(FIXED, indent)]
        return "".join(lines)
