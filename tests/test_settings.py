"""Environment switches and version strings: parsed strictly, invalid values reported, never raised."""

from __future__ import annotations

import pytest

from harness.testenv import BUG, FIXED, NEWEST
from vllm_hotfix.settings import read_settings
from vllm_hotfix.vllm_version import VllmVersion, parse_release

IDS = ("deepseek-final-aux", "cpu-sampler-fp64-gumbel")


@pytest.mark.parametrize("raw", ["1", "true", "YES", " on ", "all"])
def test_disable_all(raw: str) -> None:
    found = read_settings(IDS, {"VLLM_HOTFIX_DISABLE": raw})
    assert found.disable_all and not found.problems
    assert all(found.is_disabled(i) for i in IDS)


@pytest.mark.parametrize("raw", ["", "0", "false", "off", "no"])
def test_disable_nothing(raw: str) -> None:
    found = read_settings(IDS, {"VLLM_HOTFIX_DISABLE": raw})
    assert not any(found.is_disabled(i) for i in IDS) and not found.problems


def test_disable_a_list_of_ids() -> None:
    found = read_settings(IDS, {"VLLM_HOTFIX_DISABLE": "cpu-sampler-fp64-gumbel, "})
    assert found.is_disabled("cpu-sampler-fp64-gumbel") and not found.is_disabled("deepseek-final-aux")
    assert not found.problems


def test_invalid_disable_names_the_variable_and_keeps_the_fixes_on() -> None:
    found = read_settings(IDS, {"VLLM_HOTFIX_DISABLE": "deepseek-final-aux,typo"})
    assert found.is_disabled("deepseek-final-aux") and not found.is_disabled("cpu-sampler-fp64-gumbel")
    (problem,) = found.problems
    assert "VLLM_HOTFIX_DISABLE" in problem and "'typo'" in problem
    assert all(i in problem for i in IDS) and "1/true/yes/on/all" in problem


@pytest.mark.parametrize(("raw", "strict"), [("1", True), ("on", True), ("0", False), ("", False)])
def test_strict(raw: str, strict: bool) -> None:
    assert read_settings(IDS, {"VLLM_HOTFIX_STRICT": raw}).strict is strict


def test_invalid_strict_falls_back_to_not_strict() -> None:
    found = read_settings(IDS, {"VLLM_HOTFIX_STRICT": "maybe"})
    assert not found.strict
    (problem,) = found.problems
    assert "VLLM_HOTFIX_STRICT" in problem and "'maybe'" in problem and "1/true/yes/on" in problem


@pytest.mark.parametrize(
    ("text", "release"),
    [
        ("0.24.0", (0, 24, 0)),
        ("0.24.0+cpu", (0, 24, 0)),
        ("0.24.0+cu128", (0, 24, 0)),
        ("0.25.0.dev12+g1a2b3c4", (0, 25, 0)),
        ("0.18.1", (0, 18, 1)),
        ("0.10.1.1.post2", (0, 10, 1, 1)),
        ("v0.20.0", (0, 20, 0)),
        ("unknown", None),
    ],
)
def test_parse_release(text: str, release: tuple[int, ...] | None) -> None:
    assert parse_release(text) == release


@pytest.mark.parametrize(
    ("text", "inside"),
    [("0.17.1", False), ("0.18.0", True), ("0.24.0+cpu", True), ("0.25.0.dev3+gabc", False), ("x", None)],
)
def test_known_range(text: str, inside: bool | None) -> None:
    assert VllmVersion(text, parse_release(text)).in_range("0.18.0", "0.24.0") is inside


def test_force_list() -> None:
    found = read_settings(IDS, {"VLLM_HOTFIX_FORCE": "deepseek-final-aux, nope"})
    assert found.forced_ids == {"deepseek-final-aux"}
    (problem,) = found.problems
    assert "VLLM_HOTFIX_FORCE" in problem and "'nope'" in problem


# vLLM's own check of VLLM_ variables (engine start-up, EngineArgs.create_engine_config): what the
# README says about our VLLM_HOTFIX_ names under `--fail-on-environ-validation`.
VALIDATE = """
from vllm.engine import arg_utils
from vllm.platforms import current_platform
import vllm.envs as envs
validate = getattr(current_platform, "validate_environ", None) or envs.validate_environ
assert "validate_environ(self.fail_on_environ_validation)" in open(arg_utils.__file__).read()
validate(False)
try:
    validate(True)
    print("accepted")
except ValueError as error:
    print(f"refused: {error}")
"""


@pytest.mark.vllm
@pytest.mark.parametrize("version", [BUG, FIXED, NEWEST])
def test_vllm_refuses_our_variables_only_under_fail_on_environ_validation(testenv, version: str) -> None:
    done = testenv.run(["-c", VALIDATE], version=version, VLLM_HOTFIX_VERIFY="1")
    assert done.returncode == 0, done.stderr[-3000:]
    said = "Unknown vLLM environment variable detected: VLLM_HOTFIX_VERIFY"
    assert said in done.stderr + done.stdout  # the warning without the flag
    assert done.stdout.splitlines()[-1] == f"refused: {said}"  # the error with it
