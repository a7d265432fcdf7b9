"""`vllm-hotfix install-site-hook` and `uninstall-site-hook`: the .pth file that arms vllm-hotfix in
every Python process of an environment (runtime/site_hook.py writes and removes it)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, TextIO

from vllm_hotfix.commands.output import print_document
from vllm_hotfix.judging import verdicts
from vllm_hotfix.judging.verdicts import UsageError
from vllm_hotfix.runtime import site_hook


def _site_dir(given: str | None) -> str:
    """--site-dir, checked before anything is written: an existing, writable directory."""
    directory = given or site_hook.default_site_dir()
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"--site-dir {directory}: a file, not a directory")
    if not os.path.isdir(directory):
        raise UsageError(f"--site-dir {directory}: no such directory")
    if not os.access(directory, os.W_OK) or not _can_write(directory):
        raise UsageError(f"--site-dir {directory}: the directory cannot be written")
    return directory


def _can_write(directory: str) -> bool:
    """Whether a file can be made in `directory` (os.access says yes to /proc for root)."""
    try:
        tempfile.TemporaryFile(dir=directory).close()
    except OSError:
        return False
    return True


def _say(args: argparse.Namespace, code: int, line: str, **fields: Any) -> int:
    """A command's outcome: its line (on stderr when it failed), or under --json its document."""
    if args.json:
        print_document(args.command, code, line, **fields)
    else:
        print(line if code == verdicts.OK else f"vllm-hotfix {args.command}: {line}", file=_stream(code))
    return code


def _stream(code: int) -> TextIO:
    return sys.stdout if code == verdicts.OK else sys.stderr


def install(args: argparse.Namespace) -> int:
    directory = _site_dir(args.site_dir)
    try:
        path = site_hook.install(directory)
    except OSError as error:
        return _say(args, verdicts.ERROR, str(error), path=None)
    on_path = {os.path.realpath(entry) for entry in sys.path if entry}
    note = None
    if os.path.realpath(directory) not in on_path:
        note = (
            f"{directory} is not on this Python's sys.path; only an interpreter that has it as a site"
            " directory runs the hook"
        )
        if not args.json:
            print(f"vllm-hotfix install-site-hook: note: {note}", file=sys.stderr)
    return _say(args, verdicts.OK, f"installed the vllm-hotfix site hook: {path}", path=path, note=note)


def uninstall(args: argparse.Namespace) -> int:
    directory = _site_dir(args.site_dir) if args.site_dir else None
    try:
        path = site_hook.uninstall(directory)
    except OSError as error:
        return _say(args, verdicts.ERROR, str(error), path=None)
    line = f"removed {path}" if path else "the vllm-hotfix site hook was not installed"
    return _say(args, verdicts.OK, line, path=path)
