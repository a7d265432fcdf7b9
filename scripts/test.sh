#!/usr/bin/env bash
# Every check of the project: builds (or reuses) the vLLM test environment, lints, type-checks, runs
# pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not engine"` for the fast subset.
# The long suite (tests marked `long`: repeats in another dtype) is left out, to keep CI under an
# hour; `bash scripts/long-tests.sh` runs it. A `-m` of yours replaces `-m "not long"` (pytest's
# last -m wins).
# Two pytest-xdist workers (VLLMHOTFIX_TEST_WORKERS, 0 for none): one engine run keeps about one core
# busy. Tests that share cached engine runs carry the same xdist_group and stay on one worker.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=$(bash scripts/build-test-env.sh --all | tail -n 1)
# Network tests fail, not skip, when PyPI cannot be reached (CI must check the compatibility table);
# offline: VLLMHOTFIX_REQUIRE_NETWORK=0 bash scripts/test.sh
export VLLMHOTFIX_TEST_ENV="$ENV_DIR" VLLMHOTFIX_REQUIRE_ENV=1
export VLLMHOTFIX_REQUIRE_NETWORK="${VLLMHOTFIX_REQUIRE_NETWORK-1}"
"$ENV_DIR/venv/bin/ruff" check .
"$ENV_DIR/venv/bin/ruff" format --check .
# strict (pyproject.toml): the package is typed, and so is the release tooling moved out of it
"$ENV_DIR/venv/bin/mypy" vllm_hotfix harness/releases harness/marked_block.py harness/fix_docs.py
exec "$ENV_DIR/venv/bin/python" -m pytest -n "${VLLMHOTFIX_TEST_WORKERS:-2}" --dist loadgroup -m "not long" "$@"
