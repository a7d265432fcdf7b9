"""The generated-source store in a hostile shared temporary directory.

Another local user can create any name under /tmp before us. Each case plants one such thing where
the package will look, then builds the fixed function in a child process with a timeout (so a hang
fails instead of blocking the run) and an address-space limit (so reading /dev/zero cannot exhaust
the machine): the fix must still be applied, nothing may be written through a link, and whatever
was planted is either replaced by our own regular file or makes the package pass the place over.

The first part drives the store through codegen; the second runs `vllm-hotfix status` against the
stand-in vLLM (harness/stand_in_vllm.py), with the user's cache directory unusable so that the
temporary directory is the place used, as in the reported cases.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import stand_in_vllm
from harness.testenv import REPO
from tests.test_codegen import build
from vllm_hotfix.runtime import store

UID = os.getuid()
TOP = f"vllm-hotfix-{UID}"
OTHER_UID = 54321
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
TIMEOUT = 120


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A stand-in for /tmp: world-writable and sticky."""
    path = tmp_path / "shared-tmp"
    path.mkdir()
    path.chmod(0o1777)
    return path


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory a planted link points to: nothing may appear in it."""
    path = tmp_path / "victim"
    path.mkdir()
    return path


def own_dir(shared: Path) -> Path:
    """Where the package puts generated sources under a temporary directory."""
    return shared / TOP / "generated"


def make_own_dir(shared: Path) -> Path:
    own = own_dir(shared)
    own.mkdir(parents=True, mode=0o700)
    return own


# Each case plants something under `shared` (`name` is the generated file's name) and says whether
# the package must replace it with its own file ("replaced") or pass the place over ("refused").
def fifo(shared: Path, name: str, victim: Path) -> str:
    os.mkfifo(make_own_dir(shared) / name)
    return "replaced"


def not_utf8(shared: Path, name: str, victim: Path) -> str:
    (make_own_dir(shared) / name).write_bytes(b"\xff\xfe\x00 not UTF-8 \xc3\x28\n")
    return "replaced"


def link_to_dev_zero(shared: Path, name: str, victim: Path) -> str:
    (make_own_dir(shared) / name).symlink_to("/dev/zero")
    return "replaced"


def link_to_a_file_elsewhere(shared: Path, name: str, victim: Path) -> str:
    (victim / "target.py").write_text("someone else's\n")
    (make_own_dir(shared) / name).symlink_to(victim / "target.py")
    return "replaced"


def huge_sparse_file(shared: Path, name: str, victim: Path) -> str:
    with open(make_own_dir(shared) / name, "wb") as handle:
        handle.truncate(64 << 30)  # 64 GiB of zeros, no disk used
    return "replaced"


def directory_at_the_name(shared: Path, name: str, victim: Path) -> str:
    (make_own_dir(shared) / name).mkdir()
    return "refused"


def generated_is_a_link(shared: Path, name: str, victim: Path) -> str:
    (shared / TOP).mkdir(mode=0o700)
    own_dir(shared).symlink_to(victim)
    return "refused"


def top_is_a_link(shared: Path, name: str, victim: Path) -> str:
    (shared / TOP).symlink_to(victim)
    return "refused"


def generated_is_a_fifo(shared: Path, name: str, victim: Path) -> str:
    (shared / TOP).mkdir(mode=0o700)
    os.mkfifo(own_dir(shared))
    return "refused"


def top_owned_by_another_user(shared: Path, name: str, victim: Path) -> str:
    make_own_dir(shared)
    os.chown(shared / TOP, OTHER_UID, -1)
    return "refused"


def generated_owned_by_another_user(shared: Path, name: str, victim: Path) -> str:
    os.chown(make_own_dir(shared), OTHER_UID, -1)
    return "refused"


def group_writable(shared: Path, name: str, victim: Path) -> str:
    (shared / TOP).mkdir(mode=0o700)
    (shared / TOP).chmod(0o770)
    return "refused"


def world_writable_generated(shared: Path, name: str, victim: Path) -> str:
    make_own_dir(shared).chmod(0o777)
    return "refused"


def base_writable_by_all_without_sticky_bit(shared: Path, name: str, victim: Path) -> str:
    shared.chmod(0o777)
    return "refused"


def base_owned_by_another_user(shared: Path, name: str, victim: Path) -> str:
    os.chown(shared, OTHER_UID, -1)
    return "refused"


Plant = Callable[[Path, str, Path], str]
CASES: list[object] = [
    fifo,
    not_utf8,
    link_to_dev_zero,
    link_to_a_file_elsewhere,
    huge_sparse_file,
    directory_at_the_name,
    generated_is_a_link,
    top_is_a_link,
    generated_is_a_fifo,
    pytest.param(top_owned_by_another_user, marks=AS_ROOT),
    pytest.param(generated_owned_by_another_user, marks=AS_ROOT),
    group_writable,
    world_writable_generated,
    base_writable_by_all_without_sticky_bit,
    pytest.param(base_owned_by_another_user, marks=AS_ROOT),
]


def case_id(case: object) -> str:
    return getattr(case, "__name__", str(case))


def run_child(code: str, timeout: float = TIMEOUT, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `code` with this checkout importable, limited to 2 GiB of address space and `timeout`."""
    limited = "import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n" + code
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    clean["PYTHONPATH"] = str(REPO)
    try:
        return subprocess.run(
            [sys.executable, "-c", limited],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**clean, **env},
            cwd=str(REPO),
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"hung: no answer after {timeout} s (stderr: {error.stderr!r})")


def assert_outcome(expected: str, filename: str, own: Path, name: str, victim: Path, text: str) -> None:
    if expected == "replaced":
        path = own / name
        assert filename == str(path)
        found = os.lstat(path)
        assert stat.S_ISREG(found.st_mode) and found.st_uid == os.geteuid()
        assert path.read_text(encoding="utf-8") == text
    else:
        assert filename.startswith("<"), f"a refused place was used: {filename}"
    assert sorted(p.name for p in victim.iterdir()) in ([], ["target.py"])
    if (victim / "target.py").exists():
        assert (victim / "target.py").read_text() == "someone else's\n"


# -- the store, through codegen -------------------------------------------------------------------

BUILD_IN_TEMP = """
import json, os
from tests.test_codegen import build
from vllm_hotfix.runtime import store
place = store.Place({base!r}, ({top!r}, "generated"))
generated = build([place])
print(json.dumps({{"filename": generated.filename, "value": generated.function(1),
                  "problem": store.problem(place)}}))
"""


def generated_name_and_text(tmp_path: Path) -> tuple[str, str]:
    clean = tmp_path / "clean"
    generated = build([store.Place(str(clean))])
    path = Path(generated.filename)
    return path.name, path.read_text(encoding="utf-8")


@pytest.mark.parametrize("plant", CASES, ids=case_id)
def test_a_hostile_temporary_directory_never_stops_the_fix(
    plant: Plant, shared: Path, victim: Path, tmp_path: Path
) -> None:
    name, text = generated_name_and_text(tmp_path)
    expected = plant(shared, name, victim)
    done = run_child(BUILD_IN_TEMP.format(base=str(shared), top=TOP))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["value"] == 13, "the fixed function was not built"
    assert_outcome(expected, result["filename"], own_dir(shared), name, victim, text)
    if expected == "refused":
        assert result["problem"], "a refused place must say why"


def test_created_directories_and_files_are_private(shared: Path, tmp_path: Path) -> None:
    generated = build([store.Place(str(shared), (TOP, "generated"))])
    path = Path(generated.filename)
    assert path.parent == own_dir(shared)
    for directory in (shared / TOP, own_dir(shared)):
        assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    assert [p.name for p in own_dir(shared).iterdir()] == [path.name]  # no temporary file left


def test_an_identical_file_is_reused_not_rewritten(tmp_path: Path) -> None:
    place = store.Place(str(tmp_path), ("generated",))
    first = Path(build([place]).filename)
    inode = os.lstat(first).st_ino
    week_ago = time.time() - 7 * 86400
    os.utime(first, (week_ago, week_ago))
    assert Path(build([place]).filename) == first and os.lstat(first).st_ino == inode
    assert os.lstat(first).st_mtime > time.time() - 3600, "reuse must refresh the file's age"


def test_the_next_place_is_used_when_one_is_refused(shared: Path, victim: Path, tmp_path: Path) -> None:
    top_is_a_link(shared, "", victim)
    second = store.Place(str(tmp_path / "second"), ("generated",))
    generated = build([store.Place(str(shared), (TOP, "generated")), second])
    assert Path(generated.filename).parent == Path(second.path) and generated.function(1) == 13
    assert list(victim.iterdir()) == []


def test_the_base_the_user_gives_may_be_a_link(tmp_path: Path) -> None:
    """VLLMHOTFIX_CACHE_DIR (or TMPDIR) is the user's choice: a link there is followed."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    generated = build([store.Place(str(tmp_path / "link"), ("generated",))])
    assert (real / "generated" / Path(generated.filename).name).is_file()


# -- `vllm-hotfix status` on the stand-in vLLM, the user's cache directory unusable ----------------

STATUS_CASES = [
    fifo,
    not_utf8,
    link_to_dev_zero,
    generated_is_a_link,
    pytest.param(top_owned_by_another_user, marks=AS_ROOT),
    group_writable,
]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stand_in_vllm.write(tmp_path_factory.mktemp("stand-in-vllm"))


def status(stand_in: Path, shared: Path, tmp_path: Path, **env: str) -> dict:
    blocked = tmp_path / "no-cache-here"
    blocked.write_text("")  # a file: the user's cache directory cannot be made under it
    done = run_child(
        "from vllm_hotfix.commands.cli import main; raise SystemExit(main(['status', '--json']))",
        PYTHONPATH=os.pathsep.join([str(stand_in), str(REPO)]),
        TMPDIR=str(shared),
        XDG_CACHE_HOME=str(blocked / "cache"),
        **env,
    )
    assert done.returncode == 0, (
        f"status exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    fixes = {fix["fix"]: fix for fix in json.loads(done.stdout)["fixes"]}
    return fixes["deepseek-final-aux"]


@pytest.mark.parametrize("plant", STATUS_CASES, ids=case_id)
def test_status_applies_the_fix_in_a_hostile_temporary_directory(
    plant: Plant, stand_in: Path, shared: Path, victim: Path, tmp_path: Path
) -> None:
    clean = tmp_path / "clean-tmp"
    clean.mkdir()
    clean.chmod(0o1777)
    reference = status(stand_in, clean, tmp_path)
    assert reference["decision"] == "patched"
    path = Path(reference["generated_file"])
    assert path.parent == own_dir(clean)
    name, text = path.name, path.read_text(encoding="utf-8")

    expected = plant(shared, name, victim)
    fix = status(stand_in, shared, tmp_path)
    assert fix["decision"] == "patched", fix["reason"]
    assert_outcome(expected, fix["generated_file"], own_dir(shared), name, victim, text)
    if expected == "refused":
        assert any("no usable directory" in note for note in fix["notes"]), fix["notes"]


def test_a_refused_cache_dir_says_why_and_where_the_source_went(
    stand_in: Path, shared: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "shared-cache"
    cache.mkdir()
    cache.chmod(0o777)  # writable by everyone, not sticky: another user could swap `generated`
    fix = status(stand_in, shared, tmp_path, VLLMHOTFIX_CACHE_DIR=str(cache))
    assert fix["decision"] == "patched"
    assert Path(fix["generated_file"]).parent == own_dir(shared)
    (note,) = fix["notes"]
    assert note.startswith(f"VLLMHOTFIX_CACHE_DIR={cache} cannot hold generated sources")
    assert "writable by group or others and not sticky" in note and str(own_dir(shared)) in note
    assert not (cache / "generated").exists()
