"""harness.releases.wheels: a remote wheel's members read with HTTP Range requests, cached on disk.

The unit tests serve a local zip from 127.0.0.1 (one server honours Range, one ignores it).
The tests marked `network` read PyPI; when it cannot be reached they skip, saying why, unless
VLLMHOTFIX_REQUIRE_NETWORK is set (scripts/test.sh sets it): then they fail (tests/network.py).
"""

from __future__ import annotations

import io
import os
import random
import zipfile
from collections.abc import Iterator

import pytest

from harness import releases
from tests.release_shapes import BUGGY_V2, MEMBER, serve


@pytest.fixture(scope="module")
def wheel_bytes() -> bytes:
    """A 3 MB zip: incompressible filler around the small members the probes read."""
    noise = random.Random(5)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("vllm/_C.abi3.so", noise.randbytes(1_500_000), zipfile.ZIP_STORED)
        for i in range(300):
            archive.writestr(f"vllm/filler/module_{i}.py", f"X = {i}\n", zipfile.ZIP_DEFLATED)
        archive.writestr(MEMBER, BUGGY_V2, zipfile.ZIP_DEFLATED)
        archive.writestr("vllm/_moe.abi3.so", noise.randbytes(1_500_000), zipfile.ZIP_STORED)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def servers(wheel_bytes: bytes) -> Iterator[dict[str, tuple[str, list]]]:
    files = {"/vllm-0.0.0-py3-none-any.whl": wheel_bytes}
    ranged, ranged_url, ranged_log = serve(True, files)
    plain, plain_url, plain_log = serve(False, files)
    path = "/vllm-0.0.0-py3-none-any.whl"
    yield {"range": (ranged_url + path, ranged_log), "plain": (plain_url + path, plain_log)}
    for server in (ranged, plain):
        server.shutdown()
        server.server_close()


# -- the zip range reader --------------------------------------------------------------------------


def test_range_reader_reads_only_the_central_directory_and_the_member(servers, wheel_bytes) -> None:
    url, log = servers["range"]
    with releases.RangeFile(url) as remote, zipfile.ZipFile(remote) as archive:  # type: ignore[arg-type]
        assert archive.read(MEMBER).decode() == BUGGY_V2
        assert not remote.full_download
        assert remote.size == len(wheel_bytes)
        assert remote.bytes_fetched < 150_000, remote.bytes_fetched  # of a 3 MB file
        assert remote.requests <= 5
        assert all(asked and asked.startswith("bytes=") for _, asked in log)


def test_range_reader_downloads_once_when_the_server_ignores_range(servers, wheel_bytes) -> None:
    url, log = servers["plain"]
    before = len(log)
    with releases.RangeFile(url) as remote, zipfile.ZipFile(remote) as archive:  # type: ignore[arg-type]
        assert archive.read(MEMBER).decode() == BUGGY_V2
        assert remote.full_download
        assert remote.bytes_fetched == len(wheel_bytes)
        assert remote.requests == 1
    assert len(log) == before + 1


def test_range_reader_reads_like_a_file(servers, wheel_bytes) -> None:
    url, _ = servers["range"]
    pick = random.Random(7)
    with releases.RangeFile(url, block_size=4096, tail=1000) as remote:
        for _ in range(50):
            start = pick.randrange(len(wheel_bytes))
            size = pick.choice([0, 1, 100, 4095, 4096, 4097, 20_000])
            remote.seek(start)
            assert remote.read(size) == wheel_bytes[start : start + size]
            assert remote.tell() == min(len(wheel_bytes), start + size)
        remote.seek(-10, os.SEEK_END)
        assert remote.read() == wheel_bytes[-10:]
        assert remote.read(5) == b""


def test_read_members_caches_texts_and_absences(servers, tmp_path) -> None:
    url, log = servers["range"]
    cache = releases.MemberCache(str(tmp_path))
    wanted = [MEMBER, "vllm/absent.py"]
    texts, stats = releases.read_members(url, wanted, cache)
    assert texts == {MEMBER: BUGGY_V2, "vllm/absent.py": None}
    assert not stats.from_cache and 0 < stats.bytes_fetched < 150_000
    before = len(log)
    again, stats = releases.read_members(url, wanted, cache)
    assert again == texts
    assert stats.from_cache and stats.bytes_fetched == 0
    assert len(log) == before  # no request at all


# -- on PyPI (network) -----------------------------------------------------------------------------


@pytest.mark.network
def test_wheels_are_read_partially(pypi_rows, tmp_path) -> None:
    """Two real wheels read again into an empty cache: only part of each is downloaded."""
    chosen = [r for r in pypi_rows if r.dist == "vllm" and r.version in ("0.24.0", "0.25.0")]
    assert len(chosen) == 2
    index = releases.fetch_index("vllm", timeout=20)
    wanted = [r for r in releases.list_releases("vllm", index) if r.version in ("0.24.0", "0.25.0")]
    fresh = [
        releases.classify_release(r, releases.all_probes(), releases.MemberCache(str(tmp_path)))
        for r in wanted
    ]
    assert all(not row.stats.from_cache for row in fresh)
    assert not any(row.stats.full_download for row in fresh)
    assert max(row.stats.bytes_fetched for row in fresh) < 2 * 2**20
    assert [o.verdict for o in fresh[0].outcomes] == [o.verdict for o in chosen[0].outcomes]
