"""The package as it would be published: an sdist and a wheel built outside the source tree, their
metadata and contents, and the wheel installed into a clean venv without vLLM.

Built as `python -m build` does it (the sdist from the tree, the wheel from the unpacked sdist),
but offline: setuptools' own hooks and `pip wheel` with the running Python's setuptools.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import dist_checks
from harness.testenv import REPO, outside_checkout
from harness.wheel import build_sdist, build_wheel, copy_source, hotfix_wheel


def build_outputs(root: Path) -> set[str]:
    """What setuptools leaves behind in a tree it builds in: build/, dist/, *.egg-info."""
    found = {p for p in root.rglob("*.egg-info") if ".git" not in p.parts}
    found |= {root / "build", root / "dist"}
    return {p.relative_to(root).as_posix() for p in found if p.exists()}


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("packaging")
    before = build_outputs(REPO)
    sdist = build_sdist(copy_source(work / "src"), work / "dist")
    with tarfile.open(sdist) as tf:
        tf.extractall(work / "unpacked", filter="data")
    (unpacked,) = (work / "unpacked").iterdir()
    wheel = build_wheel(unpacked, work / "dist")
    left = build_outputs(REPO) - before
    for name in left:  # clean up, then fail in test_nothing_is_built_in_the_checkout
        shutil.rmtree(REPO / name, ignore_errors=True)
    yield {"sdist": sdist, "wheel": wheel, "work": work, "left": left}
    shutil.rmtree(work, ignore_errors=True)


def test_builds_outside_the_checkout_leave_nothing_in_it(dists) -> None:
    assert dists["left"] == set()
    assert not dists["sdist"].is_relative_to(REPO) and not dists["wheel"].is_relative_to(REPO)


def test_wheel_metadata_and_contents(dists) -> None:
    assert dist_checks.check_wheel(dists["wheel"]) == []


def test_wheel_entry_points_exactly(dists) -> None:
    with zipfile.ZipFile(dists["wheel"]) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = zf.read(name).decode()
    assert text.split() == [
        "[console_scripts]",
        *("vllm-hotfix", "=", "vllm_hotfix.commands.cli:main"),
        "[vllm.general_plugins]",
        *("vllm_hotfix", "=", "vllm_hotfix.plugin:register"),
    ]


def test_sdist_metadata_and_contents(dists) -> None:
    assert dist_checks.check_sdist(dists["sdist"]) == []


def test_the_checks_catch_a_wrong_wheel(dists, tmp_path: Path) -> None:
    """A wheel without its LICENSE, with tests/ inside and the plugin renamed fails the checks."""
    bad = tmp_path / dists["wheel"].name
    with zipfile.ZipFile(dists["wheel"]) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("/licenses/LICENSE"):
                continue
            if item.filename.endswith("/entry_points.txt"):
                data = data.replace(b"vllm_hotfix = ", b"vllm-hotfix = ")
            dst.writestr(item, data)
        dst.writestr("tests/test_x.py", "")
    problems = "\n".join(dist_checks.check_wheel(bad))
    assert "lacks vllm_hotfix-" in problems and "/licenses/LICENSE" in problems
    assert "wheel ships tests/test_x.py" in problems
    assert "entry points" in problems and "'vllm-hotfix': 'vllm_hotfix.plugin:register'" in problems


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_a_stale_build_directory_never_reaches_the_wheel(tmp_path: Path) -> None:
    """A checkout where `pip install .` once ran keeps build/lib/vllm_hotfix/, with modules deleted
    upstream since. Built as `python -m build` does it (the sdist, which leaves build/ out, then the
    wheel from it), the wheel holds exactly the package's modules; `pip wheel .` in the checkout,
    what the docs said before, ships the deleted ones."""
    source = copy_source(tmp_path / "src")
    stale = source / "build" / "lib" / "vllm_hotfix"
    (stale / "fixes").mkdir(parents=True)
    (stale / "deleted_upstream.py").write_text("DELETED = True\n")
    (stale / "fixes" / "retired_fix.py").write_text("RETIRED = True\n")
    planted = {"vllm_hotfix/deleted_upstream.py", "vllm_hotfix/fixes/retired_fix.py"}

    sdist = build_sdist(source, tmp_path / "dist")
    with tarfile.open(sdist) as tf:
        assert not [n for n in tf.getnames() if "/build/" in n]
        tf.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    wheel = build_wheel(unpacked, tmp_path / "dist")
    assert dist_checks.check_wheel(wheel) == []  # the package's files, exactly
    assert not _names(wheel) & planted

    in_place = build_wheel(source, tmp_path / "in-place")
    assert _names(in_place) & planted == planted
    assert any("extra ['vllm_hotfix/deleted_upstream.py'" in p for p in dist_checks.check_wheel(in_place))


def test_the_harness_installs_the_release_wheel(dists) -> None:
    """The wheel test venvs get (harness.wheel, built from the tree) is the one built from the sdist."""

    def contents(wheel: Path) -> dict[str, bytes]:
        with zipfile.ZipFile(wheel) as zf:
            return {n: zf.read(n) for n in zf.namelist()}

    assert contents(hotfix_wheel()) == contents(dists["wheel"])


def test_wheel_in_a_clean_venv_offline(dists, tmp_path: Path) -> None:
    """Installed without dependencies (offline): the console script and the plugin entry point work
    without vLLM (and without wrapt, which only patching needs)."""
    python = dist_checks.install_into_venv(dists["wheel"], tmp_path / "venv", deps=False)
    assert dist_checks.status_problems(python, tmp_path) == []


def test_pip_show_names_the_license(dists, tmp_path: Path) -> None:
    """`pip show` prints the License field only (pip 23.2, the test environment's, reads no
    License-Expression): the installed wheel's says Apache-2.0."""
    python = dist_checks.install_into_venv(dists["wheel"], tmp_path / "venv", deps=False)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python, "show"]
    shown = subprocess.run([*pip, "vllm-hotfix"], capture_output=True, text=True, check=True).stdout
    assert "License: Apache-2.0" in shown.splitlines(), shown


def uninstall_recipe() -> list[str]:
    """The commands of docs/usage.md's "Uninstalling", in its order."""
    text = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    section = text.split("\n## Uninstalling\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, re.MULTILINE)


def test_the_uninstall_recipe_leaves_nothing_that_runs(dists, tmp_path: Path) -> None:
    """docs/usage.md's three steps, run in a venv where the site hook was installed: no line at a
    Python start, nothing of the package in site-packages. Without the first step the hook's .pth
    stays, and every start prints its line."""
    assert uninstall_recipe() == [
        "vllm-hotfix uninstall-site-hook",
        "vllm-hotfix clean --all",
        "pip uninstall vllm-hotfix",
    ]
    env = {**dist_checks.clean_environ(), "XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, check=True)

    def steps(venv: Path, skip_first: bool) -> tuple[str, list[str]]:
        python = dist_checks.install_into_venv(dists["wheel"], venv, deps=False)
        script = str(Path(python).parent / "vllm-hotfix")
        run(script, "install-site-hook")
        if not skip_first:
            run(script, "uninstall-site-hook")
        run(script, "clean", "--all")
        run(
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "--python",
            python,
            "uninstall",
            "-y",
            "vllm-hotfix",
        )
        started = run(python, "-c", "pass")
        (site,) = (venv / "lib").glob("python3*/site-packages")
        return started.stdout + started.stderr, sorted(p.name for p in site.iterdir() if "hotfix" in p.name)

    assert steps(tmp_path / "all-three", skip_first=False) == ("", [])
    said, left = steps(tmp_path / "without-the-first", skip_first=True)
    assert left == ["vllm_hotfix_site_hook.pth"] and said.startswith("vllm-hotfix: site hook skipped:"), said


def _pypi_reachable() -> str | None:
    try:
        urllib.request.urlopen("https://pypi.org/simple/wrapt/", timeout=10).close()
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        return str(error)
    return None


@pytest.mark.network
def test_pip_install_of_the_wheel_pulls_wrapt(dists, tmp_path: Path) -> None:
    """`pip install <wheel>`, as the README says: wrapt comes from PyPI, nothing else; status works."""
    error = _pypi_reachable()
    if error:
        pytest.skip(f"PyPI cannot be reached: {error}")
    python = dist_checks.install_into_venv(dists["wheel"], tmp_path / "venv", deps=True)
    listed = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(sorted(d.name for d in m.distributions()))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=outside_checkout(),
    ).stdout
    assert listed.strip() == "['vllm-hotfix', 'wrapt']"
    assert dist_checks.status_problems(python, tmp_path) == []
