#!/usr/bin/env bash
# Prepare, here (PyPI needed), what an air-gapped CUDA machine must receive to run the GPU checks
# (gpu/check.sh), then follow docs/gpu-runbook.md to send it and run them.
#
#   bash gpu/prepare.sh            # gpu-bundle/: part-NN (each < 60 MiB), manifest.json, tools/
#   bash gpu/prepare.sh --dry-run  # then, here, everything the runbook does but the GPU step:
#                                  # stage the parts one by one, assemble (sha256 of every part,
#                                  # of the archive, of every wheel), install offline into a venv
#                                  # whose only packages are a Python 3.12's torch 2.11.0, import
#                                  # vLLM 0.24.0/0.25.0/0.26.0 from it, run the checks' CPU parts
#
# The first run downloads ~830 MiB of vllm CUDA wheels and ~80 MiB of dependency wheels (kept in
# ~/.cache/vllm-hotfix/gpu-prepare, or VLLMHOTFIX_GPU_CACHE) and compresses for several minutes; the
# dry run downloads torch 2.11.0 for Python 3.12 once (~730 MiB) and needs a Python 3.12 (pyenv's, or
# VLLMHOTFIX_PYTHON312). A current gpu-bundle/ is reused; GPU_BUNDLE_REBUILD=1 rebuilds it.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=$(bash scripts/build-test-env.sh | tail -n 1)
PY="$ENV_DIR/venv/bin/python"
if [[ "${GPU_BUNDLE_REBUILD:-0}" == 1 ]]; then
    nice -n 10 "$PY" -m gpu.bundle prepare
else
    nice -n 10 "$PY" -m gpu.bundle prepare --if-stale
fi
"$PY" - <<'PY'
import json
m = json.load(open("gpu-bundle/manifest.json"))
print(f"gpu-bundle/: {len(m['parts'])} parts, archive {m['archive']['size'] / 2**20:.1f} MiB, sha256 {m['archive']['sha256']}")
for p in m["parts"]:
    print(f"  {p['name']}  {p['size'] / 2**20:5.1f} MiB  sha256 {p['sha256']}")
PY
if [[ "${1:-}" == "--dry-run" ]]; then
    exec nice -n 10 "$PY" -m gpu.dry_run
fi
