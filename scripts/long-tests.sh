#!/usr/bin/env bash
# The long suite: the tests marked `long` (compiled runs repeated in bfloat16), which
# scripts/test.sh and CI leave out to stay under an hour. Same environment and checks as
# scripts/test.sh; prints pytest's summary and, last, one line to copy into docs/development.md
# ("The long suite"): the date, the commit, the CPU and the result. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/test.sh -m long "$@"
rc=$?
cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "long suite: $(date -u +%F) at $(git log --oneline -1 --format=%h), $(nproc) cores of ${cpu:-an unknown CPU}: exit $rc in $(( $(date +%s) - start )) s"
exit "$rc"
