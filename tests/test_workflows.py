"""The GitHub workflows parse, and say what docs/releasing.md promises: CI runs `.ci/run` on every
push and pull request; a release publishes only from a tag whose CI (the same workflow) passed, with
trusted publishing and no token; the weekly watch runs the release tooling, the offline tests on what
it recorded and the watch, and may open issues; the files and tests the workflows name exist.

And they pass the checks the ecosystem runs on workflows: zizmor's offline audits and actionlint
find nothing, every action is pinned to a full commit SHA
with its tag in a comment, on a major that runs on node24, kept current by Dependabot; no checkout
keeps its credentials, and each job has only the permissions it names."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
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
    gates = [name for name, job in jobs.items() if job.get("uses") == "$/.github/workflows/ci.yml"]
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
    (job,) = watch["jobs"].values()
    assert job["permissions"] == {"contents": "read", "issues": "write"}
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


# The oldest major of each action that runs on node24 (GitHub removes the node20 runtime).
NODE24_SINCE = {
    "actions/checkout": 5,
    "actions/setup-python": 6,
    "actions/upload-artifact": 6,
    "actions/download-artifact": 7,
}
DOCKER_OR_COMPOSITE = {"pypa/gh-action-pypi-publish"}  # no JavaScript runtime to age
PINNED = re.compile(r"^(?P<action>[\w.-]+/[\w.-]+)@(?P<sha>[0-9a-f]{40}) # v(?P<major>\d+)\.\d+\.\d+$")


def pin_problems(text: str) -> list[str]:
    """Each `uses:` of a workflow that is not `owner/repo@<40-hex SHA> # vX.Y.Z` on a node24 major
    (a reusable workflow of this repository, `$/.github/workflows/...`, aside)."""
    problems = []
    for line in text.splitlines():
        found = re.match(r"^\s*(?:- )?uses:\s*(.+?)\s*$", line)
        if not found or found[1].startswith("$/.github/workflows/"):
            continue
        pinned = PINNED.match(found[1])
        if not pinned:
            problems.append(f"not pinned to a commit with its tag: {found[1]}")
        elif pinned["action"] not in DOCKER_OR_COMPOSITE | set(NODE24_SINCE):
            problems.append(f"an action this test does not know the runtime of: {pinned['action']}")
        elif int(pinned["major"]) < NODE24_SINCE.get(pinned["action"], 0):
            problems.append(f"{pinned['action']} v{pinned['major']} runs on node20: {found[1]}")
    return problems


def workflow_texts() -> dict[str, str]:
    return {path.name: path.read_text(encoding="utf-8") for path in sorted(WORKFLOWS.glob("*.yml"))}


def test_every_action_is_pinned_to_a_commit_with_its_tag_on_a_node24_major() -> None:
    assert {name: pin_problems(text) for name, text in workflow_texts().items()} == {
        name: [] for name in workflow_texts()
    }


@pytest.mark.parametrize(
    ("uses", "said"),
    [
        ("actions/checkout@v4", "not pinned"),
        ("actions/checkout@v5  # v5.0.0", "not pinned"),
        ("actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683", "not pinned"),
        ("actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2", "runs on node20"),
        ("pypa/gh-action-pypi-publish@release/v1", "not pinned"),
        ("someone/else@3d3c42e5aac5ba805825da76410c181273ba90b1 # v7.0.1", "does not know"),
    ],
)
def test_the_pin_check_catches(uses: str, said: str) -> None:
    (problem,) = pin_problems(f"    steps:\n      - uses: {uses}\n")
    assert said in problem


def test_dependabot_keeps_the_pinned_actions_current() -> None:
    config = yaml.safe_load((ROOT / ".github" / "dependabot.yml").read_text(encoding="utf-8"))
    (update,) = [u for u in config["updates"] if u["package-ecosystem"] == "github-actions"]
    assert update["directory"] == "/" and update["schedule"]["interval"] in ("daily", "weekly")


def test_no_checkout_keeps_its_credentials_and_each_job_names_its_permissions() -> None:
    for name in workflow_texts():
        document = load(name)
        assert document["permissions"] == {}, f"{name}: the workflow grants {document['permissions']}"
        for job_name, job in document["jobs"].items():
            assert "permissions" in job, f"{name}: job {job_name} names no permissions"
            for step in job.get("steps", []):
                if str(step.get("uses", "")).startswith("actions/checkout@"):
                    assert (step.get("with") or {}).get("persist-credentials") is False, (name, job_name)
    # only the watch writes (issues), only the upload gets an OIDC token
    granted = {
        (name, job_name, scope, level)
        for name in workflow_texts()
        for job_name, job in load(name)["jobs"].items()
        for scope, level in job["permissions"].items()
        if level == "write"
    }
    assert granted == {
        ("watch-releases.yml", "watch", "issues", "write"),
        ("release.yml", "publish", "id-token", "write"),
    }


def _tool(name: str) -> str | None:
    """The tool from the test environment's venv (scripts/build-test-env.sh), else from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def _offline_environ() -> dict[str, str]:
    """No GitHub token: zizmor runs its offline audits only, as it does for a contributor."""
    tokens = ("GH_TOKEN", "GITHUB_TOKEN", "ZIZMOR_GITHUB_TOKEN")
    return {key: value for key, value in os.environ.items() if key not in tokens}


def zizmor_findings(root: Path) -> list[dict[str, object]]:
    """zizmor's findings (offline, every audit on, nothing ignored) on the workflows and Dependabot's config
    under `root`."""
    zizmor = _tool("zizmor")
    if zizmor is None:
        pytest.fail("zizmor is not installed: scripts/build-test-env.sh installs it (TEST_TOOLS)")
    inputs = [str(p) for p in (root / ".github" / "workflows", root / ".github" / "dependabot.yml")]
    done = subprocess.run(
        [zizmor, "--offline", "--format", "json", "--no-progress", *inputs],
        capture_output=True,
        text=True,
        env=_offline_environ(),
    )
    assert done.returncode in (0, 11, 12, 13, 14), done.stderr[-3000:]  # 1x: findings at a severity
    findings: list[dict[str, object]] = json.loads(done.stdout)
    return findings


def test_zizmor_offline_finds_nothing() -> None:
    findings = zizmor_findings(ROOT)
    assert [(f["ident"], f["desc"]) for f in findings] == []


def test_zizmor_finds_what_the_workflows_had(tmp_path: Path) -> None:
    """The same run on a copy whose CI checks out with actions/checkout@v4 (unpinned, credentials
    kept) and whose watch grants `issues: write` to the whole workflow."""
    shutil.copytree(ROOT / ".github", tmp_path / ".github")
    ci = tmp_path / ".github" / "workflows" / "ci.yml"
    text = ci.read_text(encoding="utf-8")
    pinned = r"actions/checkout@\S+ # \S+\n\s+with:\n\s+persist-credentials: false"
    old = re.sub(pinned, "actions/checkout@v4", text)
    assert old != text
    ci.write_text(old, encoding="utf-8")
    found = {str(f["ident"]) for f in zizmor_findings(tmp_path)}
    assert {"unpinned-uses", "artipacked"} <= found, found


def actionlint_output(root: Path, *files: Path) -> tuple[int, str]:
    """actionlint's exit code and findings on `files` (default: every workflow under `root`)."""
    actionlint = _tool("actionlint")
    if actionlint is None:
        pytest.fail("actionlint is not installed: scripts/build-test-env.sh installs it (TEST_TOOLS)")
    paths = [str(f) for f in files] or sorted(glob.glob(str(root / ".github" / "workflows" / "*.yml")))
    done = subprocess.run([actionlint, "-no-color", *paths], capture_output=True, text=True, cwd=root)
    return done.returncode, done.stdout + done.stderr


def test_actionlint_finds_nothing() -> None:
    assert actionlint_output(ROOT) == (0, "")


def test_actionlint_finds_what_the_workflows_had(tmp_path: Path) -> None:
    """The same run on a copy of CI's workflow that checks out with actions/checkout@v4 (node20)."""
    ci = tmp_path / "ci.yml"
    text = (WORKFLOWS / "ci.yml").read_text(encoding="utf-8")
    old = re.sub(r"actions/checkout@\S+ # \S+", "actions/checkout@v4", text)
    assert old != text
    ci.write_text(old, encoding="utf-8")
    code, found = actionlint_output(tmp_path, ci)
    assert code == 1 and 'runtime "node20" is deprecated' in found, found
