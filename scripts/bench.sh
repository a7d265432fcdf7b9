#!/usr/bin/env bash
# Run one benchmark with the test environment's Python: bash scripts/bench.sh NAME [ARGS...]
# NAME is a file of benchmarks/ without .py: startup, patch_cost, forward_time, engine_throughput,
# v32_tp_cost, verify_cost, audit_cost, audit_scale, audit_max_tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:?usage: bash scripts/bench.sh NAME [ARGS...]}"; shift
ENV_DIR=$(bash scripts/build-test-env.sh | tail -n 1)
export VLLMHOTFIX_TEST_ENV="$ENV_DIR"
exec "$ENV_DIR/venv/bin/python" "benchmarks/$name.py" "$@"
