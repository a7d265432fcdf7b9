"""The site hook: a `.pth` file that arms vllm-hotfix in every Python process of an environment.

For processes that vLLM does not manage (so its plugin mechanism does not run), or where
VLLM_PLUGINS filters the plugin out. A `.pth` file is used rather than a sitecustomize module so
that a user's own sitecustomize is never overwritten. Its one line does nothing when
VLLMHOTFIX_DISABLE turns every fix off, imports only the tiny package front otherwise (the
engine waits for `import vllm`), and degrades to one short warning line if the package is gone.
"""

from __future__ import annotations

import os
import site
import sysconfig

from vllm_hotfix._version import __version__
from vllm_hotfix.runtime.settings import DISABLE_VAR, TRUE_WORDS

PTH_NAME = "vllm_hotfix_site_hook.pth"
MARKER = "# vllm-hotfix site hook"

_TRUE = tuple(sorted(TRUE_WORDS - {""}))
_SEEN = "_vllm_hotfix_site_hook"  # set on sys: the hook ran in this process
# Python compiles and runs the `.pth` line at every start-up, twice in a venv (Python 3.11's site
# processes a venv's site-packages from site.venv() and again from site.main()). So the checks
# are one expression, and the import, which needs `try`, is compiled by the inner exec only once
# per process: never when every fix is disabled (benchmarks/startup.py measures the line).
# On failure it names the .pth file (site.addpackage's `fullname`, which the exec sees; else where
# install() puts it) and how to remove it: after `pip uninstall vllm-hotfix` the file stays behind.
_TRY_IMPORT = (
    "try:\n"
    " import vllm_hotfix\n"
    "except Exception as e:\n"
    " import sysconfig\n"
    f" p = locals().get('fullname') or os.path.join(sysconfig.get_paths()['purelib'], {PTH_NAME!r})\n"
    " sys.stderr.write('vllm-hotfix: site hook skipped: %s: %s; delete %s or reinstall vllm-hotfix\\n'"
    " % (type(e).__name__, e, p))\n"
)
_LINE = (
    f"import os, sys; hasattr(sys, {_SEEN!r})"
    f" or os.environ.get({DISABLE_VAR!r}, '').strip().lower() in {_TRUE!r}"
    f" or setattr(sys, {_SEEN!r}, True) or exec({_TRY_IMPORT!r})"
)
PTH_TEXT = f"{MARKER} {__version__}; remove with: vllm-hotfix uninstall-site-hook\n{_LINE}\n"


def default_site_dir() -> str:
    """The active environment's site-packages (a venv's own, when one is active)."""
    return sysconfig.get_paths()["purelib"]


def _candidate_dirs() -> list[str]:
    dirs = [default_site_dir()]
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # some embedded interpreters
        pass
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return list(dict.fromkeys(dirs))


def _ours(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline().startswith(MARKER)
    except OSError:
        return False


def installed_path() -> str | None:
    """Where the hook is installed for this interpreter, or None."""
    for directory in _candidate_dirs():
        path = os.path.join(directory, PTH_NAME)
        if _ours(path):
            return path
    return None


def install(site_dir: str | None = None) -> str:
    """Write the hook (replacing an older one of ours); refuse to overwrite a file we did not write."""
    directory = site_dir or default_site_dir()
    path = os.path.join(directory, PTH_NAME)
    if os.path.exists(path) and not _ours(path):
        raise FileExistsError(f"{path} exists and was not written by vllm-hotfix; not touching it")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(PTH_TEXT)
    os.replace(tmp, path)
    return path


def uninstall(site_dir: str | None = None) -> str | None:
    """Remove exactly the file install() wrote; returns its path, or None if none was there."""
    dirs = [site_dir] if site_dir else _candidate_dirs()
    for directory in dirs:
        path = os.path.join(directory, PTH_NAME)
        if _ours(path):
            os.remove(path)
            return path
    return None
