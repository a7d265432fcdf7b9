#!/usr/bin/env bash
# The GPU checks, on a CUDA machine, from the repository root (docs/gpu-runbook.md):
#
#   bash gpu/check.sh install-online  # with PyPI: plain pip (gpu/online_env.py)
#   bash gpu/check.sh install         # air-gapped: assemble the offline bundle's staged
#                                     # parts (sha256 of each part, of the archive, of
#                                     # every wheel), then install offline
#   bash gpu/check.sh v2              # DeepseekV2Model, vllm 0.24.0 vs the hotfix vs 0.25.0,
#                                     # then `vllm-hotfix verify` (fix off: FAIL; on: PASS)
#   bash gpu/check.sh v32 [--release 0.26.0|0.32.0]
#                                     # DeepseekV32Model (nvidia file), stock vs the hotfix,
#                                     # then `vllm-hotfix verify`; 0.32.0 (vLLM's registry picks
#                                     # the file) needs install-online: no torch 2.13 in the bundle
#   bash gpu/check.sh eagle3 [--release 0.26.0|0.32.0]
#                                     # Model Runner V2 with an EAGLE3 draft whose ids sit under
#                                     # eagle_config: the layers the target feeds it, fix off
#                                     # (defaults) and on (declared), and the V1 runner's
#   bash gpu/check.sh extract-async   # extract_hidden_states under async scheduling, vllm 0.24.0:
#                                     # sync vs async stock vs async + hotfix (extract-next-token)
#
# Both installs build, under GPU_CHECK_DIR (default ~/hotfix-gpu-env), the layout harness/testenv.py
# runs: venv/ with vllm 0.24.0, vllm 0.25.0 and 0.26.0 as PYTHONPATH overlays beside it, and (online
# only) newest/venv with vllm 0.32.0. `install` makes venv/ with no packages of its own but python3's
# torch, and installs the locked dependencies (gpu/requirements.txt) with `pip install
# --no-index --find-links`. The checks print one line per check (PASS/FAIL) and exit 1 on any
# failure. `v2` ran on one H200 from the offline bundle (2026-12-04, docs/gpu-runbook.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${GPU_CHECK_DIR:-$HOME/hotfix-gpu-env}"
STAGE="${GPU_BUNDLE_STAGE:-$HOME/hotfix-bundle}"
export PYTHONUNBUFFERED=1 VLLMHOTFIX_TEST_ENV="$ROOT" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
case "${1:-}" in
    install)
        python3 -m gpu.bundle assemble --stage "$STAGE" --tools "$STAGE/tools" --out "$STAGE/unpacked"
        python3 -m gpu.bundle install --wheels "$STAGE/unpacked/wheels" --root "$ROOT" \
            --base-python "$(command -v python3)"
        ;;
    install-online)
        python3 -m gpu.online_env --root "$ROOT"
        ;;
    v2) exec "$ROOT/venv/bin/python" gpu/check_v2.py ;;
    v32) exec "$ROOT/venv/bin/python" gpu/check_v32.py "${@:2}" ;;
    eagle3) exec "$ROOT/venv/bin/python" gpu/check_eagle3.py "${@:2}" ;;
    extract-async) exec "$ROOT/venv/bin/python" gpu/check_extract_async.py ;;
    *) echo "usage: bash gpu/check.sh install-online|install|v2|v32|eagle3 [--release R]|extract-async" >&2
       exit 2 ;;
esac
