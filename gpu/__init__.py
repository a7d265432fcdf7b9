"""The GPU kit: what checks the hotfix on a CUDA machine, online or air-gapped (docs/gpu-runbook.md).

Run from the repository root: `bash gpu/check.sh install-online|install|v2|v32` on the CUDA machine
(online_env.py, or the offline bundle's assemble and install, bundle.py; then check_v2.py and
check_v32.py), and, where PyPI can be reached, `bash gpu/prepare.sh [--dry-run]` to build the
offline bundle and rehearse the machine's steps on CPU (dry_run.py). The checks drive vLLM through
harness/ as the CPU tests do.
"""
