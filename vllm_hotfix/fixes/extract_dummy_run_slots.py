"""`extract_hidden_states`: a dummy run rewrites old states into reused cache slots (V1 runner).

Why: `ExtractHiddenStatesProposer.dummy_run` (vllm/v1/spec_decode/extract_hidden_states.py) takes
its slot mapping from `self._get_slot_mapping(num_input_tokens)` called without a mapping, which
refills its buffer only when handed one: the dummy run (an idle data-parallel rank's) ignores the
padding slots the runner passes and replays the slots of earlier real steps. Padded past the last
step's tokens, it writes an old request's states into slots since given to another request, and
with prefix caching a later request reads them.

How: the branch that uses the proposer's own buffer first fills all of it with the padding slot
(-1, the module's `PADDING_SLOT_ID`), so a dummy run writes no state, as the V2 runner's dummy slot
mappings do; the buffer keeps its address for CUDA graph capture. The method is
`@torch.inference_mode()`: the fixed function is built without the decorator and `put` applies it.

Affected releases: vLLM 0.17.0 to 0.33.0 (0.34.0 has no V1 proposer).

Upstream: not fixed; the patch offered is in upstream/extract-dummy-run-slots/.

When to drop: when upstream pads the dummy run's slots (then `fixed upstream`), or when no
supported release predates 0.34.0.
"""

from __future__ import annotations

import ast
import os
import textwrap
from collections.abc import Mapping
from types import FunctionType, ModuleType
from typing import Any

from vllm_hotfix.fixes.base import Fix, Probe, contains_code, parse_function, parse_or_unknown, same_code
from vllm_hotfix.runtime.decisions import Decision

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
# The method's decorator: the installed attribute is torch's wrapper (`decorate_context`, in
# torch/utils/_contextlib.py) around the function; `current` unwraps it and `put` re-applies it.
DECORATOR = "torch.inference_mode()"
WRAPPER = ("decorate_context", os.path.join("torch", "utils", "_contextlib.py"))
STOCK = "_vllm_hotfix_stock"  # on the installed wrapper: the stock one, put back by remove()
FIXED = """\
# A dummy run has no real slots: pad every token (PADDING_SLOT_ID) so that
# it writes no state; the buffer keeps its address for CUDA graph capture.
self._slot_mapping_buffer.fill_(-1)
"""


def _inner(wrapper: Any) -> FunctionType | None:
    """The function torch's inference-mode wrapper calls, or None if `wrapper` is not one."""
    code = getattr(wrapper, "__code__", None)
    inner = getattr(wrapper, "__wrapped__", None)
    if code is None or (code.co_name, code.co_filename.endswith(WRAPPER[1])) != (WRAPPER[0], True):
        return None
    cells = dict(zip(code.co_freevars, wrapper.__closure__ or (), strict=True))
    if type(inner) is not FunctionType or "func" not in cells or cells["func"].cell_contents is not inner:
        return None
    return inner


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
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if contains_code(function, FILL) or contains_code(function, FILL_NAMED):
            return Probe(
                Decision.FIXED_UPSTREAM, "fills its slot buffer with the padding slot before a dummy run"
            )
        missing = []
        names = tuple(a.arg for a in function.args.args)
        if names != PARAMETERS:
            missing.append(f"the parameters {', '.join(PARAMETERS)} (found {', '.join(names)})")
        if [ast.unparse(d) for d in function.decorator_list] != [DECORATOR]:
            missing.append(f"the decorator @{DECORATOR} alone")
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
        branch = _own_buffer_branch(parse_function(text))
        assert branch is not None
        call = branch.body[0]
        lines = text.splitlines(keepends=True)
        lines.insert(call.lineno - 1, textwrap.indent(FIXED, " " * call.col_offset))
        function = parse_function(text)
        # The decorator goes: `put` applies it to the built function, as the class body did.
        return "".join(lines[function.lineno - 1 :])

    def current(self, module: ModuleType) -> Any:
        """The function under torch's inference-mode wrapper (stock's, or the fixed one)."""
        installed = super().current(module)
        inner = _inner(installed)
        return installed if inner is None else inner

    def put(self, module: ModuleType, function: FunctionType, replacing: FunctionType) -> None:
        """`function` under `@torch.inference_mode()`, as the class body defines the method; the
        stock wrapper itself when `function` is what it wraps (remove())."""
        holder = self.holder(module)
        installed = vars(holder).get(self.attribute)
        stock = getattr(installed, STOCK, None)
        if stock is not None and _inner(stock) is function:
            setattr(holder, self.attribute, stock)
            return
        wrapper = module.torch.inference_mode()(function)
        setattr(wrapper, STOCK, installed)
        setattr(holder, self.attribute, wrapper)
