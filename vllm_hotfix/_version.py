"""The package version, kept apart so that reading it imports nothing else.

Main carries a development version (`X.Y.Z.devN`) until the release is tagged (docs/releasing.md).
A development build names its source: when the package runs from a git checkout (not installed from
a wheel), `-V` and `status` add the checkout, its commit and whether the package's files differ from
it, read from git when they are asked for, never at import.
"""

from __future__ import annotations

__version__ = "0.2.0.dev0"

_checkout: dict[str, object] | None = None
_read = False


def checkout() -> dict[str, object] | None:
    """`{"path", "commit", "modified"}` when the package runs from a git checkout, else None
    (installed from a wheel, or a copy without .git). `commit` (the full SHA) and `modified` (the
    package's files differ from it, or hold untracked files) are None when git cannot tell. Read once
    per process."""
    global _checkout, _read
    if not _read:
        _checkout, _read = _read_checkout(), True
    return _checkout


def describe(version: str = __version__, found: dict[str, object] | bool | None = True) -> str:
    """The version and, from a checkout (this process's, or `found`, a status' `hotfix_checkout`),
    where it runs from: `0.2.0.dev0 (checkout /src at 0123abcd4567, modified)`."""
    if found is True:
        found = checkout()
    if not isinstance(found, dict):
        return version
    commit = str(found["commit"])[:12] if found.get("commit") else "an unknown commit"
    return f"{version} (checkout {found['path']} at {commit}{', modified' if found.get('modified') else ''})"


def _read_checkout() -> dict[str, object] | None:
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not ((root / ".git").exists() and (root / "pyproject.toml").is_file()):
        return None
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, env=env, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "--verify", "HEAD")
    changes = git("status", "--porcelain", "--", Path(__file__).parent.name)
    return {
        "path": str(root),
        "commit": commit.strip() if commit else None,
        # bytecode is not a change, whether or not the checkout's .gitignore says so
        "modified": None if changes is None else any("__pycache__" not in c for c in changes.splitlines()),
    }
