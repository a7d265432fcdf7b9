"""The upstream patches (upstream/): what each targets, and applying one to a stored source or to a
copy of an installed vLLM.

A patch is `git diff` output against vLLM's repository root. Offline, a stored source is either the
whole module (where a probe reads it) or only the target method: there the patch is cut down to its
hunks for that method (`hunks_within`), since the rest of the file (its imports) was not stored.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parent.parent / "upstream"
TARGETS = UPSTREAM / "targets.json"
HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@")


@dataclass(frozen=True)
class Target:
    """One patch file and what it must apply to and fix."""

    patch: Path
    fixes: tuple[str, ...]  # the package's fix ids whose probes must then say `fixed upstream`
    releases: tuple[str, ...]  # the vLLM releases it applies to cleanly
    after: tuple[Path, ...] = ()  # the patches of its series applied before it, in order


def targets() -> list[Target]:
    entries = json.loads(TARGETS.read_text(encoding="utf-8"))["patches"]
    return [
        Target(
            UPSTREAM / e["patch"],
            tuple(e["fixes"]),
            tuple(e["releases"]),
            tuple(UPSTREAM / p for p in e.get("after", ())),
        )
        for e in entries
    ]


def file_diffs(patch_text: str) -> dict[str, str]:
    """Each file's part of a patch, by its path (`b/` side), header included."""
    parts: dict[str, str] = {}
    for chunk in re.split(r"(?m)^(?=diff --git )", patch_text):
        if chunk.startswith("diff --git "):
            path = chunk.split("\n", 1)[0].rsplit(" b/", 1)[1]
            parts[path] = chunk
    return parts


def hunks_within(file_diff: str, text: str) -> tuple[str, list[str]]:
    """The file's diff with only the hunks whose old side (context and removed lines) occurs in
    `text`, in a row; and the left-out hunks."""
    lines = file_diff.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if HUNK.match(line)]
    header = "".join(lines[: starts[0]])
    kept, left = [], []
    have = text.splitlines()
    for at, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        hunk = lines[at:end]
        old = [line[1:].rstrip("\n") for line in hunk[1:] if line[:1] in (" ", "-")]
        found = any(have[i : i + len(old)] == old for i in range(len(have) - len(old) + 1))
        (kept if found else left).append("".join(hunk))
    return header + "".join(kept), left


def git_apply(patch: str | Path, directory: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """`git apply` in `directory` (not a repository: paths relative to it); the patch as text or file."""
    text = patch.read_text(encoding="utf-8") if isinstance(patch, Path) else patch
    return subprocess.run(
        ["git", "apply", "--verbose", *options],
        input=text,
        cwd=directory,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "GIT_CEILING_DIRECTORIES": str(directory.parent)},  # never a repository above
    )


def overlay(site_packages: Path, patches: list[Path], out: Path) -> Path:
    """`out` with a copy of `site_packages`'s vllm package (symlinks), the files the patches change
    copied and patched, and the patches' new files (their tests): put `out` first on PYTHONPATH to
    run that vLLM with the patches. Raises with git's message if a patch does not apply."""
    shutil.copytree(site_packages / "vllm", out / "vllm", symlinks=False, copy_function=os.symlink)
    for patch in patches:
        for path in file_diffs(patch.read_text(encoding="utf-8")):
            target = out / path
            if target.is_symlink():
                target.unlink()
                shutil.copyfile(site_packages / path, target)
        applied = git_apply(patch, out)
        if applied.returncode != 0:
            raise RuntimeError(f"{patch} does not apply to {site_packages}:\n{applied.stderr}")
    return out
