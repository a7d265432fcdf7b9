"""The GitHub workflows parse, and say what docs/releasing.md promises: CI runs `.ci/run` on every
push and pull request; a release publishes only from a tag whose CI (the same workflow) passed, with
trusted publishing and no token; the weekly watch runs the release tooling, the offline tests on what
it recorded and the watch, and may open issues; the files and tests the workflows name exist."""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")  # PyYAML: vLLM's dependency, in the test environment

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"


def load(name: str) -> dict[str, Any]:
    document: dict[Any, Any] = yaml.safe_load((WORKFLOWS / name).read_text(encoding="utf-8"))
    document["on"] = document.pop(True, document.get("on"))  # YAML 1.1 reads the key `on` as true
    return document


def runs(job: dict[str, Any]) -> str:
    return "\n".join(step.get("run", "") for step in job.get("steps", []))


def test_every_workflow_parses_and_names_its_jobs() -> None:
    names = sorted(path.name for path in WORKFLOWS.glob("*.yml"))
    assert names == ["ci.yml", "release.yml", "watch-releases.yml"]
    for name in names:
        document = load(name)
        assert document["name"] and document["on"] and document["jobs"], name


def test_ci_runs_dot_ci_run_on_every_push_and_pull_request() -> None:
    ci = load("ci.yml")
    assert set(ci["on"]) == {"push", "pull_request", "workflow_call"}
    assert ci["on"]["push"] == {"branches": ["**"]}  # a tag's CI runs in release.yml
    (job,) = ci["jobs"].values()
    assert "bash .ci/run" in runs(job).splitlines()
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("bash scripts/test.sh")


def test_a_release_publishes_only_from_a_tag_whose_ci_passed_with_trusted_publishing() -> None:
    release = load("release.yml")
    assert release["on"] == {"push": {"tags": ["v*"]}}
    jobs = release["jobs"]
    gates = [name for name, job in jobs.items() if job.get("uses") == "./.github/workflows/ci.yml"]
    assert gates, "no job runs ci.yml"
    publishers = [
        name
        for name, job in jobs.items()
        if any(
            str(step.get("uses", "")).startswith("pypa/gh-action-pypi-publish")
            for step in job.get("steps", [])
        )
    ]
    (publish,) = publishers
    needs = jobs[publish]["needs"]
    assert set(gates) <= set([needs] if isinstance(needs, str) else needs)
    assert jobs[publish]["permissions"] == {"id-token": "write"}
    for job in jobs.values():
        for step in job.get("steps", []):
            assert not set(step.get("with") or {}) & {"password", "user"}, step  # no API token
    assert "secrets." not in (WORKFLOWS / "release.yml").read_text()


def test_the_weekly_watch_runs_the_tooling_the_tests_and_may_open_an_issue() -> None:
    watch = load("watch-releases.yml")
    (cron,) = [entry["cron"] for entry in watch["on"]["schedule"]]
    _minute, _hour, day, month, weekday = cron.split()
    assert (day, month) == ("*", "*") and weekday.isdigit(), f"not weekly: {cron}"
    assert watch["permissions"] == {"contents": "read", "issues": "write"}
    (job,) = watch["jobs"].values()
    script = runs(job)
    order = [
        "python -m harness.releases --json",
        "python scripts/refresh_sources.py",
        "python -m pytest",
        "python -m harness.releases.watch",
        "gh issue create",
    ]
    at = [script.find(command) for command in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at, strict=True))
    # every test path the workflow names exists (a renamed file would silently run nothing)
    words = shlex.split(re.sub(r"\\\n", " ", script[script.find("python -m pytest") :].split("2>&1")[0]))
    paths = [word for word in words if word.startswith("tests/")]
    assert paths and all(glob.glob(str(ROOT / path)) for path in paths), paths
    assert (ROOT / "harness" / "releases" / "watch.py").is_file()
