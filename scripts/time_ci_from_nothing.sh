#!/usr/bin/env bash
# Time CI's job as a new machine would run it: a fresh clone of this checkout's HEAD, the test
# environment built from nothing (an empty directory, no pip cache), then `.ci/run`'s command with
# pytest's 60 slowest durations. Every output line is time-stamped; the last line gives the total.
# The figures in docs/development.md ("CI and how long it takes") come from this script. About 50 min
# and 18 GB of disk (the environment is removed at the end; KEEP=1 keeps it). Usage: bash scripts/time_ci_from_nothing.sh
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d /tmp/vllm-hotfix-ci-XXXXXX)"
git clone --quiet "$REPO" "$WORK/clone"
export VLLMHOTFIX_TEST_ENV="$WORK/test-env" PIP_NO_CACHE_DIR=1 CI=true
start=$(date +%s)
echo "$(date -u '+%F %T') fresh clone of $(git -C "$WORK/clone" log --oneline -1), environment in $VLLMHOTFIX_TEST_ENV"
(cd "$WORK/clone" && bash scripts/test.sh --durations=60) 2>&1 | while IFS= read -r line; do
    printf '%(%H:%M:%S)T %s\n' -1 "$line"
done
rc=${PIPESTATUS[0]}
echo "rc=$rc total $(( $(date +%s) - start )) s"
[[ "${KEEP:-0}" == 1 ]] || rm -rf "$WORK"
exit "$rc"
