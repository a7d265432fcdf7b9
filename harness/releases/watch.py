"""`python -m harness.releases.watch`: which vLLM releases the fixes' probes know, and which new
ones they do not. The weekly workflow (.github/workflows/watch-releases.yml) runs it after
`python -m harness.releases --json` and `scripts/refresh_sources.py` have read PyPI; a maintainer
runs it from a checkout, offline, on the stored sources.

Per release, `known` (every fix's probe recognises what it reads) or `unknown` (with each fix and
the probe's reason), from the stored sources (tests/sources/, classified here with the current
probes) and, when given, the JSON of `python -m harness.releases --json` (which adds the registry
routes and the wheels that could not be read). A release not in the baseline index (the
tests/sources/index.json committed before the refresh) is new. An `unknown` on a new release is the
maintainers' work (docs/releasing.md): exit 2 and, with --issue, the issue's title (first line) and
body written to a file. Exit codes are the package's: 0 every new release known, 2 an unknown on a
new release, 4 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hotfix.fixes import ALL_FIXES, Fix
from vllm_hotfix.judging import verdicts
from vllm_hotfix.runtime.decisions import Decision

REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "tests" / "sources"
SUFFIX = ".py.txt"  # scripts/refresh_sources.py's name for a stored text
PROG = "python -m harness.releases.watch"
ACT = "docs/releasing.md#a-new-upstream-release"


@dataclass(frozen=True)
class Verdicts:
    """One release: each fix whose verdict is unknown there, with why ("fix-id: reason")."""

    dist: str
    version: str
    unknown: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return self.dist, self.version

    @property
    def where(self) -> str:
        return f"{self.dist} {self.version}"


class _Stored(dict[str, "str | None"]):
    """The related modules stored for a probe; one it reads that was not stored is a KeyError (the
    probe changed what it reads: the sources must be refreshed), never a silent None."""

    def get(self, name: str, default: Any = None) -> Any:
        return self[name]


def _probe(fix: Fix, entry: Mapping[str, Any] | None, root: Path) -> tuple[Decision, str]:
    """The fix's verdict on one release's stored inputs (fix.absent where it has no target)."""
    if entry is None:
        return Decision.UNKNOWN, "not stored for this fix: run python scripts/refresh_sources.py"
    if entry["function"] is None:
        return fix.absent, "no target in this release"

    def text(digest: str) -> str:
        with open(root / fix.fix_id / f"{digest}{SUFFIX}", encoding="utf-8", newline="") as handle:
            return handle.read()

    related = _Stored({name: digest and text(digest) for name, digest in entry["related"].items()})
    try:
        probe = fix.probe_source(text(entry["function"]), related)
    except Exception as error:  # a probe that cannot read the stored inputs knows nothing
        return Decision.UNKNOWN, f"the probe failed on the stored source: {type(error).__name__}: {error}"
    return probe.verdict, probe.reason


def from_sources(root: Path = SOURCES, fixes: Sequence[Fix] = ALL_FIXES) -> list[Verdicts]:
    """Every release the stored sources record, judged by the current probes, offline."""
    index = json.loads((root / "index.json").read_text(encoding="utf-8"))
    found = []
    for row in index["releases"]:
        unknown = []
        if "skipped" not in row:  # a release without a wheel: nothing to judge
            for fix in fixes:
                verdict, reason = _probe(fix, row.get("fixes", {}).get(fix.fix_id), root)
                if verdict is Decision.UNKNOWN:
                    unknown.append(f"{fix.fix_id}: {reason}")
        found.append(Verdicts(row["dist"], row["version"], tuple(unknown)))
    return found


def from_releases(document: Mapping[str, Any]) -> list[Verdicts]:
    """The releases of a `python -m harness.releases --json` document, with its unknown verdicts
    and unknown registry routes."""
    found = []
    for row in document["releases"]:
        unknown = []
        for fix_id, outcome in row["fixes"].items():
            if outcome["decision"] == Decision.UNKNOWN.value:
                unknown.append(f"{fix_id}: {outcome['reason']}")
            route = outcome.get("route")
            if route is not None and route.get("default") is None:
                unknown.append(f"{fix_id}: registry: {route.get('reason')}")
        found.append(Verdicts(row["dist"], row["version"], tuple(unknown)))
    return found


def merged(*sources: Iterable[Verdicts]) -> list[Verdicts]:
    """One entry per release, in the order first seen, with every source's unknowns."""
    by_key: dict[tuple[str, str], list[str]] = {}
    for found in sources:
        for release in found:
            reasons = by_key.setdefault(release.key, [])
            reasons += [line for line in release.unknown if line not in reasons]
    return [Verdicts(dist, version, tuple(reasons)) for (dist, version), reasons in by_key.items()]


def recorded(index_path: Path) -> frozenset[tuple[str, str]]:
    """The releases an index.json records."""
    index = json.loads(index_path.read_text(encoding="utf-8"))
    return frozenset((row["dist"], row["version"]) for row in index["releases"])


def report(releases: Sequence[Verdicts], baseline: frozenset[tuple[str, str]] | None) -> list[str]:
    """One line per release (`(new)` where the baseline lacks it), then one per unknown verdict."""
    lines = []
    for release in releases:
        new = " (new)" if baseline is not None and release.key not in baseline else ""
        lines.append(f"{release.where}{new}: {'unknown' if release.unknown else 'known'}")
        lines += [f"  unknown: {reason}" for reason in release.unknown]
    return lines


def issue(unknown_new: Sequence[Verdicts], run_url: str | None = None) -> str:
    """The issue to open: its title (first line), then a Markdown body that says what to do."""
    title = "New vLLM release with an unknown verdict: " + ", ".join(r.where for r in unknown_new)
    body = [
        "The weekly release watch (`.github/workflows/watch-releases.yml`) found a new vLLM release"
        " whose code a fix's probe does not recognise. Until the probe learns the shape, the hotfix"
        " leaves that fix out on it (decision `unknown`, a WARNING in vLLM's log).",
        "",
    ]
    for release in unknown_new:
        body.append(f"- **{release.where}**")
        body += [f"  - `{reason}`" for reason in release.unknown]
    body += [
        "",
        f"What to do: {ACT} (record it with `python scripts/refresh_sources.py`, read the new source,"
        " teach the probe the shape with a test that fails when a part of it is undone, or widen the"
        " fix's declared range; then README's table, docs/fixes.md and the CHANGELOG).",
    ]
    if run_url:
        body += ["", f"The run: {run_url}"]
    return "\n".join([title, *body]) + "\n"


def _run_url(environ: Mapping[str, str]) -> str | None:
    """This GitHub Actions run's page, when run there."""
    parts = [environ.get(name) for name in ("GITHUB_SERVER_URL", "GITHUB_REPOSITORY", "GITHUB_RUN_ID")]
    if not all(parts):
        return None
    server, repository, run_id = parts
    return f"{server}/{repository}/actions/runs/{run_id}"


def build_parser() -> argparse.ArgumentParser:
    from vllm_hotfix.commands.parser import Parser

    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sources", type=Path, default=SOURCES, help="the stored sources to judge (default tests/sources)"
    )
    parser.add_argument("--releases", type=Path, help="a `python -m harness.releases --json` document too")
    parser.add_argument(
        "--baseline", type=Path, help="the index.json recorded before (default: every release is new)"
    )
    parser.add_argument("--issue", type=Path, help="write the issue (title line, body) here when one is due")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    found = [from_sources(args.sources)]
    if args.releases is not None:
        found.append(from_releases(json.loads(args.releases.read_text(encoding="utf-8"))))
    releases = merged(*found)
    baseline = recorded(args.baseline) if args.baseline is not None else None
    print("\n".join(report(releases, baseline)))
    new = [r for r in releases if baseline is None or r.key not in baseline]
    unknown_new = [r for r in new if r.unknown]
    print(
        f"{PROG}: {len(releases)} releases, {len(new)} new, {len(unknown_new)} new with an unknown verdict",
        file=sys.stderr,
    )
    if not unknown_new:
        return verdicts.OK
    if args.issue is not None:
        args.issue.write_text(issue(unknown_new, _run_url(os.environ)), encoding="utf-8")
    return verdicts.INCOMPLETE


if __name__ == "__main__":
    sys.exit(main())
