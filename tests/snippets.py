"""Run a short Python program against the real vLLM of the test environment and read its JSON."""

from __future__ import annotations

import json
import textwrap

from harness.testenv import BUG, TestEnv

PRELUDE = """
import json, sys
def emit(**facts):
    print("RESULT " + json.dumps(facts, default=str), flush=True)
"""


def run_snippet(testenv: TestEnv, code: str, version: str = BUG, **env: str) -> dict:
    """Run PRELUDE + code with the hotfix importable; return the dict passed to emit(), plus its log."""
    result = testenv.run(["-c", PRELUDE + textwrap.dedent(code)], version=version, hotfix=True, **env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, (
        f"snippet failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
    facts = json.loads(lines[-1][len("RESULT ") :])
    facts["_log"] = (result.stdout + result.stderr).splitlines()
    return facts


def log_lines(facts: dict, needle: str = "vllm-hotfix") -> list[tuple[str, str]]:
    """(level, line) of every line vLLM's logger printed that contains needle."""
    return [(line.split(" ", 1)[0], line) for line in facts["_log"] if needle in line]


def decision_lines(facts: dict, fix: str) -> list[tuple[str, str]]:
    return log_lines(facts, f"fix={fix} decision=")


def run_failing_snippet(testenv: TestEnv, code: str, version: str = BUG, **env: str) -> str:
    """Run a snippet that must fail; return its stderr."""
    result = testenv.run(["-c", PRELUDE + textwrap.dedent(code)], version=version, hotfix=True, **env)
    assert result.returncode != 0, f"expected a failure:\n{result.stdout[-2000:]}"
    return result.stderr
