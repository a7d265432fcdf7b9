#!/usr/bin/env bash
# The demonstration on real vLLM: builds (or reuses) the test environment, then shows the bug on
# vLLM 0.24.0, the same run fixed by vllm-hotfix, and a layer-by-layer comparison with vLLM 0.25.0.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=$(bash scripts/build-test-env.sh | tail -n 1)
export VLLMHOTFIX_TEST_ENV="$ENV_DIR"
exec "$ENV_DIR/venv/bin/python" scripts/demo.py "$@"
