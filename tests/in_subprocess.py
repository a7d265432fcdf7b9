"""Run a function of a test module in a fresh interpreter of the test environment.

The function is real code in the test module, linted with the rest: `run_in_subprocess` starts the
test environment's Python on the chosen vLLM with the hotfix importable, loads the function's
module by path, calls the function by name with JSON arguments, and returns what it returns (a
dict, through JSON) with the child's output lines added under "_log". Define such functions at
the top level of the module and import everything they need inside them: the test module's own
imports run in the child too, so they must stay light (no vllm_hotfix, vllm or torch).
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from harness.testenv import BUG, RESULT, TestEnv, child_result

CHILD = """\
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location({module!r}, {path!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
result = getattr(module, {name!r})(*json.loads({args!r}))
print({marker!r} + json.dumps(result, default=str), flush=True)
"""


def _run(
    testenv: TestEnv, function: Callable[..., Any], args: tuple[Any, ...], version: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    module = sys.modules[function.__module__]
    assert getattr(module, function.__name__, None) is function, (
        f"{function.__qualname__} must be a top-level function of {function.__module__}"
    )
    code = CHILD.format(
        module=f"_in_subprocess_{function.__module__.replace('.', '_')}",
        path=inspect.getsourcefile(function),
        name=function.__name__,
        args=json.dumps(args),
        marker=RESULT,
    )
    return testenv.run(["-c", code], version=version, hotfix=True, **env)


def run_in_subprocess(
    testenv: TestEnv, function: Callable[..., dict[str, Any]], *args: Any, version: str = BUG, **env: str
) -> dict[str, Any]:
    """`function(*args)` in a fresh interpreter on `version` with `env`: the dict it returns, plus
    "_log", the child's stdout and stderr lines. The child must succeed."""
    result = _run(testenv, function, args, version, env)
    facts = child_result(result.stdout)
    assert result.returncode == 0 and facts is not None, (
        f"{function.__name__} failed in the child:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
    assert isinstance(facts, dict), f"{function.__name__} must return a dict, not {facts!r}"
    facts["_log"] = (result.stdout + result.stderr).splitlines()
    return facts


def run_failing_in_subprocess(
    testenv: TestEnv, function: Callable[..., Any], *args: Any, version: str = BUG, **env: str
) -> str:
    """`function(*args)` in a fresh interpreter, which must fail; returns the child's stderr."""
    result = _run(testenv, function, args, version, env)
    assert result.returncode != 0, f"expected {function.__name__} to fail:\n{result.stdout[-2000:]}"
    return result.stderr


def log_lines(facts: dict[str, Any], needle: str = "vllm-hotfix") -> list[tuple[str, str]]:
    """(level, line) of every line vLLM's logger printed that contains needle."""
    return [(line.split(" ", 1)[0], line) for line in facts["_log"] if needle in line]


def decision_lines(facts: dict[str, Any], fix: str) -> list[tuple[str, str]]:
    return log_lines(facts, f"fix={fix} decision=")
