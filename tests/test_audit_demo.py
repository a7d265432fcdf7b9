"""scripts/audit_demo.py without an engine: its arguments, its planting and its reading of the
audit's output, so that a demonstration that passes means what its summary says. Its whole run
(a server, a client, two audits) is the proof of the rest: `bash scripts/audit-demo.sh`."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors.torch")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "audit_demo.py"


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("audit_demo", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def audit_output(*wrong: str, ok: int = 5, files: int = 6, verdict: str = "FAIL", code: int = 1) -> str:
    """The text `vllm-hotfix audit` prints (vllm_hotfix/commands/audit.py: Audit.said)."""
    lines = ["pre-flight check: PASS (every forward of the 1 worker process(es) was checked and passed)"]
    lines += [f"wrong {line}" for line in wrong]
    counts = f"{ok} ok, {len(wrong)} wrong, {files - ok - len(wrong)} n/a of {files} files audited"
    return "\n".join([*lines, f"verdict: {verdict} ({counts}); exit {code}"])


def test_the_planted_copy_is_judged_right_only_as_expected(demo: ModuleType, tmp_path: Path) -> None:
    planted = tmp_path / "planted" / "hs_2.safetensors"
    found = f"{planted}: id 2: max rel diff 0.334 (scaled by 1.5)"
    assert all(ok for ok, _ in demo.judge_planted(1, audit_output(found), 6, planted))
    failing = {
        "exit 0": (0, audit_output(found)),
        "another file": (1, audit_output(found.replace("hs_2", "hs_3"))),
        "two files": (1, audit_output(found, found.replace("hs_2", "hs_3"), ok=4)),
        "another id": (1, audit_output(found.replace("id 2:", "id 3:"))),
        "two ids": (1, audit_output(found + "; id 3: max rel diff 0.3 (scaled by 1.5)")),
        "another cause": (1, audit_output(found.replace("scaled by 1.5", "zeros"))),
        "a file n/a": (1, audit_output(found, ok=4)),
    }
    for name, (code, stdout) in failing.items():
        assert not all(ok for ok, _ in demo.judge_planted(code, stdout, 6, planted)), name


def test_the_data_as_made_is_judged_ok_only_when_every_file_is(demo: ModuleType) -> None:
    assert all(ok for ok, _ in demo.judge_as_made(0, audit_output(ok=6, verdict="PASS", code=0), 6))
    wrong = audit_output("/d/hs_1.safetensors: id 4: max rel diff 1 (zeros)")
    assert not all(ok for ok, _ in demo.judge_as_made(1, wrong, 6))
    assert not all(ok for ok, _ in demo.judge_as_made(2, audit_output(ok=5, verdict="UNKNOWN", code=2), 6))


def test_planting_scales_only_the_id_in_the_one_file(demo: ModuleType, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        states = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        safetensors.save_file(
            {"hidden_states": states, "token_ids": torch.arange(5)}, str(data / f"hs_{i}.safetensors")
        )
    demo.plant(data, tmp_path / "copy", "hs_2.safetensors")
    for name in ("hs_0.safetensors", "hs_1.safetensors"):
        assert (tmp_path / "copy" / name).read_bytes() == (data / name).read_bytes()
    before = safetensors.load_file(str(data / "hs_2.safetensors"))["hidden_states"]
    after = safetensors.load_file(str(tmp_path / "copy" / "hs_2.safetensors"))["hidden_states"]
    column = demo.IDS.index(demo.PLANTED_ID)
    assert torch.equal(after[:, column], before[:, column] * 1.5)
    others = [c for c in range(4) if c != column]
    assert torch.equal(after[:, others], before[:, others])


def test_a_work_directory_in_use_or_too_few_prompts_are_refused(demo: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError):
        demo.work_dir(str(tmp_path / "used"))
    assert demo.work_dir(str(tmp_path / "new")) == tmp_path / "new"
    with pytest.raises(argparse.ArgumentTypeError):
        demo.prompts(str(demo.PLANTED_ID))  # the planted file hs_<id> would not exist
    assert demo.prompts("6") == 6
