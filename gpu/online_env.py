"""The GPU checks' environment on any CUDA machine that reaches PyPI: plain pip, no bundle.

It has harness/testenv.py's layout, like the offline bundle's `install` (gpu/bundle.py):
- venv/: vllm 0.24.0 with the torch it pins (2.11.0) and the checks' locked dependencies
  (gpu/requirements.txt).
- vllm-0.25.0/ and vllm-0.26.0/ beside it (`pip install --target`, no dependencies): they pin the same
  torch.
- newest/venv: vllm 0.32.0 with the torch it pins (2.13.0), for the releases where vLLM's own registry
  sends DeepseekV32ForCausalLM to the nvidia file on CUDA (0.29.0+).

The releases beside venv/ get what they require and 0.24.0 does not bring (harness/child/wheel_requirements.py
--unmet), installed into venv/. The offline bundle cannot carry newest/venv: it brings no torch.

    python3 -m gpu.online_env [--root DIR]      # what `bash gpu/check.sh install-online` runs
    python3 -m gpu.online_env --print           # the pip commands only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness.testenv import BUG, CHILD, FIXED, NEWEST, base_venv

WHEEL_REQUIREMENTS = CHILD / "wheel_requirements.py"
V32_OVERRIDE = "0.26.0"  # the newest vllm on torch 2.11.0: the nvidia V3.2 file through an override
BESIDE = (FIXED, V32_OVERRIDE)  # installed next to venv/ with --target, on venv/'s torch
DEFAULT_ROOT = Path.home() / "hotfix-gpu-env"


def commands(root: Path, base_python: str) -> list[list[str]]:
    """Every command that builds the environment under `root`, in order (pure: tests read it). The
    `{unmet}` placeholder is what `harness/child/wheel_requirements.py --unmet` prints for the downloaded
    wheel in venv/: the releases beside venv/ need what 0.24.0 does not bring."""
    venv, newest = root / "venv" / "bin", root / base_venv(NEWEST) / "venv" / "bin"
    pip = ["-m", "pip", "install", "--disable-pip-version-check"]
    steps = [[base_python, "-m", "venv", str(root / "venv")], [str(venv / "python"), *pip, f"vllm=={BUG}"]]
    for version in BESIDE:
        wheels = str(root / "wheels" / version)
        steps += [
            [str(venv / "python"), "-m", "pip", "download", "--no-deps", "-d", wheels, f"vllm=={version}"],
            [
                str(venv / "python"),
                *pip,
                "--no-deps",
                "--target",
                str(root / f"vllm-{version}"),
                f"{wheels}/*.whl",
            ],
            [str(venv / "python"), *pip, "{unmet}"],
        ]
    steps += [
        [base_python, "-m", "venv", str(root / base_venv(NEWEST) / "venv")],
        [str(newest / "python"), *pip, f"vllm=={NEWEST}", "wrapt"],
    ]
    return steps


def install(root: Path, base_python: str) -> None:
    """Build the environment, from nothing, with pip and PyPI."""
    if root.exists():
        shutil.rmtree(root)
    wheel = ""
    for planned in commands(root, base_python):
        step: list[str] = []
        for arg in planned:
            if arg.endswith("/*.whl"):  # the release just downloaded
                (wheel,) = (str(w) for w in Path(arg.removesuffix("/*.whl")).glob("*.whl"))
                step.append(wheel)
            elif arg == "{unmet}":
                unmet = [planned[0], str(WHEEL_REQUIREMENTS), wheel, "--unmet"]
                step += subprocess.run(unmet, check=True, capture_output=True, text=True).stdout.split("\n")
            else:
                step.append(arg)
        step = [arg for arg in step if arg]
        if step[-1] == "--disable-pip-version-check":  # nothing unmet
            continue
        print("+", " ".join(step), flush=True)
        subprocess.run(step, check=True)
    (root / ".stamp").write_text(json.dumps({"base_python": base_python, "from": "pypi"}) + "\n")
    beside = ", ".join(f"{root}/vllm-{v}" for v in BESIDE)
    print(f"installed: {root}/venv (vllm {BUG}), {beside}, {root}/{base_venv(NEWEST)}/venv (vllm {NEWEST})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=Path(os.environ.get("GPU_CHECK_DIR") or DEFAULT_ROOT))
    parser.add_argument("--base-python", default=shutil.which("python3") or sys.executable)
    parser.add_argument("--print", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    if args.print:
        for step in commands(args.root, args.base_python):
            print(" ".join(step))
        return
    install(args.root, args.base_python)


if __name__ == "__main__":
    main()
