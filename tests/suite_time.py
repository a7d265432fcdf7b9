"""The suite's wall time, said at the end of every run, and a loud warning once it passes 60 minutes.

CI's hard limit is 90 minutes with the environment to build, and the suite grows with every change:
this shows the growth before a run fails on the limit. It never fails a run. Under pytest-xdist the
controller, which sees the whole session, writes the lines; workers write nothing. The threshold
is VLLMHOTFIX_SUITE_WARN_MINUTES (default 60; tests/test_suite_time.py lowers it). Loaded by
tests/conftest.py, or on its own with `-p tests.suite_time`.
"""

from __future__ import annotations

import os
import time

import pytest

THRESHOLD_VAR = "VLLMHOTFIX_SUITE_WARN_MINUTES"
DEFAULT_MINUTES = 60.0
WARNING = "SUITE TIME WARNING"

PLUGIN_NAME = "vllm-hotfix-suite-time"


def threshold_minutes() -> tuple[float, str]:
    """The threshold, and a note when the variable's value could not be used (the default is, then)."""
    value = os.environ.get(THRESHOLD_VAR, "").strip()
    if not value:
        return DEFAULT_MINUTES, ""
    try:
        minutes = float(value)
    except ValueError:
        minutes = -1.0
    if not minutes >= 0:  # negative, or not a number (NaN compares false)
        return DEFAULT_MINUTES, f" ({THRESHOLD_VAR}={value!r} is not a number of minutes: default used)"
    return minutes, ""


class SuiteTime:
    """Times the session from its start to the terminal summary, and sums the tests' own durations."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.tests_seconds = 0.0

    def pytest_sessionstart(self) -> None:
        self.start = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Every phase of every test; under xdist the controller receives every worker's reports."""
        self.tests_seconds += report.duration

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        wall = time.monotonic() - self.start
        minutes, note = threshold_minutes()
        said = (
            f"suite wall time {wall:.1f} s ({wall / 60:.1f} min; the tests' own time, summed over"
            f" workers: {self.tests_seconds:.1f} s); warning above {minutes:g} min ({THRESHOLD_VAR}){note}"
        )
        if wall <= minutes * 60:
            terminalreporter.write_line(said)
            return
        terminalreporter.write_sep("!", WARNING, red=True, bold=True)
        terminalreporter.write_line(
            f"{WARNING}: {said}. CI's limit is 90 min with the environment to build: share engine"
            " runs between tests or move slow repeats to the long suite (docs/development.md).",
            red=True,
            bold=True,
        )
        terminalreporter.write_sep("!", WARNING, red=True, bold=True)


def register(config: pytest.Config) -> None:
    """Once per run, in the process that reports: not in a pytest-xdist worker (it sets workerinput)."""
    if hasattr(config, "workerinput") or config.pluginmanager.has_plugin(PLUGIN_NAME):
        return
    config.pluginmanager.register(SuiteTime(), PLUGIN_NAME)


def pytest_configure(config: pytest.Config) -> None:
    """Loaded with `-p tests.suite_time`."""
    register(config)
