"""Where generated sources are written: private directories, regular files, bounded reads.

The last place tried is under the shared temporary directory, where any local user can create a
name before us: a FIFO (an open() that blocks forever), a symbolic link (to another directory, to
/dev/zero), a directory of their own. So nothing found there is trusted:

- A place is a base directory, used as given (the user's cache directory, or the system's temporary
  directory; created if missing, symbolic links in it followed), and the directories this package
  creates under it. The base must be owned by this user or root, and not writable by group or
  others unless sticky (as /tmp is). Each created directory is made with mode 0700 and opened
  relative to its parent with O_NOFOLLOW: a symbolic link there is refused, and so is a directory
  not owned by this user or writable by group or others.
- Inside it, a file is read only if lstat says it is a regular file owned by this user of exactly
  the expected size, then opened with O_NOFOLLOW | O_NONBLOCK and checked again with fstat, and
  never more than the expected size + 1 bytes are read; the comparison is of bytes, so nothing is
  decoded. Anything else at the name is replaced: a new file is written under a private temporary
  name and renamed over it (which never writes through what was there), then read back. A file
  reused as it is gets its modification time set to now (never through a link), so its age says
  when a process last used it (`vllm-hotfix clean` removes files by that age).
- Any error, of any kind, makes that place unusable; the caller tries the next one.

`files()` and `remove()` (for `vllm-hotfix clean`) open a place with the same checks, creating
nothing: they list and unlink only regular files of this user, by name in the opened directory.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_OPEN_DIR = os.O_RDONLY | _DIRECTORY | _NONBLOCK | _CLOEXEC
_SUPPORTED = bool(_DIRECTORY and _NOFOLLOW) and {os.open, os.mkdir, os.rename, os.stat, os.unlink} <= (
    os.supports_dir_fd
)


@dataclass(frozen=True)
class Place:
    """A directory for generated sources: `base` as given, then `parts`, created by this package."""

    base: str
    parts: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return os.path.join(os.path.abspath(self.base), *self.parts)


class Unusable(Exception):
    """This place cannot hold generated sources safely."""


_passed_over: dict[str, str] = {}  # a place's path -> why save() last passed it over


def save(places: Sequence[Place], name: str, text: str) -> str | None:
    """The path of a file named `name` holding exactly `text`, in the first usable place.

    None when no place is usable. Never raises (short of KeyboardInterrupt and the like).
    """
    data = text.encode("utf-8")
    for place in places:
        try:
            _save_in(place, name, data)
        except Exception as error:  # every failure means "not here"
            _passed_over[place.path] = f"{type(error).__name__}: {error}"
            continue
        _passed_over.pop(place.path, None)
        return os.path.join(place.path, name)
    return None


def problem(place: Place) -> str | None:
    """Why the last save() passed `place` over; None if it did not (or was not asked to)."""
    return _passed_over.get(place.path)


def check(place: Place) -> str | None:
    """Why `place` cannot hold generated sources now (the checks save() makes), None when it can.

    Creates nothing: a missing directory is usable when the nearest one that exists is a writable
    directory, since save() creates the rest. `vllm-hotfix status` shows it, before any fix needs it.
    """
    try:
        directory = _open_place(place, create=False)
    except (FileNotFoundError, NotADirectoryError):  # missing, or a file stands where a directory goes
        return _creatable(place.path)
    except Exception as error:  # every failure means "not here", as in save()
        return f"{type(error).__name__}: {error}"
    os.close(directory)
    why = _not_writable(place.path)
    return f"{place.path} is not writable ({why})" if why else None


def _creatable(path: str) -> str | None:
    """Why `path`, missing, could not be created; None when its nearest existing parent allows it."""
    parent = os.path.dirname(path)
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a directory: {path} cannot be created"
    why = _not_writable(parent)
    return f"{path} cannot be created: {parent} is not writable ({why})" if why else None


def _not_writable(directory: str) -> str | None:
    """Why nothing can be created in `directory`, found by trying (an empty directory, removed at
    once): os.access says yes to root on a read-only or virtual file system."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vllm-hotfix-check-", dir=directory))
    except OSError as error:
        return f"{type(error).__name__}: {error.strerror or error}"
    return None


def _save_in(place: Place, name: str, data: bytes) -> None:
    directory = _open_place(place)
    try:
        if _holds(directory, name, data):
            _touch(directory, name)
            return
        _replace(directory, name, data)
        if not _holds(directory, name, data):
            raise Unusable(f"{os.path.join(place.path, name)} changed while it was written")
    finally:
        os.close(directory)


def files(place: Place, named: Callable[[str], bool]) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of each regular file of this user in `place` whose name passes `named`.

    Nothing is created and no link is followed. A place that does not exist holds nothing; one
    that fails the checks save() makes raises (Unusable, or the OSError met).
    """
    try:
        directory = _open_place(place, create=False)
    except FileNotFoundError:
        return []
    try:
        found = []
        for name in sorted(os.listdir(directory)):
            if not named(name):
                continue
            try:
                seen = os.stat(name, dir_fd=directory, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if _regular_and_ours(seen):
                found.append((name, seen))
        return found
    finally:
        os.close(directory)


def remove(place: Place, names: Iterable[str]) -> list[str]:
    """Unlink each of `names` in `place` that is still a regular file of this user; the paths removed.

    Raises as files() does when the place fails the checks; a name gone meanwhile is skipped.
    """
    directory = _open_place(place, create=False)
    try:
        removed = []
        for name in names:
            try:
                if not _regular_and_ours(os.stat(name, dir_fd=directory, follow_symlinks=False)):
                    continue
                os.unlink(name, dir_fd=directory)  # unlinks the name itself, never a link's target
            except FileNotFoundError:
                continue
            removed.append(os.path.join(place.path, name))
        return removed
    finally:
        os.close(directory)


def _open_place(place: Place, create: bool = True) -> int:
    """An open descriptor of the place's directory, after every check.

    With create=False nothing is made: FileNotFoundError when a directory is missing.
    """
    if not _SUPPORTED:
        raise Unusable("this platform cannot open directories without following symbolic links")
    base = os.path.abspath(place.base)
    if create:
        os.makedirs(base, mode=0o700, exist_ok=True)
    fd = os.open(base, _OPEN_DIR)
    try:
        _check_base(os.fstat(fd), base)
        path = base
        for part in place.parts:
            path = os.path.join(path, part)
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
            child = os.open(part, _OPEN_DIR | _NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
            _check_own(os.fstat(fd), path)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_base(found: os.stat_result, path: str) -> None:
    if found.st_uid not in (os.geteuid(), 0):
        raise Unusable(f"{path} is owned by uid {found.st_uid}, not by this user or root")
    if found.st_mode & 0o022 and not found.st_mode & stat.S_ISVTX:
        raise Unusable(f"{path} is writable by group or others and not sticky")


def _check_own(found: os.stat_result, path: str) -> None:
    if not stat.S_ISDIR(found.st_mode):
        raise Unusable(f"{path} is not a directory")
    if found.st_uid != os.geteuid():
        raise Unusable(f"{path} is owned by uid {found.st_uid}, not by this user")
    if found.st_mode & 0o022:
        raise Unusable(f"{path} is writable by group or others (mode {stat.filemode(found.st_mode)})")


def _holds(directory: int, name: str, data: bytes) -> bool:
    """Whether `name` is a regular file of ours holding exactly `data`; reads at most len+1 bytes."""
    try:
        seen = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not _regular_and_ours(seen) or seen.st_size != len(data):
        return False
    fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=directory)
    try:
        opened = os.fstat(fd)
        if not _regular_and_ours(opened) or (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
            return False
        return _read_at_most(fd, len(data) + 1) == data
    finally:
        os.close(fd)


def _touch(directory: int, name: str) -> None:
    """Set `name`'s modification time to now, on the name itself (a link is never followed).

    Only bookkeeping for `vllm-hotfix clean`: a failure (a read-only file system) changes nothing.
    """
    with contextlib.suppress(OSError, NotImplementedError):
        os.utime(name, dir_fd=directory, follow_symlinks=False)


def _regular_and_ours(found: os.stat_result) -> bool:
    return stat.S_ISREG(found.st_mode) and found.st_uid == os.geteuid()


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _replace(directory: int, name: str, data: bytes) -> None:
    """Write `data` to a new private file and rename it over `name` (atomic for readers)."""
    tmp = f".tmp-{os.getpid()}-{os.urandom(8).hex()}.py"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=directory)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=directory)
        raise
