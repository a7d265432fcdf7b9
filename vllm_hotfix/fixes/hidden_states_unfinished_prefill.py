"""A request that finishes before its prefill completes still gets a hidden-states file.

Why: ExampleHiddenStatesConnector's scheduler side, `request_finished`, queues a save for every
finished request, whatever finished it. A request aborted after its first prefill chunk (client
gone, timeout) is saved with `token_ids` for its whole prompt but states only for its computed
tokens: the rows past them hold whatever their block held before, and blocks never allocated give
no rows at all.

How: right before the function queues the save, a request whose computed tokens do not cover the
tokens its file would name (`request.num_computed_tokens < len(token_ids)`) gets no file and one
INFO line; the function returns what the release returns for a request it saves nothing for
(`False, None` with upstream's branch of vLLM PR #56841, `True, None` before), so its blocks are
freed as that release expects. It runs in the scheduler, never traced.

Affected releases: vLLM 0.24.0 (the connector's rewrite, PR #43805) to 0.34.0 and later.

Upstream: none yet; the patch offered is in upstream/hidden-states-unfinished-prefill/.

When to drop: when the oldest supported vLLM has upstream's equivalent change.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.base import Fix, Probe, contains_code, parse_function, parse_or_unknown, same_code
from vllm_hotfix.runtime.decisions import Decision

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
CONNECTOR = "ExampleHiddenStatesConnector"
GUARD = "request.num_computed_tokens < len(token_ids)"
QUEUE = "self._pending_saves[req_id]"  # the save this function queues for the worker
# Upstream's branch (vLLM PR #56841, 0.31.0) for a request aborted before it was scheduled.
UNSCHEDULED = "filename is None"
UNSCHEDULED_RETURN = "return False, None"
DELAYED_RETURN = "return True, None"
SAVE = "PendingSave(req_id=req_id, filename=filename, token_ids=token_ids, block_ids=list(block_ids))"
# The same upstream change (vLLM PR #56841) made get_finished report, and so free, only the requests
# with a save in flight; before it, every finished request. The function's own shape says which.
SKIP = (
    "# A request that finished before its prefill completed (aborted: client gone,\n"
    "# timeout) has states only for its computed tokens; the rest of its last block\n"
    "# holds what the block held before. Save no file for it (vllm-hotfix\n"
    "# hidden-states-unfinished-prefill).\n"
    f"if {GUARD}:\n"
    "    logger.info(\n"
    '        "Request %s finished before its prefill completed (%d of %d tokens "\n'
    '        "computed): no hidden states saved.",\n'
    "        req_id,\n"
    "        request.num_computed_tokens,\n"
    "        len(token_ids),\n"
    "    )\n"
    "    {returns}\n"
)


def _queue(function: ast.FunctionDef) -> list[ast.Assign]:
    """The top-level `self._pending_saves[req_id] = PendingSave(...)` statements."""
    return [
        stmt
        for stmt in function.body
        if isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and ast.unparse(stmt.targets[0]) == QUEUE  # a store: same_code compares loads
        and isinstance(stmt.value, ast.Call)
        and same_code(stmt.value.func, "PendingSave")
    ]


def _assigns(tree: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(tree)
    )


def _unscheduled_branch(function: ast.FunctionDef) -> ast.If | None:
    """Upstream's `if filename is None: ... return False, None` (0.31.0 on), if the function has it."""
    for stmt in function.body:
        if (
            isinstance(stmt, ast.If)
            and same_code(stmt.test, UNSCHEDULED)
            and stmt.body
            and same_code(stmt.body[-1], UNSCHEDULED_RETURN)
        ):
            return stmt
    return None


class HiddenStatesUnfinishedPrefill(Fix):
    """ExampleHiddenStatesConnector.request_finished: no file for a request whose prefill did not complete."""

    fix_id = "hidden-states-unfinished-prefill"
    title = "ExampleHiddenStatesConnector saves no file for a request aborted before its prefill completed"
    module = CONNECTOR_MODULE
    owner = CONNECTOR
    attribute = "request_finished"
    affected = ("0.24.0", "0.34.0")
    fixed_in = None
    upstream = "none (see upstream/hidden-states-unfinished-prefill/)"
    absent = Decision.NOT_AFFECTED  # releases before the connector (0.17.0) save nothing

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if contains_code(function, GUARD):
            return Probe(Decision.FIXED_UPSTREAM, f"a request is saved only when `not {GUARD}`")
        if not contains_code(function, "PendingSave"):
            return Probe(
                Decision.NOT_AFFECTED,
                f"{CONNECTOR}.request_finished queues no save: the connector from before its rewrite"
                " (vLLM PR #43805, 0.24.0) writes a request's file in its worker's save_kv_layer, in"
                " the steps that schedule it (0.22.0-0.23.0 refuse chunked prefill with it; 0.17.0-"
                "0.21.0 rewrite the file at each chunk that gets new blocks, a defect of that save"
                " path this fix does not repair)",
            )
        names = [a.arg for a in function.args.args]
        missing = [] if "request" in names else [f"the parameter `request` (found {', '.join(names)})"]
        queues = _queue(function)
        if len(queues) != 1:
            missing.append(f"one top-level `{QUEUE} = PendingSave(...)`")
        else:
            (queue,) = queues
            before = function.body[: function.body.index(queue)]
            if not any(_assigns(stmt, "token_ids") for stmt in before):
                missing.append(f"`token_ids` assigned before `{QUEUE} = PendingSave(...)`")
            if not contains_code(queue, SAVE):
                missing.append(f"`{SAVE}`")
        if not contains_code(function, "req_id = request.request_id"):
            missing.append("`req_id = request.request_id`")
        if missing:
            return Probe(
                Decision.UNKNOWN,
                f"not the known shape of {CONNECTOR}.request_finished; missing: " + "; ".join(missing),
            )
        tracked_only = _unscheduled_branch(function) is not None
        returns = UNSCHEDULED_RETURN if tracked_only else DELAYED_RETURN
        return Probe(
            Decision.PATCHED,
            "a request that finished before its prefill completed is saved with token ids for every"
            " prompt token but states only for its computed ones (the rest of its last block holds"
            f" what the block held before); fixed: no file when `{GUARD}`, one INFO line, `{returns}`",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        function = parse_function(text)
        (queue,) = _queue(function)
        returns = UNSCHEDULED_RETURN if _unscheduled_branch(function) is not None else DELAYED_RETURN
        lines = text.splitlines(keepends=True)
        addition = textwrap.indent(SKIP.replace("{returns}", returns), " " * queue.col_offset)
        return "".join(lines[: queue.lineno - 1]) + addition + "".join(lines[queue.lineno - 1 :])
