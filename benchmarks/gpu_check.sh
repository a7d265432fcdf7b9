#!/usr/bin/env bash
# GPU check for one H200 (about 10 minutes): installs the real vllm==0.24.0 CUDA wheel (and 0.25.0
# as a PYTHONPATH overlay) on top of the machine's CUDA torch 2.11.0, then runs
# benchmarks/gpu_check.py: MLA on (no VLLM_MLA_DISABLE), default compilation and CUDA graphs,
# extract_hidden_states with the final layer, without the deepseek fix, with the hotfix, and 0.25.0.
# Needs PyPI, or WHEELS=/dir holding the vllm wheels and their missing dependencies (offline).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${GPU_CHECK_DIR:-$HOME/.cache/vllm-hotfix/gpu-env}"
PIP_SOURCE=()
[[ -n "${WHEELS:-}" ]] && PIP_SOURCE=(--no-index --find-links "$WHEELS")
if [[ ! -f "$ROOT/.stamp" ]]; then
    python3 -m venv --system-site-packages "$ROOT/venv"   # reuse the machine's CUDA torch
    "$ROOT/venv/bin/python" -m pip install "${PIP_SOURCE[@]}" "vllm==0.24.0" wrapt
    "$ROOT/venv/bin/python" -m pip install "${PIP_SOURCE[@]}" --no-deps --target "$ROOT/vllm-0.25.0" "vllm==0.25.0"
    touch "$ROOT/.stamp"
fi
VLLM_HOTFIX_TEST_ENV="$ROOT" exec "$ROOT/venv/bin/python" benchmarks/gpu_check.py
