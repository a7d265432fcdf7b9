"""One version story: main carries a development version (`X.Y.Z.devN`) until a release is tagged;
the CHANGELOG's top section is Unreleased and its dated sections are exactly the versions
docs/releasing.md lists; `-V` and `status --json` name the version and, run from a git checkout, the
checkout, its commit and whether the package differs from it (what git itself says), and nothing of
the kind from a copy without .git (installed from a wheel: harness/dist_checks.py checks that too).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.testenv import REPO
from vllm_hotfix._version import __version__

VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.dev(\d+))?$")
DATED = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.MULTILINE)


def release(version: str) -> tuple[int, int, int]:
    found = VERSION.match(version)
    assert found, f"{version} is neither X.Y.Z nor X.Y.Z.devN"
    return int(found[1]), int(found[2]), int(found[3])


def changelog_releases() -> dict[str, str]:
    return dict(DATED.findall((REPO / "CHANGELOG.md").read_text(encoding="utf-8")))


def releasing_md_versions() -> dict[str, str]:
    """docs/releasing.md's table of versions: `| X.Y.Z | YYYY-MM-DD | ...`."""
    text = (REPO / "docs" / "releasing.md").read_text(encoding="utf-8")
    return dict(re.findall(r"^\| (\d+\.\d+\.\d+) \| (\d{4}-\d{2}-\d{2}) \|", text, re.MULTILINE))


def test_main_carries_a_development_version_until_a_tag() -> None:
    """A development version is above every version made, and has no dated section of its own; a
    release version (only on the commit a tag names) has one."""
    dated = changelog_releases()
    if ".dev" in __version__:
        assert all(release(__version__) > release(made) for made in dated), (__version__, dated)
    else:
        assert __version__ in dated, f"{__version__} is a release, but CHANGELOG.md has no section for it"
        if (REPO / ".git").exists():  # the tag's CI (release.yml) checks out the tagged commit
            tags = git(REPO, "tag", "--points-at", "HEAD").split()
            assert f"v{__version__}" in tags, f"{__version__} is a release, but this commit is not tagged"


def test_the_changelog_and_releasing_md_tell_the_same_versions() -> None:
    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## .*$", text, re.MULTILINE)
    assert headings[0] == "## [Unreleased]", headings[:2]
    assert changelog_releases() == releasing_md_versions()
    assert releasing_md_versions(), "docs/releasing.md lists no version"


def git(cwd: Path, *args: str) -> str:
    identity = ["-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false"]
    done = subprocess.run(["git", *identity, *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def hotfix(source: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`python -S -m vllm_hotfix ...` from `source` (no site-packages: no vLLM, whatever this Python
    has), outside it."""
    env = {"PYTHONPATH": str(source), "PATH": "/usr/bin:/bin", "HOME": str(source.parent)}
    return subprocess.run(
        [sys.executable, "-S", "-m", "vllm_hotfix", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=source.parent,
    )


def version_document(source: Path) -> dict[str, object]:
    done = hotfix(source, "-V", "--json")
    assert done.returncode == 0, done.stderr
    document: dict[str, object] = json.loads(done.stdout)
    return document


def test_this_checkout_names_its_commit() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not run from a git checkout")
    commit = git(REPO, "rev-parse", "HEAD")
    document = version_document(REPO)
    assert document["version"] == __version__
    assert isinstance(document["checkout"], dict)
    assert (document["checkout"]["path"], document["checkout"]["commit"]) == (str(REPO), commit)
    assert str(document["reason"]).startswith(f"vllm-hotfix {__version__} (checkout {REPO} at {commit[:12]}")


@pytest.fixture
def own_repository(tmp_path: Path) -> Path:
    """The package and pyproject.toml, committed in a git repository of their own."""
    root = tmp_path / "checkout"
    shutil.copytree(REPO / "vllm_hotfix", root / "vllm_hotfix", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "a build")
    return root


def test_a_checkout_its_commit_and_its_changes(own_repository: Path) -> None:
    """The commit is the one git gives for that checkout (not this repository's), and a change to
    the package, or a new file in it, is said; `status --json` carries the same."""
    commit = git(own_repository, "rev-parse", "HEAD")
    clean = {"path": str(own_repository), "commit": commit, "modified": False}
    assert version_document(own_repository)["checkout"] == clean
    status = json.loads(hotfix(own_repository, "status", "--json").stdout)
    assert (status["hotfix_version"], status["hotfix_checkout"]) == (__version__, clean)

    (own_repository / "vllm_hotfix" / "stray.py").write_text("")
    document = version_document(own_repository)
    assert document["checkout"] == {**clean, "modified": True}
    said = f"vllm-hotfix {__version__} (checkout {own_repository} at {commit[:12]}, modified)"
    assert document["reason"] == said
    assert hotfix(own_repository, "-V").stdout == said + "\n"


def test_a_copy_without_git_names_only_the_version(own_repository: Path) -> None:
    shutil.rmtree(own_repository / ".git")
    document = version_document(own_repository)
    assert (document["reason"], document["checkout"]) == (f"vllm-hotfix {__version__}", None)
    status = json.loads(hotfix(own_repository, "status", "--json").stdout)
    assert status["hotfix_checkout"] is None
