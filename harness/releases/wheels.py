"""Read a few members of a remote wheel with HTTP Range requests, and keep their texts on disk.

A wheel is a zip: its end records and central directory say where each member lies, so a probe's
few modules cost a few hundred KB of a 300 MB wheel. The texts (and absences) are cached per wheel
URL and member, so a second run reads nothing from the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from vllm_hotfix.runtime import settings as settings_mod

USER_AGENT = "vllm-hotfix-releases (+https://github.com/vllm-hotfix/vllm-hotfix)"
TIMEOUT_S = 60.0
CACHE_FORMAT = 1  # bump when the cached entries change meaning


# -- reading a remote zip with HTTP Range requests ------------------------------------------------


class RangeError(OSError):
    """The server answered, but not as a Range-capable file server does (a wheel-side problem)."""


class RangeFile:
    """A read-only, seekable file over HTTP Range requests, with a block cache and a byte counter.

    `zipfile.ZipFile(RangeFile(url))` then fetches the end records, the central directory and the
    members it is asked for, and nothing else. A server that ignores Range (answers 200) is read
    once in full into a temporary file, which then serves every read.
    """

    def __init__(self, url: str, block_size: int = 16 * 1024, tail: int = 64 * 1024) -> None:
        self.url = url
        self.block_size = block_size
        self.bytes_fetched = 0  # body bytes received, all requests together
        self.requests = 0
        self.full_download = False
        self._blocks: dict[int, bytes] = {}
        self._spill: IO[bytes] | None = None
        self._pos = 0
        self.size = self._open(tail)

    # -- the HTTP side
    def _get(self, byte_range: str) -> tuple[int, dict[str, str], Any]:
        request = urllib.request.Request(self.url, headers={"Range": byte_range, "User-Agent": USER_AGENT})
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
        self.requests += 1
        headers = {key.lower(): value for key, value in response.headers.items()}
        return response.status, headers, response

    def _open(self, tail: int) -> int:
        """Fetch the last `tail` bytes (where the end records live) and learn the file's size."""
        status, headers, response = self._get(f"bytes=-{tail}")
        with response:
            if status != 206:
                return self._download_all(response)
            match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", headers.get("content-range", "").strip())
            if match is None:
                raise RangeError(f"{self.url}: unusable Content-Range {headers.get('content-range')!r}")
            start, size = int(match.group(1)), int(match.group(3))
            data = response.read()
        self.bytes_fetched += len(data)
        self._store(start, data, size)
        return size

    def _download_all(self, response: Any) -> int:
        """The server sent the whole file: keep it in a temporary file rather than in memory."""
        self.full_download = True
        spill = tempfile.TemporaryFile()
        shutil.copyfileobj(response, spill, 1024 * 1024)
        self.bytes_fetched += spill.tell()
        self._spill = spill
        return spill.tell()

    def _fetch(self, first_block: int, last_block: int) -> None:
        start = first_block * self.block_size
        stop = min((last_block + 1) * self.block_size, self.size) - 1
        status, _, response = self._get(f"bytes={start}-{stop}")
        with response:
            if status != 206:
                raise RangeError(f"{self.url}: the server stopped honouring Range (status {status})")
            data = response.read()
        self.bytes_fetched += len(data)
        if len(data) != stop - start + 1:
            raise RangeError(f"{self.url}: asked for {stop - start + 1} bytes, got {len(data)}")
        self._store(start, data, self.size)

    def _store(self, start: int, data: bytes, size: int) -> None:
        """Keep only whole blocks (and the file's last, short one), so cached blocks are exact."""
        first = -(-start // self.block_size)
        for block in range(first, (start + len(data) - 1) // self.block_size + 1):
            lo = block * self.block_size
            hi = min(lo + self.block_size, size)
            if lo >= start and hi <= start + len(data):
                self._blocks[block] = data[lo - start : hi - start]

    # -- the file side, as zipfile uses it
    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        stop = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        if stop <= self._pos:
            return b""
        if self._spill is not None:
            self._spill.seek(self._pos)
            data = self._spill.read(stop - self._pos)
        else:
            data = self._read_blocks(self._pos, stop)
        self._pos += len(data)
        return data

    def _read_blocks(self, start: int, stop: int) -> bytes:
        first, last = start // self.block_size, (stop - 1) // self.block_size
        block = first
        while block <= last:  # one request per run of missing blocks
            if block in self._blocks:
                block += 1
                continue
            run_end = block
            while run_end + 1 <= last and run_end + 1 not in self._blocks:
                run_end += 1
            self._fetch(block, run_end)
            block = run_end + 1
        joined = b"".join(self._blocks[b] for b in range(first, last + 1))
        offset = first * self.block_size
        return joined[start - offset : stop - offset]

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
        self._blocks.clear()

    def __enter__(self) -> RangeFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- member texts, cached on disk -----------------------------------------------------------------


def cache_root() -> str:
    """Beside the hotfix's other caches, so one setting moves them all."""
    return os.path.join(settings_mod.cache_dir(), "releases")


class MemberCache:
    """Member texts keyed by wheel URL and member path; a missing member is cached as None too."""

    def __init__(self, root: str | None = None) -> None:
        self.root = root or cache_root()

    def _path(self, url: str, member: str) -> str:
        digest = hashlib.sha256(f"{CACHE_FORMAT}\0{url}\0{member}".encode()).hexdigest()
        return os.path.join(self.root, digest[:2], digest + ".json")

    def get(self, url: str, member: str) -> tuple[bool, str | None]:
        """(found in the cache, text or None when the wheel lacks the member)."""
        try:
            with open(self._path(url, member), encoding="utf-8") as handle:
                entry = json.load(handle)
        except (OSError, ValueError):
            return False, None
        if entry.get("url") != url or entry.get("member") != member:
            return False, None
        return True, entry.get("text")

    def put(self, url: str, member: str, text: str | None) -> None:
        """Write via a temporary file and a rename, so parallel readers never see half an entry."""
        path = self._path(url, member)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump({"url": url, "member": member, "text": text}, handle)
        os.replace(tmp, path)


@dataclass
class FetchStats:
    """What reading one wheel cost."""

    bytes_fetched: int = 0
    requests: int = 0
    full_download: bool = False
    from_cache: bool = True


def read_members(
    url: str, members: Sequence[str], cache: MemberCache, opener: Callable[[str], RangeFile] = RangeFile
) -> tuple[dict[str, str | None], FetchStats]:
    """The texts of `members` in the wheel at `url` (None where absent), from the cache if there."""
    texts: dict[str, str | None] = {}
    missing = []
    for member in members:
        hit, text = cache.get(url, member)
        if hit:
            texts[member] = text
        else:
            missing.append(member)
    stats = FetchStats()
    if not missing:
        return texts, stats
    with opener(url) as remote, zipfile.ZipFile(remote) as wheel:
        names = set(wheel.namelist())
        for member in missing:
            text = wheel.read(member).decode("utf-8") if member in names else None
            texts[member] = text
            cache.put(url, member, text)
        stats = FetchStats(remote.bytes_fetched, remote.requests, remote.full_download, from_cache=False)
    return texts, stats
