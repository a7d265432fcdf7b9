"""`extract_hidden_states`: a dummy run rewrites old states into reused cache slots (V1 runner).

Why: `ExtractHiddenStatesProposer.dummy_run` (vllm/v1/spec_decode/extract_hidden_states.py) takes
its slot mapping from `self._get_slot_mapping(num_input_tokens)` called without a mapping, and
`_get_slot_mapping` refills its buffer only when handed one: the dummy run ignores the padding
slots (-1) the runner passes (`_dummy_run`, which an idle data-parallel rank runs through
`execute_dummy_batch`) and replays the slots of earlier real steps with the proposer's
`hidden_states` buffer. Padded past the last step's tokens (CUDA graphs, token counts synchronised
across DP ranks), it writes an old request's states into slots since given to another request,
and with prefix caching a later request reads them.

How: the branch that uses the proposer's own buffer first fills all of it with the padding slot
(-1, the module's `PADDING_SLOT_ID`, written as the runner's `_dummy_run` writes it), so a dummy
run writes no state, as the V2 runner's dummy slot mappings do (`get_dummy_slot_mappings` fills its
persistent tensor with `PAD_SLOT_ID`); the buffer keeps its address for CUDA graph capture. A
function that already fills the buffer with the padding slot is `fixed upstream`.

Affected: every release with the V1 proposer, 0.17.0-0.33.0 (the same `dummy_run` and
`_get_slot_mapping` throughout; 0.34.0 has no V1 proposer). Upstream: none yet (the patch is in
upstream/extract-dummy-run-slots/). Drop it when upstream pads the dummy run's slots, or with the
last release before 0.34.0.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.decisions import Decision
from vllm_hotfix.fixes.base import Fix, Probe, contains_code, same_code

MODULE = "vllm.v1.spec_decode.extract_hidden_states"
OWNER = "ExtractHiddenStatesProposer"
PARAMETERS = ("self", "num_tokens", "use_cudagraphs", "is_graph_capturing", "slot_mappings")
# The buggy branch: the proposer's own buffer, not refilled, and the runner's mappings otherwise.
OWN_BUFFER = "slot_mapping_dict = self._get_slot_mapping(num_input_tokens)"
RUNNER_MAPPINGS = "slot_mapping_dict = slot_mappings or {}"
# The fix: -1, the module's PADDING_SLOT_ID, written as the V1 runner's own `_dummy_run` writes it
# (`sm.fill_(-1)`), so that the installed function needs no module name the probe cannot see.
FILL = "self._slot_mapping_buffer.fill_(-1)"
FILL_NAMED = "self._slot_mapping_buffer.fill_(PADDING_SLOT_ID)"
FIXED = """\
# A dummy run has no real slots: pad every token (PADDING_SLOT_ID) so that
# it writes no state; the buffer keeps its address for CUDA graph capture.
self._slot_mapping_buffer.fill_(-1)
"""


def _own_buffer_branch(function: ast.FunctionDef) -> ast.If | None:
    """The `if` whose body is the buggy call alone and whose `else` takes the runner's mappings."""
    for node in function.body:
        if (
            isinstance(node, ast.If)
            and len(node.body) == 1
            and same_code(node.body[0], OWN_BUFFER)
            and len(node.orelse) == 1
            and same_code(node.orelse[0], RUNNER_MAPPINGS)
        ):
            return node
    return None


class ExtractDummyRunSlots(Fix):
    """ExtractHiddenStatesProposer.dummy_run: its own slot buffer padded, so it writes no state."""

    fix_id = "extract-dummy-run-slots"
    title = "extract_hidden_states dummy runs (idle data-parallel ranks) write no hidden states"
    module = MODULE
    owner = OWNER
    attribute = "dummy_run"
    affected = ("0.17.0", "0.33.0")
    fixed_in = None
    upstream = "not fixed upstream as of vLLM 0.33.0 (the V1 proposer is gone in 0.34.0)"
    absent = Decision.NOT_AFFECTED  # releases without the V1 proposer have no such dummy run

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        try:
            function = self.parse_function(source)
        except (SyntaxError, ValueError) as error:
            return Probe(Decision.UNKNOWN, f"source could not be parsed: {error}")
        if contains_code(function, FILL) or contains_code(function, FILL_NAMED):
            return Probe(
                Decision.FIXED_UPSTREAM, "fills its slot buffer with the padding slot before a dummy run"
            )
        missing = []
        names = tuple(a.arg for a in function.args.args)
        if names != PARAMETERS:
            missing.append(f"the parameters {', '.join(PARAMETERS)} (found {', '.join(names)})")
        if _own_buffer_branch(function) is None:
            missing.append(f"`if ...: {OWN_BUFFER}` with `else: {RUNNER_MAPPINGS}`")
        if missing:
            return Probe(
                Decision.UNKNOWN,
                f"not the known shape of {OWNER}.dummy_run; missing: " + "; ".join(missing),
            )
        return Probe(
            Decision.PATCHED,
            "a dummy run replays the slots of earlier steps from the proposer's buffer, ignoring the"
            " runner's padding slots: an idle data-parallel rank writes old states into reused cache"
            " slots; fixed: the buffer holds the padding slot for every token of a dummy run",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        branch = _own_buffer_branch(self.parse_function(text))
        assert branch is not None
        call = branch.body[0]
        lines = text.splitlines(keepends=True)
        lines.insert(call.lineno - 1, textwrap.indent(FIXED, " " * call.col_offset))
        return "".join(lines)
