"""Environment switches and version strings: parsed strictly, invalid values reported, never raised."""

from __future__ import annotations

import pytest

from harness.testenv import BUG, NEWEST
from harness.ways_in import install_plugin
from vllm_hotfix.runtime.settings import read_settings
from vllm_hotfix.runtime.vllm_version import VllmVersion, parse_release

IDS = ("deepseek-final-aux", "cpu-sampler-fp64-gumbel")


@pytest.mark.parametrize("raw", ["1", "true", "YES", " on ", "all"])
def test_disable_all(raw: str) -> None:
    found = read_settings(IDS, {"VLLMHOTFIX_DISABLE": raw})
    assert found.disable_all and not found.problems
    assert all(found.is_disabled(i) for i in IDS)


@pytest.mark.parametrize("raw", ["", "0", "false", "off", "no"])
def test_disable_nothing(raw: str) -> None:
    found = read_settings(IDS, {"VLLMHOTFIX_DISABLE": raw})
    assert not any(found.is_disabled(i) for i in IDS) and not found.problems


def test_disable_a_list_of_ids() -> None:
    found = read_settings(IDS, {"VLLMHOTFIX_DISABLE": "cpu-sampler-fp64-gumbel, "})
    assert found.is_disabled("cpu-sampler-fp64-gumbel") and not found.is_disabled("deepseek-final-aux")
    assert not found.problems


def test_invalid_disable_names_the_variable_and_keeps_the_fixes_on() -> None:
    found = read_settings(IDS, {"VLLMHOTFIX_DISABLE": "deepseek-final-aux,typo"})
    assert found.is_disabled("deepseek-final-aux") and not found.is_disabled("cpu-sampler-fp64-gumbel")
    (problem,) = found.problems
    assert "VLLMHOTFIX_DISABLE" in problem and "'typo'" in problem
    assert all(i in problem for i in IDS) and "1/true/yes/on/all" in problem


@pytest.mark.parametrize(("raw", "strict"), [("1", True), ("on", True), ("0", False), ("", False)])
def test_strict(raw: str, strict: bool) -> None:
    assert read_settings(IDS, {"VLLMHOTFIX_STRICT": raw}).strict is strict


def test_invalid_strict_falls_back_to_not_strict() -> None:
    found = read_settings(IDS, {"VLLMHOTFIX_STRICT": "maybe"})
    assert not found.strict
    (problem,) = found.problems
    assert "VLLMHOTFIX_STRICT" in problem and "'maybe'" in problem and "1/true/yes/on" in problem


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
    found = read_settings(IDS, {"VLLMHOTFIX_FORCE": "deepseek-final-aux, nope"})
    assert found.forced_ids == {"deepseek-final-aux"}
    (problem,) = found.problems
    assert "VLLMHOTFIX_FORCE" in problem and "'nope'" in problem


def test_an_old_name_is_not_read_and_names_its_new_one() -> None:
    found = read_settings(IDS, {"VLLM_HOTFIX_DISABLE": "1", "VLLMHOTFIX_STRICT": "1"})
    assert not found.disable_all and found.strict
    assert found.problems == (
        "VLLM_HOTFIX_DISABLE is no longer read: rename it to VLLMHOTFIX_DISABLE"
        " (vLLM claims every VLLM_ name)",
    )


# Every variable the package or its tests read, as a user or the test suite sets them.
OURS = {
    "VLLMHOTFIX_DISABLE": "0",
    "VLLMHOTFIX_STRICT": "1",
    "VLLMHOTFIX_FORCE": "",
    "VLLMHOTFIX_VERIFY": "0",
    "VLLMHOTFIX_TEST_ENV": "/nowhere",
}

# vLLM's own check of VLLM_ variables, the one engine start-up runs (EngineArgs.create_engine_config).
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
UNKNOWN = "Unknown vLLM environment variable detected"


@pytest.mark.vllm
@pytest.mark.parametrize("version", [BUG, NEWEST])
def test_vllm_neither_warns_about_nor_refuses_our_variables(testenv, version: str) -> None:
    done = testenv.run(["-c", VALIDATE], version=version, **OURS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert UNKNOWN not in done.stderr + done.stdout
    assert done.stdout.splitlines()[-1] == "accepted"
    # The control: a name in vLLM's namespace (the old prefix) is warned about and refused.
    done = testenv.run(["-c", VALIDATE], version=version, VLLM_HOTFIX_DISABLE="0", **OURS)
    assert f"{UNKNOWN}: VLLM_HOTFIX_DISABLE" in done.stderr + done.stdout
    assert done.stdout.splitlines()[-1] == f"refused: {UNKNOWN}: VLLM_HOTFIX_DISABLE"


# A real engine start with vLLM's validation on (--fail-on-environ-validation), the hotfix installed
# as a plugin. --enforce-eager: vLLM validates the environment before it compiles anything.
START = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=64, fail_on_environ_validation=True)
out = llm.generate([{"prompt_token_ids": [5, 17, 42]}], SamplingParams(max_tokens=2, temperature=0))
print("generated", len(out[0].outputs[0].token_ids))
"""


@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.parametrize("version", [BUG, NEWEST])
def test_an_engine_starts_under_fail_on_environ_validation_with_our_variables(
    testenv, tiny_checkpoint, version: str, tmp_path
) -> None:
    ours = {**OURS, "VLLMHOTFIX_CACHE_DIR": str(tmp_path / "cache")}
    plugin = install_plugin(testenv, tmp_path / "plugin")
    done = testenv.run(["-c", START, str(tiny_checkpoint)], version=version, paths=(plugin,), **ours)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generated 2" in done.stdout.splitlines()
    assert UNKNOWN not in done.stderr + done.stdout
    assert "vllm-hotfix pid=" in done.stderr + done.stdout  # the hotfix was armed in that engine
