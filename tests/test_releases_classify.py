"""harness.releases.classify: each release's verdicts from the fixes' own probes, and PyPI's releases.

Every release's verdict per fix, from the sources published: test_stored_sources.py (offline).
The tests marked `network` read PyPI; when it cannot be reached they skip, saying why, unless
VLLMHOTFIX_REQUIRE_NETWORK is set (scripts/test.sh sets it): then they fail (tests/network.py).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import pytest

from harness import releases
from tests.network import REQUIRE_NETWORK_VAR, network_unavailable
from tests.release_shapes import BUGGY_V2, MEMBER
from vllm_hotfix.fixes import ALL_FIXES
from vllm_hotfix.fixes.cpu_sampler_fp64_gumbel import CpuSamplerFp64Gumbel
from vllm_hotfix.fixes.deepseek_final_aux import DeepseekFinalAux
from vllm_hotfix.runtime.decisions import Decision

NOT_AFFECTED = Decision.NOT_AFFECTED
PATCHED = Decision.PATCHED
UNKNOWN = Decision.UNKNOWN


def test_a_network_failure_is_reported_per_release_not_raised(tmp_path) -> None:
    def refuse(url: str) -> releases.RangeFile:
        raise urllib.error.URLError("connection refused")

    release = releases.Release("vllm", "0.24.0", "http://127.0.0.1:9/x.whl", "x.whl")
    row = releases.classify_release(release, ALL_FIXES, releases.MemberCache(str(tmp_path)), refuse)
    assert row.network_error and "connection refused" in (row.error or "")
    assert [o.verdict for o in row.outcomes] == [UNKNOWN] * len(ALL_FIXES)


# -- finding and classifying the target ---------------------------------------------------------------


def test_function_source_takes_the_last_definition() -> None:
    source = releases.function_source(BUGGY_V2, "DeepseekV2Model", "forward")
    assert source is not None and "aux_hidden_states = []" in source
    assert source.startswith("    def forward(self, input_ids, positions")
    module = "def f():\n    return 1\n\n\n@decorator\ndef f():\n    return 2\n"
    assert releases.function_source(module, None, "f") == "@decorator\ndef f():\n    return 2\n"
    assert releases.function_source(module, None, "g") is None
    assert releases.function_source(module, "Missing", "f") is None


def test_classify_as_the_engine_would() -> None:
    buggy = {MEMBER: BUGGY_V2}
    deepseek, sampler = DeepseekFinalAux(), CpuSamplerFp64Gumbel()
    assert releases.classify_fix(deepseek, buggy).verdict == PATCHED
    assert releases.classify_fix(deepseek, {}).verdict is deepseek.absent  # no module: fix.absent
    assert releases.classify_fix(sampler, {}).verdict is sampler.absent is NOT_AFFECTED
    without_class = {MEMBER: "X = 1\n"}
    assert releases.classify_fix(deepseek, without_class).verdict is deepseek.absent
    broken = {MEMBER: "def (:\n"}
    assert releases.classify_fix(deepseek, broken).verdict == UNKNOWN


def test_unknowns_name_the_release_the_fix_and_the_reason() -> None:
    row = releases.Row(
        "vllm", "9.9.9", "w.whl", None, [releases.Outcome("deepseek-final-aux", UNKNOWN, "why")]
    )
    assert releases.unknowns([row]) == ["vllm 9.9.9: deepseek-final-aux: why"]


def test_needed_members_cover_modules_packages_and_related() -> None:
    members = releases.needed_members([CpuSamplerFp64Gumbel()])
    assert "vllm/utils/cpu_triton_utils.py" in members
    assert "vllm/utils/cpu_triton_utils/__init__.py" in members
    assert "vllm/v1/sample/rejection_sampler.py" in members


# -- the releases listed ---------------------------------------------------------------------------


def _file(name: str, kind: str = "bdist_wheel", yanked: bool = False, size: int = 10) -> dict[str, Any]:
    return {"filename": name, "packagetype": kind, "yanked": yanked, "size": size, "url": f"../../p/{name}"}


def test_list_releases_orders_resolves_and_says_what_it_skips() -> None:
    index = {
        "releases": {
            "0.9.2": [_file("vllm-0.9.2-any.whl")],
            "0.10.0.post2": [_file("vllm-0.10.0.post2-b.whl", size=5), _file("vllm-0.10.0.post2-a.whl")],
            "0.10.0": [_file("vllm-0.10.0-any.whl")],
            "0.10.1": [_file("vllm-0.10.1-any.whl", yanked=True)],
            "0.10.2": [_file("vllm-0.10.2.tar.gz", kind="sdist")],
            "0.11.0rc1": [_file("vllm-0.11.0rc1-any.whl")],
            "0.11.0": [],
        }
    }
    found = releases.list_releases("vllm", index)
    assert [(r.version, r.skipped) for r in found] == [
        ("0.10.0", None),
        ("0.10.0.post2", None),
        ("0.10.1", "yanked"),
        ("0.10.2", "no wheels (sdist only)"),
        ("0.11.0", "no files"),
    ]
    assert found[1].wheel_name == "vllm-0.10.0.post2-b.whl"  # the smallest wheel
    assert found[0].wheel_url == "https://pypi.org/p/vllm-0.10.0-any.whl"  # relative URLs resolved


# -- today's verdicts on PyPI (network) -------------------------------------------------------------


@pytest.mark.parametrize(("value", "fails"), [("1", True), ("yes", True), ("0", False), ("", False)])
def test_network_errors_fail_only_when_required(monkeypatch, value: str, fails: bool) -> None:
    monkeypatch.setenv(REQUIRE_NETWORK_VAR, value)
    outcome = pytest.fail.Exception if fails else pytest.skip.Exception
    with pytest.raises(outcome, match="PyPI is down"):
        network_unavailable("PyPI is down")


@pytest.mark.network
def test_no_release_is_unknown(pypi_rows) -> None:
    found = releases.unknowns(pypi_rows)
    assert not found, (
        "the probes cannot classify these releases (a new upstream release changed a target?):\n"
        + "\n".join(found)
    )
