"""Checks of the built sdist and wheel: what a user installs, and what it does in a clean venv.

Used by tests/test_packaging.py (which builds both outside the source tree) and by the release
workflow on the very files it publishes:

    python -m harness.dist_checks [--install] DIST_DIR

`--install` also installs the wheel, with its dependencies from the package index, into a fresh
venv and runs `vllm-hotfix status` there (no vLLM: one line naming that venv's Python, exit 2).
Exits 1 and lists every problem found.
"""

from __future__ import annotations

import argparse
import configparser
import email.message
import email.parser
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from harness.testenv import REPO

NAME = "vllm-hotfix"
PACKAGE = "vllm_hotfix"
# Exactly these entry points, no more: vLLM finds the plugin by the group and the name.
ENTRY_POINTS = {
    "console_scripts": {"vllm-hotfix": "vllm_hotfix.commands.cli:main"},
    "vllm.general_plugins": {"vllm_hotfix": "vllm_hotfix.plugin:register"},
}
REQUIRES_DIST = ["wrapt>=1.14"]
REPOSITORY = "https://github.com/vllm-hotfix/vllm-hotfix"
PROJECT_URLS = ("Repository", "Documentation", "Changelog", "Issues")  # pyproject.toml's [project.urls]
NOT_SHIPPED = ("tests/", "harness/", "gpu/", "benchmarks/", "scripts/", ".ci/", ".github/", "docs/")


def version() -> str:
    """The version in the source tree (vllm_hotfix/_version.py), read without importing it."""
    scope: dict[str, str] = {}
    exec((REPO / PACKAGE / "_version.py").read_text(), scope)
    return scope["__version__"]


def package_files() -> set[str]:
    """The files of the package in the source tree, as paths relative to the tree's root."""
    found = {p for p in (REPO / PACKAGE).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    return {p.relative_to(REPO).as_posix() for p in found if p.suffix in (".py", ".typed")}


def _metadata_problems(text: str, where: str) -> list[str]:
    meta = email.parser.Parser().parsestr(text)
    expected = {
        "Name": NAME,
        "Version": version(),
        "License": "Apache-2.0",  # the field every pip's `pip show` prints (pyproject.toml)
        "License-Expression": None,  # exclusive with License (core metadata 2.4)
        "License-File": "LICENSE",
        "Requires-Python": ">=3.10",
    }
    problems = [
        f"{where}: {key} is {meta.get(key)!r}, expected {value!r}"
        for key, value in expected.items()
        if meta.get(key) != value
    ]
    urls = dict(entry.split(", ", 1) for entry in meta.get_all("Project-URL") or [])
    if set(urls) != set(PROJECT_URLS) or not all(urls[k].startswith(REPOSITORY) for k in urls):
        problems.append(f"{where}: Project-URL is {urls}, expected {PROJECT_URLS} under {REPOSITORY}")
    problems += _summary_and_classifier_problems(meta, where)
    relative = RELATIVE_LINK.findall(meta.get_payload())
    if relative:
        problems.append(f"{where}: the long description links {relative}, dead on PyPI and in the sdist")
    requires = meta.get_all("Requires-Dist")
    if requires != REQUIRES_DIST:
        problems.append(f"{where}: Requires-Dist is {requires}, expected {REQUIRES_DIST}")
    if "# vllm-hotfix" not in meta.get_payload():
        problems.append(f"{where}: the long description is not the README")
    return problems


# A Markdown link or image whose target is neither absolute nor an anchor of the same page.
RELATIVE_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)\s]+)")
SUMMARY_MAX = 100  # one line that fits PyPI's search results
REQUIRED_CLASSIFIERS = ("Development Status :: ", "Operating System :: ", "License :: ")


def _summary_and_classifier_problems(meta: email.message.Message, where: str) -> list[str]:
    """A one-line summary, and classifiers that say the development status, the OS, the license and
    every Python 3 minor version from requires-python's lowest to the newest listed, no other."""
    problems = []
    summary = meta.get("Summary") or ""
    if "\n" in summary or not 0 < len(summary) <= SUMMARY_MAX:
        problems.append(f"{where}: Summary is not one line of at most {SUMMARY_MAX} characters: {summary!r}")
    classifiers = meta.get_all("Classifier") or []
    for prefix in REQUIRED_CLASSIFIERS:
        if not any(c.startswith(prefix) for c in classifiers):
            problems.append(f"{where}: no '{prefix}...' classifier")
    minors = sorted(int(c.rsplit(".", 1)[1]) for c in classifiers if re.fullmatch(r".*:: 3\.\d+", c))
    lowest = int((meta.get("Requires-Python") or ">=3.0").rsplit(".", 1)[1])
    if not minors or minors != list(range(lowest, minors[-1] + 1)):
        problems.append(f"{where}: Python classifiers 3.{minors} are not 3.{lowest} onwards without a gap")
    return problems


def _license_problems(data: bytes, where: str) -> list[str]:
    if data != (REPO / "LICENSE").read_bytes():
        return [f"{where}: differs from the repository's LICENSE"]
    if b"Apache License\n                           Version 2.0, January 2004" not in data:
        return [f"{where}: not the Apache License 2.0 text"]
    return []


def check_wheel(wheel: Path) -> list[str]:
    """Everything wrong with `wheel`; an empty list when it is what users should get."""
    v = version()
    dist_info = f"vllm_hotfix-{v}.dist-info"
    problems = []
    if wheel.name != f"vllm_hotfix-{v}-py3-none-any.whl":
        problems.append(f"wheel name {wheel.name}, expected vllm_hotfix-{v}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        read = {n: zf.read(n) for n in names if n.startswith(dist_info + "/")}
    tops = {n.split("/", 1)[0] for n in names}
    if tops != {PACKAGE, dist_info}:
        problems.append(f"wheel top-level entries {sorted(tops)}, expected {[PACKAGE, dist_info]}")
    problems += [f"wheel ships {n}" for n in sorted(names) if n.startswith(NOT_SHIPPED)]
    shipped = {n for n in names if n.startswith(PACKAGE + "/")}
    if shipped != package_files():
        problems.append(
            f"wheel package files differ from the source tree: missing {sorted(package_files() - shipped)},"
            f" extra {sorted(shipped - package_files())}"
        )
    if f"{PACKAGE}/py.typed" not in names:
        problems.append("wheel lacks vllm_hotfix/py.typed")
    license_path = f"{dist_info}/licenses/LICENSE"
    if license_path not in read:
        problems.append(f"wheel lacks {license_path}")
    else:
        problems += _license_problems(read[license_path], f"wheel {license_path}")
    if f"{dist_info}/METADATA" not in read:
        return [*problems, "wheel lacks METADATA"]
    problems += _metadata_problems(read[f"{dist_info}/METADATA"].decode(), "wheel METADATA")
    entry_points = configparser.ConfigParser(delimiters=("=",))
    entry_points.optionxform = str  # type: ignore[assignment,method-assign]  # keep names' case
    entry_points.read_string(read.get(f"{dist_info}/entry_points.txt", b"").decode())
    found = {group: dict(entry_points[group]) for group in entry_points.sections()}
    if found != ENTRY_POINTS:
        problems.append(f"wheel entry points {found}, expected {ENTRY_POINTS}")
    return problems


def check_sdist(sdist: Path) -> list[str]:
    """Everything wrong with `sdist`; an empty list when it is complete and holds nothing else."""
    v = version()
    root = f"vllm_hotfix-{v}"
    problems = []
    if sdist.name != f"{root}.tar.gz":
        problems.append(f"sdist name {sdist.name}, expected {root}.tar.gz")
    with tarfile.open(sdist) as tf:
        members = {m.name: m for m in tf.getmembers()}
        read = {
            n: tf.extractfile(m).read()  # type: ignore[union-attr]
            for n, m in members.items()
            if n in {f"{root}/LICENSE", f"{root}/PKG-INFO"}
        }
    if any(not n.startswith(root + "/") and n != root for n in members):
        problems.append(f"sdist entries outside {root}/")
    names = {n[len(root) + 1 :] for n in members if n.startswith(root + "/") and members[n].isfile()}
    required = {"pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "PKG-INFO"} | package_files()
    if required - names:
        problems.append(f"sdist lacks {sorted(required - names)}")
    problems += [f"sdist ships {n}" for n in sorted(names) if n.startswith(NOT_SHIPPED)]
    if f"{root}/LICENSE" in read:
        problems += _license_problems(read[f"{root}/LICENSE"], "sdist LICENSE")
    if f"{root}/PKG-INFO" in read:
        problems += _metadata_problems(read[f"{root}/PKG-INFO"].decode(), "sdist PKG-INFO")
    return problems


def clean_environ() -> dict[str, str]:
    """The environment without Python or vLLM settings that could reach into the checkout."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VLLM_"))}


def install_into_venv(wheel: Path, venv: Path, deps: bool) -> str:
    """A fresh venv at `venv` (no vLLM) with `wheel` installed by pip: with its dependencies from
    the package index if `deps`, else none (offline). Returns the venv's python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python, "install", "-q"]
    if not deps:
        pip += ["--no-deps", "--no-index"]
    done = subprocess.run([*pip, str(wheel)], capture_output=True, text=True, env=clean_environ())
    if done.returncode != 0:
        raise RuntimeError(f"pip install {wheel.name} failed:\n{done.stdout}\n{done.stderr}")
    return python


# Run in the venv: what vLLM's plugin loader does (importlib.metadata entry points, load, call).
PLUGIN_LOADER = """
import json, vllm_hotfix
from importlib.metadata import entry_points
found = [(ep.name, ep.value) for ep in entry_points(group="vllm.general_plugins")]
for ep in entry_points(group="vllm.general_plugins"):
    ep.load()()
print(json.dumps({"plugins": found, "module": vllm_hotfix.__file__}))
"""


def status_problems(python: str, work: Path) -> list[str]:
    """Run the installed `vllm-hotfix status` and the plugin loader in the venv of `python`."""
    script = Path(python).parent / "vllm-hotfix"
    if not script.exists():
        return [f"no console script at {script}"]
    env = clean_environ()
    problems = []
    # No vLLM in the venv: one line on stderr that names the venv's Python, exit 2 (not everything decided)
    done = subprocess.run([str(script), "status"], capture_output=True, text=True, cwd=work, env=env)
    said = f"vllm-hotfix status: no vLLM importable by {python}:"
    if done.returncode != 2 or len(done.stderr.splitlines()) != 1 or not done.stderr.startswith(said):
        problems.append(
            f"`vllm-hotfix status` exited {done.returncode}, not 2 with one line naming {python}:"
            f"\n{done.stdout}\n{done.stderr}"
        )
    as_json = [str(script), "status", "--json"]
    done = subprocess.run(as_json, capture_output=True, text=True, cwd=work, env=env)
    try:
        document = json.loads(done.stdout)
    except ValueError:
        return [*problems, f"`vllm-hotfix status --json` printed no JSON document:\n{done.stdout}"]
    if document.get("hotfix_version") != version():
        problems.append(f"`vllm-hotfix status --json` says version {document.get('hotfix_version')}")
    checkout = document.get("hotfix_checkout", "absent")
    if checkout is not None:  # installed, not run from a checkout
        problems.append(f"`vllm-hotfix status --json` says checkout {checkout}")
    reasons = {fix["reason"] for fix in document.get("fixes", [])}
    if reasons != {"vLLM is not installed: nothing to fix"}:
        problems.append(f"`vllm-hotfix status --json` does not give each fix's reason: {reasons}")
    loader = subprocess.run([python, "-c", PLUGIN_LOADER], capture_output=True, text=True, cwd=work, env=env)
    if loader.returncode != 0:
        return [*problems, f"loading the plugin entry point failed:\n{loader.stderr}"]
    found = json.loads(loader.stdout)
    if found["plugins"] != [["vllm_hotfix", "vllm_hotfix.plugin:register"]]:
        problems.append(f"vllm.general_plugins in the venv: {found['plugins']}")
    if not found["module"].startswith(str(Path(python).parent.parent)):
        problems.append(f"vllm_hotfix imported from {found['module']}, not from the venv")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("dist_dir", type=Path, help="holds exactly one wheel and one sdist")
    parser.add_argument("--install", action="store_true", help="also install the wheel into a fresh venv")
    args = parser.parse_args()
    wheels, sdists = sorted(args.dist_dir.glob("*.whl")), sorted(args.dist_dir.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"expected one wheel and one sdist in {args.dist_dir}: {wheels + sdists}", file=sys.stderr)
        return 1
    problems = check_wheel(wheels[0]) + check_sdist(sdists[0])
    if args.install and not problems:
        with tempfile.TemporaryDirectory(prefix="vllm-hotfix-dist-check-") as tmp:
            python = install_into_venv(wheels[0], Path(tmp) / "venv", deps=True)
            problems += status_problems(python, Path(tmp))
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    print(f"{'FAILED' if problems else 'ok'}: {wheels[0].name}, {sdists[0].name}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
