"""Dry run, on this CPU machine, of everything the GPU runbook does but the GPU step.

A stand-in for the GPU machine's python3 (3.12 with torch 2.11.0 and only torch's own dependencies:
its nvidia libraries, triton, sympy, ...): a Python 3.12 venv into which torch 2.11.0's cp312 wheel
(the same CUDA build the GPU machine has, downloaded from PyPI once and cached) is installed
offline, with the nvidia library packages linked from the test environment (the same versions,
pure data, no Python-version tag). Nothing else is installed in it.

Then, as on the GPU machine: the parts are copied one by one into a fake working tree and staged
(`gpu.bundle stage`), assembled (sha256 of every part, of the archive, of every file), installed
offline (`gpu.bundle install`: `pip install --no-index --find-links`), and vLLM is imported from
that install alone: the venv's own site-packages plus the base Python's, nothing else. What cannot
run without a GPU (anything that loads vllm._C: it links libcuda.so.1) is listed, not run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from gpu.bundle import BUNDLE_DIR, CACHE, PLATFORMS, say
from harness.testenv import child_result


def python312() -> str:
    """A CPython 3.12 here: VLLMHOTFIX_PYTHON312, else one on PATH, else pyenv's."""
    if os.environ.get("VLLMHOTFIX_PYTHON312"):
        return os.environ["VLLMHOTFIX_PYTHON312"]
    candidates = [
        *sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")),
        Path("/usr/bin/python3.12"),
    ]
    for candidate in candidates:
        if candidate.exists():
            return str(candidate)
    raise SystemExit("no Python 3.12 here: set VLLMHOTFIX_PYTHON312 (the GPU machine runs 3.12)")


TORCH_WHEELS = ("torch==2.11.0", "triton==3.6.0", "cuda-bindings==13.5.0")
# torch 2.11.0's Python dependencies (its METADATA), at the test environment's versions
TORCH_DEPS = (
    "cuda-pathfinder==1.9.1",
    "filelock==4.3.1",
    "fsspec==2026.9.0",
    "jinja2==3.1.6",
    "markupsafe==3.0.4",
    "mpmath==1.3.0",
    "networkx==3.6.1",
    "setuptools==77.0.3",
    "sympy==1.14.0",
    "typing-extensions==4.16.0",
)

# Modules the checks import on the GPU machine (the engine, the MLA and DSA backends, the models,
# the compile path); each must import from the install. `vllm.platforms.cuda` loads vllm._C, which
# links libcuda.so.1 (the driver): here it is expected to fail with exactly that.
IMPORTS = (
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.mla.flashmla",
    "vllm.v1.attention.backends.mla.flashmla_sparse",
    "vllm.v1.attention.backends.mla.triton_mla",
    "vllm.v1.attention.backends.mla.indexer",
    "vllm.v1.spec_decode.extract_hidden_states",
    "vllm.model_executor.models.deepseek_v2",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.compilation.backends",
    "vllm.compilation.piecewise_backend",
    "vllm.compilation.cuda_graph",
    "vllm.compilation.passes.pass_manager",
    "vllm.distributed.device_communicators.cuda_communicator",
    "vllm.tokenizers.hf",
    "vllm.transformers_utils.config",
    "vllm.v1.structured_output",
    "vllm.v1.sample.rejection_sampler",
    "vllm.utils.deep_gemm",
    "vllm.model_executor.layers.sparse_attn_indexer",
    "vllm_hotfix",
)
NEEDS_DRIVER = (
    "vllm.platforms.cuda",
    "vllm.vllm_flash_attn",
    "vllm.v1.attention.backends.mla.prefill.flash_attn",  # names fa_utils defines once FA3 loads
    "vllm.models.deepseek_v32.nvidia.model",
)

# A module whose import stops at a `torch.ops._C.<op>` that vllm._C (not loadable without the driver)
# would have registered is imported again with a placeholder schema for that op (as
# harness/child/tp_model.py does on CPU), so that the rest of its import chain is checked too.
_PROBE = r"""
import importlib, json, os, sys
from harness.child.tp_model import import_with_placeholder_ops
result = {"ok": {}, "failed": {}, "version": None, "paths": [], "origins": {}, "placeholders": {}}
for name in sys.argv[1].split(","):
    try:
        module = importlib.import_module(name)
        result["ok"][name] = getattr(module, "__file__", None)
    except AttributeError as error:
        if "'_C' object has no attribute" not in str(error):
            result["failed"][name] = f"{type(error).__name__}: {error}"[:300]
            continue
        try:
            module = import_with_placeholder_ops(name) if "deepseek_v32" in name else None
            if module is None:
                raise error
            result["ok"][name] = module.__file__
            result["placeholders"][name] = "placeholder _C op schemas (no driver here)"
        except BaseException as again:
            result["failed"][name] = f"{type(again).__name__}: {again}"[:300]
    except BaseException as error:
        result["failed"][name] = f"{type(error).__name__}: {error}"[:300]
import vllm
result["version"] = vllm.__version__
result["paths"] = sys.path
for name, module in list(sys.modules.items()):
    top = name.split(".")[0]
    origin = getattr(module, "__file__", None)
    if origin and top not in result["origins"]:
        result["origins"][top] = origin
print("PROBE " + json.dumps(result))
"""


def base_python(work: Path, test_env_site: Path, cache: Path = CACHE) -> str:
    """The stand-in for the GPU machine's python3 (module docstring); built once under `work`."""
    venv = work / "gpu-python"
    python = venv / "bin" / "python"
    if (venv / ".ready").exists():
        return str(python)
    shutil.rmtree(venv, ignore_errors=True)
    wheels = cache / "torch-cp312"
    wheels.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    say("downloading torch 2.11.0 for Python 3.12 (once, ~730 MiB with triton)")
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps"),
            *("--only-binary=:all:", "--implementation", "cp", "--python-version", "3.12", *platforms),
            *("-d", str(wheels), *TORCH_WHEELS, *TORCH_DEPS),
        ],
        check=True,
    )
    subprocess.run([python312(), "-m", "venv", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python3.12/site-packages")
    names = [req.split("==")[0].replace("-", "_").lower() for req in (*TORCH_WHEELS, *TORCH_DEPS)]
    chosen = [w for w in wheels.glob("*.whl") if w.name.split("-")[0].lower() in names]
    subprocess.run(
        [
            *(str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"),
            *("--no-index", "--no-deps", "--no-compile", *map(str, chosen)),
        ],
        check=True,
    )
    # The nvidia library packages: data only (no Python-version tag), the versions torch 2.11.0 pins.
    for entry in sorted(test_env_site.iterdir()):
        if entry.name == "nvidia" or entry.name.startswith(("nvidia_", "cuda_toolkit-")):
            target = site / entry.name
            if not target.exists():
                target.symlink_to(entry)
    check = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    if check.returncode != 0 or not check.stdout.startswith("2.11.0"):
        raise SystemExit(f"the stand-in Python does not import torch 2.11.0:\n{check.stderr[-3000:]}")
    (venv / ".ready").write_text(check.stdout)
    return str(python)


def dry_run(work: Path, bundle: Path, test_env_site: Path) -> dict:
    """Stage, assemble, install and import, as the runbook does on the GPU machine; return a report.

    The stand-in is `python3` on PATH, and the steps are the runbook's own commands (`python3 -m
    gpu.bundle stage`, `bash gpu/check.sh install`), run from this checkout, with
    the zstd program hidden so that the carried zstandard wheel unpacks the archive."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    python = base_python(work, test_env_site)
    repo = Path(__file__).resolve().parent.parent
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "python3"  # a script, not a link: a linked venv python loses its venv
    wrapper.write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
    wrapper.chmod(0o755)
    stage_dir, root = work / "stage", work / "gpu-env"
    shutil.rmtree(stage_dir, ignore_errors=True)
    machine = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VLLM_"))}
    machine |= {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "GPU_CHECK_DIR": str(root),
        "GPU_BUNDLE_STAGE": str(stage_dir),
        "VLLMHOTFIX_NO_ZSTD_PROGRAM": "1",
    }
    # One `stage` per part, as the runbook allows: the part arrives in the working tree, is checked, moved.
    for index, part in enumerate(manifest["parts"]):
        incoming = Path(tempfile.mkdtemp(prefix="incoming-", dir=work))
        shutil.copy2(bundle / part["name"], incoming / part["name"])
        shutil.copy2(bundle / "manifest.json", incoming / "manifest.json")
        if index == len(manifest["parts"]) - 1:  # the tools come with the last part
            (incoming / "tools").mkdir()
            for tool in manifest["tools"]:
                shutil.copy2(bundle / tool["name"], incoming / tool["name"])
        command = ["python3", "-m", "gpu.bundle", "stage", "--incoming", str(incoming)]
        command += ["--manifest", str(incoming / "manifest.json"), "--stage", str(stage_dir)]
        subprocess.run(command, env=machine, cwd=repo, check=True)
        shutil.rmtree(incoming)
    subprocess.run(["bash", "gpu/check.sh", "install"], env=machine, cwd=repo, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VLLM_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)  # vllm_hotfix, as the check has it
    report = {"manifest_archive_sha256": manifest["archive"]["sha256"], "versions": {}}
    for version, overlay in (
        ("0.24.0", None),
        ("0.25.0", root / "vllm-0.25.0"),
        ("0.26.0", root / "vllm-0.26.0"),
    ):
        run_env = dict(env)
        if overlay is not None:
            run_env["PYTHONPATH"] = f"{overlay}{os.pathsep}{env['PYTHONPATH']}"
        modules = list(IMPORTS) + list(NEEDS_DRIVER)
        done = subprocess.run(
            [str(root / "venv" / "bin" / "python"), "-c", _PROBE, ",".join(modules)],
            env=run_env,
            cwd=tempfile.gettempdir(),
            capture_output=True,
            text=True,
            timeout=1800,
        )
        probed = child_result(done.stdout, "PROBE ")
        if probed is None:
            raise SystemExit(f"import probe for {version} gave nothing:\n{done.stderr[-4000:]}")
        report["versions"][version] = probed
    return report


# The checks' own Python, run with the installed venv and vllm 0.26.0: they import; the hotfix's wheel
# builds and installs with that Python (the plugin way: setuptools from the lock, pip from the base
# Python); the V3.2 checkpoint builds; transformers and vLLM's own config loader read it.
_CHECKS_PROBE = r"""
import json, sys, tempfile
import gpu.check_v2, gpu.check_v32, gpu.check_eagle3, gpu.check_extract_async
from harness.child.tiny_checkpoint import build, V32_FIELDS
out = build(tempfile.mkdtemp(prefix="v32-ckpt-") + "/ckpt", v32=True)
from transformers import DeepseekV3Config
config = DeepseekV3Config.from_pretrained(out)
from vllm.transformers_utils.config import get_config
seen = get_config(out, trust_remote_code=False)
from safetensors import safe_open
import json as j, os
index = j.load(open(os.path.join(out, "model.safetensors.index.json")))
names = sorted(index["weight_map"])
from harness.wheel import hotfix_wheel, pip_install_wheel  # the plugin way, as harness/ways_in.py does
plugin = tempfile.mkdtemp(prefix="plugin-")
pip_install_wheel(sys.executable, __import__("pathlib").Path(plugin))
result = {
    "hotfix_wheel": hotfix_wheel().name,
    "plugin_entry_points": sorted(os.listdir(plugin)),
    "transformers": {k: getattr(config, k, None) for k in V32_FIELDS},
    "vllm": {k: getattr(seen, k, None) for k in V32_FIELDS},
    "vllm_architectures": getattr(seen, "architectures", None),
    "vllm_model_type": getattr(seen, "model_type", None),
    "indexer_weights": [n for n in names if ".indexer." in n][:5],
    "tensors": len(names),
}
print("CHECKS " + json.dumps(result))
"""


def check_scripts(root: Path, repo: Path) -> dict:
    """Run _CHECKS_PROBE with the install (vllm 0.26.0 overlay); return what it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VLLM_"))}
    env["PYTHONPATH"] = f"{root / 'vllm-0.26.0'}{os.pathsep}{repo}"
    done = subprocess.run(
        [str(root / "venv" / "bin" / "python"), "-c", _CHECKS_PROBE],
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    line = [x for x in done.stdout.splitlines() if x.startswith("CHECKS ")]
    if done.returncode != 0 or not line:
        return {"error": done.stderr[-4000:]}
    return json.loads(line[-1][len("CHECKS ") :])


def check_report(report: dict, root: Path, base: str) -> list[str]:
    """What is wrong with a dry run's report (empty: nothing)."""
    problems = []
    base_site = subprocess.run(
        [base, "-c", "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # the base Python's torch, whatever the working directory holds
    ).stdout.strip()
    allowed = (
        str(root),
        base_site,
        str(Path(__file__).resolve().parent.parent),
        "/root/.pyenv",
        sys.base_prefix,
    )
    for version, result in report["versions"].items():
        if result["version"] != version:
            problems.append(f"{version}: imported vllm {result['version']}")
        for name in IMPORTS:
            if name in result["failed"] and not (version == "0.24.0" and "deepseek_v32" in name):
                problems.append(f"{version}: import {name} failed: {result['failed'][name]}")
        for name in NEEDS_DRIVER:
            error = result["failed"].get(name, "")
            if name in result["ok"] or (version == "0.24.0" and "deepseek_v32" in name):
                continue  # 0.24.0 has no deepseek_v32 package
            # Without the driver vllm._C and FlashAttention 3 do not load; what follows from that is
            # expected. A package missing from the install is not: ModuleNotFoundError of a non-vllm name.
            missing = error.startswith("ModuleNotFoundError") and "'vllm" not in error
            if missing or not any(k in error for k in ("libcuda.so.1", "_vllm_fa", "fa_utils", "'_C'")):
                problems.append(
                    f"{version}: {name} failed for another reason than the missing driver: {error}"
                )
        for top, origin in result["origins"].items():
            if top.startswith("vllm_hotfix_generated_"):
                continue  # the hotfix's generated forward, in its own cache directory (by design)
            if not origin.startswith(allowed) and not origin.startswith(
                str(Path(base).resolve().parent.parent)
            ):
                problems.append(f"{version}: module {top} came from outside the install: {origin}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", type=Path, default=CACHE / "dry-run")
    parser.add_argument("--bundle", type=Path, default=BUNDLE_DIR)
    parser.add_argument("--test-env", type=Path, default=Path.home() / ".cache" / "vllm-hotfix" / "test-env")
    args = parser.parse_args()
    (site,) = (args.test_env / "venv" / "lib").glob("python*/site-packages")
    args.work.mkdir(parents=True, exist_ok=True)
    report = dry_run(args.work, args.bundle, site)
    report["checks"] = check_scripts(args.work / "gpu-env", Path(__file__).resolve().parent.parent)
    (args.work / "report.json").write_text(json.dumps(report, indent=1))
    problems = check_report(report, args.work / "gpu-env", base_python(args.work, site))
    checks = report["checks"]
    if "error" in checks:
        problems.append(f"the checks' Python (vllm 0.26.0): {checks['error']}")
    else:
        print(
            "checks' Python: imports; V3.2 checkpoint read by vLLM 0.26.0 as "
            f"{checks['vllm_architectures']}, "
            f"model_type {checks['vllm_model_type']}, {checks['vllm']}; {checks['tensors']} tensors"
        )
        if not any(n.endswith(".dist-info") for n in checks["plugin_entry_points"]):
            problems.append(f"the hotfix's wheel did not install with the install's pip: {checks}")
        if checks["vllm"] != checks["transformers"] or checks["vllm_architectures"] != [
            "DeepseekV32ForCausalLM"
        ]:
            problems.append(f"V3.2 checkpoint config as read: {checks}")
    for version, result in report["versions"].items():
        print(f"vllm {version}: {len(result['ok'])} modules imported from the install; not here (no driver):")
        for name, error in result["failed"].items():
            print(f"    {name}: {error[:160]}")
    if problems:
        print("DRY RUN FAILED:\n  " + "\n  ".join(problems))
        sys.exit(1)
    print(
        f"DRY RUN OK: archive sha256 {report['manifest_archive_sha256']}; report in {args.work}/report.json"
    )


if __name__ == "__main__":
    main()
