#!/usr/bin/env bash
# The GPU checks, on the lent GPU machine (one H200, torch 2.11.0+cu130, no network), from the
# repository root, after the bundle's parts were staged there (docs/gpu-runbook.md says how):
#
#   bash benchmarks/gpu_check.sh install   # assemble the staged parts (sha256 of each part, of the
#                                          # archive, of every wheel), then install offline
#   bash benchmarks/gpu_check.sh v2        # DeepseekV2Model, vllm 0.24.0 vs the hotfix vs 0.25.0
#   bash benchmarks/gpu_check.sh v32       # DeepseekV32Model, vllm 0.26.0, stock vs the hotfix
#
# `install` builds, under GPU_CHECK_DIR (default /root/hotfix-gpu-env), a venv whose only preinstalled
# packages are python3's own (its torch), with vllm 0.24.0 and the locked dependencies
# (benchmarks/gpu/requirements.txt) installed by `pip install --no-index --find-links`, and vllm
# 0.25.0 and 0.26.0 as PYTHONPATH overlays: the layout harness/testenv.py runs. The checks print one
# line per check (PASS/FAIL) and exit 1 on any failure. Nothing here has been run on a GPU yet.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${GPU_CHECK_DIR:-/root/hotfix-gpu-env}"
STAGE="${GPU_BUNDLE_STAGE:-/root/hotfix-bundle}"
export PYTHONUNBUFFERED=1 VLLM_HOTFIX_TEST_ENV="$ROOT" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
case "${1:-}" in
    install)
        python3 -m harness.gpu_bundle assemble --stage "$STAGE" --tools "$STAGE/tools" --out "$STAGE/unpacked"
        python3 -m harness.gpu_bundle install --wheels "$STAGE/unpacked/wheels" --root "$ROOT" \
            --base-python "$(command -v python3)"
        ;;
    v2) exec "$ROOT/venv/bin/python" benchmarks/gpu_check.py ;;
    v32) exec "$ROOT/venv/bin/python" benchmarks/gpu_check_v32.py ;;
    *) echo "usage: bash benchmarks/gpu_check.sh install|v2|v32" >&2; exit 2 ;;
esac
