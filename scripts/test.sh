#!/usr/bin/env bash
# Every check of the project: builds (or reuses) the vLLM test environment, lints, runs pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not engine"` for the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=$(bash scripts/build-test-env.sh | tail -n 1)
export VLLM_HOTFIX_TEST_ENV="$ENV_DIR" VLLM_HOTFIX_REQUIRE_ENV=1
"$ENV_DIR/venv/bin/ruff" check .
"$ENV_DIR/venv/bin/ruff" format --check .
exec "$ENV_DIR/venv/bin/python" -m pytest "$@"
