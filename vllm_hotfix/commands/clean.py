"""`vllm-hotfix clean`: remove the generated sources nothing has used for a while (`run`, the command).

Each combination of vLLM install, fix and hotfix version writes its own generated source (named by
its content hash) and nothing else ever removes one, so they accumulate. A file is used when a
process writes it or finds it and reuses it (which sets its modification time to now, runtime/store.py),
so its age says when a process last started with it. `clean()` removes, from this user's places
for generated sources (`patching.generated_dirs()`: the same VLLMHOTFIX_CACHE_DIR, XDG_CACHE_HOME
and TMPDIR as the vLLM processes give the same places), the files older than a number of days,
or all of them, except those this process itself uses. It goes through the store: only regular
files of this user named as generated sources are removed, only in directories that pass the
store's checks, and no link is followed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

from vllm_hotfix.commands.output import print_document
from vllm_hotfix.judging import verdicts
from vllm_hotfix.runtime import codegen, patching, store

DEFAULT_DAYS = 30.0
DAY_S = 86400


@dataclass
class Cleaned:
    """What clean() did (or, in a dry run, would do)."""

    removed: list[str] = field(default_factory=list)  # paths
    removed_bytes: int = 0
    kept: list[str] = field(default_factory=list)  # generated files too recent, or used here
    skipped: list[str] = field(default_factory=list)  # "<place>: why" for places not checked
    failed: list[str] = field(default_factory=list)  # "<place>: why" for removals that failed


def clean(days: float | None = DEFAULT_DAYS, dry_run: bool = False, now: float | None = None) -> Cleaned:
    """Remove the generated sources not used for `days` days (every one when `days` is None),
    except those this process uses. With `dry_run` nothing is removed: `removed` lists them."""
    cutoff = None if days is None else (time.time() if now is None else now) - days * DAY_S
    in_use = codegen.loaded_files()
    done = Cleaned()
    places = {place.path: place for place in patching.generated_dirs()}  # one place listed once
    for place in places.values():
        try:
            found = store.files(place, codegen.is_generated_name)
        except Exception as error:
            done.skipped.append(f"{place.path}: {type(error).__name__}: {error}")
            continue
        doomed = {}
        for name, seen in found:
            path = os.path.join(place.path, name)
            used_here = (seen.st_dev, seen.st_ino) in in_use
            if used_here or (cutoff is not None and seen.st_mtime >= cutoff):
                done.kept.append(path)
            else:
                doomed[name] = seen.st_size
        if not doomed:
            continue
        if dry_run:
            done.removed += [os.path.join(place.path, name) for name in doomed]
            done.removed_bytes += sum(doomed.values())
            continue
        try:
            removed = store.remove(place, doomed)
        except Exception as error:
            done.failed.append(f"{place.path}: {type(error).__name__}: {error}")
            continue
        done.removed += removed
        done.removed_bytes += sum(doomed[os.path.basename(path)] for path in removed)
    return done


def run(args: argparse.Namespace) -> int:
    done = clean(None if args.all else args.days, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    which = "whatever their age" if args.all else f"not used for {args.days:g} days"
    summary = (
        f"{verb} {len(done.removed)} generated source(s) {which}"
        f" ({done.removed_bytes / 1024:.0f} KiB); kept {len(done.kept)}"
        + ("" if args.all else f" used within {args.days:g} days")
        + " (or by this process)"
    )
    code = verdicts.INCOMPLETE if done.skipped or done.failed else verdicts.OK
    if args.json:
        fields = {"dry_run": args.dry_run, "days": None if args.all else args.days}
        print_document("clean", code, summary, **fields, **dataclasses.asdict(done))
        return code
    for path in done.removed:
        print(f"{verb} {path}")
    for line in done.skipped:
        print(
            f"vllm-hotfix clean: not checked (not the package's own, or unreadable): {line}", file=sys.stderr
        )
    for line in done.failed:
        print(f"vllm-hotfix clean: could not remove from {line}", file=sys.stderr)
    print(summary)
    return code
