"""`vllm-hotfix clean`: it removes only this user's generated sources, by age, in the package's own
directories, never through a link, and never a file this process uses."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

from harness.testenv import REPO
from vllm_hotfix.commands import clean
from vllm_hotfix.runtime import codegen

DAY = 86400
OLD, RECENT = "deepseek_final_aux_0123456789abcdef.py", "cpu_sampler_fp64_gumbel_fedcba9876543210.py"
OLD_IN_TMP = "deepseek_v32_final_aux_nvidia_00112233445566ff.py"


def age(path: Path, days: float) -> Path:
    when = time.time() - days * DAY
    os.utime(path, (when, when), follow_symlinks=False)
    return path


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, mode=0o700)
    return path


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    """The two places of one user: XDG_CACHE_HOME's and the temporary directory's."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    return {
        "xdg": tmp_path / "xdg",
        "tmp": shared,
        "cache": private_dir(tmp_path / "xdg" / "vllm-hotfix" / "generated"),
        "temp": private_dir(shared / f"vllm-hotfix-{os.getuid()}" / "generated"),
        "victim": private_dir(tmp_path / "victim"),
    }


class Cleaned(subprocess.CompletedProcess[str]):
    """`vllm-hotfix clean`'s run, its stdout (the files, then the summary: results go to stdout)
    split into the files (`stdout`) and the summary's line (`summary`)."""

    summary: str


def run_clean(places: dict[str, Path], *args: str) -> Cleaned:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(places["xdg"]), TMPDIR=str(places["tmp"]))
    done = subprocess.run(
        [sys.executable, "-m", "vllm_hotfix", "clean", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(places["victim"]),
        timeout=120,
    )
    *files, summary = done.stdout.splitlines() or [""]
    assert " generated source(s) " in summary, done.stdout + done.stderr
    found = Cleaned(done.args, done.returncode, "".join(f"{line}\n" for line in files), done.stderr)
    found.summary = summary
    return found


def names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_clean_removes_old_generated_sources_and_nothing_else(places: dict[str, Path]) -> None:
    cache, temp, victim = places["cache"], places["temp"], places["victim"]
    for path, days in ((cache / OLD, 40), (cache / RECENT, 1), (temp / OLD_IN_TMP, 40)):
        path.write_text("# generated\n")
        age(path, days)
    untouchable = {
        "notes.txt": "not a generated name",
        ".tmp-1-0123456789abcdef.py": "a temporary name",
        "deepseek_final_aux_0123.py": "too short a digest",
    }
    for name in untouchable:
        (cache / name).write_text("x\n")
        age(cache / name, 40)
    (victim / "target.py").write_text("someone else's\n")
    link = cache / "deepseek_final_aux_aaaaaaaaaaaaaaaa.py"  # a link named like a generated file
    link.symlink_to(victim / "target.py")
    age(link, 40)
    private_dir(cache / "deepseek_final_aux_bbbbbbbbbbbbbbbb.py")  # a directory with such a name
    before = names(cache)

    dry = run_clean(places, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert sorted(dry.stdout.splitlines()) == sorted(
        [f"would remove {cache / OLD}", f"would remove {temp / OLD_IN_TMP}"]
    )
    assert dry.summary.startswith("would remove 2 generated source(s) not used for 30 days"), dry.summary
    assert names(cache) == before and names(temp) == [OLD_IN_TMP]

    done = run_clean(places)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == sorted(
        [f"removed {cache / OLD}", f"removed {temp / OLD_IN_TMP}"]
    )
    assert names(cache) == sorted(set(before) - {OLD}) and names(temp) == []
    assert (victim / "target.py").read_text() == "someone else's\n"

    assert run_clean(places, "--days", "0.5").stdout == f"removed {cache / RECENT}\n"
    for name in untouchable:
        assert (cache / name).exists()
    assert link.is_symlink() and (cache / "deepseek_final_aux_bbbbbbbbbbbbbbbb.py").is_dir()


def test_all_removes_whatever_the_age(places: dict[str, Path]) -> None:
    (places["cache"] / RECENT).write_text("# generated\n")
    assert run_clean(places).stdout == ""
    assert run_clean(places, "--all").stdout == f"removed {places['cache'] / RECENT}\n"


def test_a_place_that_is_not_the_packages_own_is_not_touched(places: dict[str, Path]) -> None:
    """The temporary place's `generated` replaced by a link (another user could plant it)."""
    victim = places["victim"]
    (victim / OLD).write_text("x\n")
    age(victim / OLD, 40)
    places["temp"].rmdir()
    places["temp"].symlink_to(victim)
    done = run_clean(places, "--all")
    assert done.returncode == 2 and done.stdout == ""
    assert f"not checked (not the package's own, or unreadable): {places['temp']}" in done.stderr
    assert names(victim) == [OLD]


def test_a_missing_place_has_nothing_to_remove_and_is_not_created(places: dict[str, Path]) -> None:
    places["temp"].rmdir()
    done = run_clean(places, "--all")
    assert done.returncode == 0 and not places["temp"].exists(), done.stderr


def test_a_file_this_process_uses_is_kept(places: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(places["xdg"]))
    monkeypatch.delenv("VLLMHOTFIX_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(places["tmp"]))
    used, unused = places["cache"] / OLD, places["cache"] / RECENT
    for path in (used, unused):
        path.write_text("# generated\n")
        age(path, 40)
    module = types.ModuleType(codegen.GENERATED_PREFIX + used.stem)
    module.__file__ = str(used)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    done = clean.clean(days=None)
    assert done.removed == [str(unused)] and done.kept == [str(used)] and used.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_another_users_file_is_not_removed(places: dict[str, Path]) -> None:
    theirs = places["cache"] / OLD
    theirs.write_text("# generated\n")
    os.chown(theirs, 54321, -1)
    age(theirs, 40)
    assert run_clean(places, "--all").stdout == "" and theirs.exists()
