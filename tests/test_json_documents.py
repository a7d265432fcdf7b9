"""`--json` is one JSON document on stdout, nothing else, for every outcome of every command: usage
errors, vLLM missing, a report directory that is a file, an invalid setting, a failure of the
command itself; each begins with the envelope (schema, command, verdict, exit_code, reason) and its
exit_code is the process's. Each command runs in a subprocess, as a user runs it; none starts an
engine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.testenv import REPO, outside_checkout

ENVELOPE = ["schema", "command", "verdict", "exit_code", "reason"]
VERDICT = {0: "PASS", 1: "FAIL", 2: "UNKNOWN", 3: "UNKNOWN", 4: "UNKNOWN"}


def run(python: str, path: list[str], argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLLMHOTFIX_", "PYTHON"))}
    return subprocess.run(
        [python, *argv],
        capture_output=True,
        text=True,
        env={**base, "PYTHONPATH": os.pathsep.join([str(REPO), *path]), **env},
        cwd=outside_checkout(),
        timeout=300,
    )


def one_document(done: subprocess.CompletedProcess[str], command: str, code: int) -> dict:
    """stdout is exactly one JSON document (json.loads refuses anything after it), with the
    envelope's keys first and in order, and the process's exit code."""
    said = f"exit {done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}"
    found = json.loads(done.stdout)
    assert list(found)[:5] == ENVELOPE, said
    assert (found["command"], found["exit_code"], done.returncode) == (command, code, code), said
    assert found["verdict"] == VERDICT[code] and isinstance(found["reason"], str) and found["reason"], said
    assert isinstance(found["schema"], int), said
    return found


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    model, data, site = tmp_path / "model", tmp_path / "data", tmp_path / "site"
    for directory in (model, data, site):
        directory.mkdir()
    (data / "hs_0.safetensors").write_bytes(b"not read")
    (tmp_path / "a-file").write_text("x")
    return {"model": str(model), "data": str(data), "site": str(site), "file": str(tmp_path / "a-file")}


def cases(p: dict[str, str]) -> list[tuple[list[str], dict[str, str], str, int]]:
    """(argv after `-m vllm_hotfix`, environment, command, exit code), none needing vLLM."""
    return [
        (["--json"], {}, "vllm-hotfix", 4),
        (["statu", "--json"], {}, "vllm-hotfix", 4),
        (["-V", "--json"], {}, "version", 0),
        (["status", "--jsn", "--json"], {}, "status", 4),
        (["verify", "/nonexistent", "--json"], {}, "verify", 4),
        (["verify", p["model"], "--prompt-length", "16", "--json"], {}, "verify", 4),
        (["audit", p["data"], p["model"], "--json"], {}, "audit", 4),
        (["audit-merge", p["file"], "--json"], {}, "audit-merge", 4),
        (["clean", "--days", "5", "--all", "--json"], {}, "clean", 4),
        (["clean", "--dry-run", "--json"], {"VLLMHOTFIX_CACHE_DIR": p["site"]}, "clean", 0),
        (["install-site-hook", "--site-dir", p["file"], "--json"], {}, "install-site-hook", 4),
        (["install-site-hook", "--site-dir", p["site"], "--json"], {}, "install-site-hook", 0),
        (["uninstall-site-hook", "--site-dir", p["site"], "--json"], {}, "uninstall-site-hook", 0),
        (["uninstall-sitecustomize", "--site-dir", p["site"], "--json"], {}, "uninstall-site-hook", 0),
    ]


def test_every_usage_error_and_the_small_commands(
    bare_python: tuple[str, str], places: dict[str, str]
) -> None:
    python, only_wrapt = bare_python
    for argv, env, command, code in cases(places):
        one_document(run(python, [only_wrapt], ["-m", "vllm_hotfix", *argv], **env), command, code)


def test_without_vllm(bare_python: tuple[str, str], places: dict[str, str]) -> None:
    python, only_wrapt = bare_python
    for argv, command, code in [
        (["status", "--json"], "status", 2),
        (["verify", places["model"], "--json"], "verify", 3),
        (["audit", places["data"], places["model"], "--ids", "1", "--json"], "audit", 3),
    ]:
        found = one_document(run(python, [only_wrapt], ["-m", "vllm_hotfix", *argv]), command, code)
        assert "no vLLM importable" in found["reason"], found


def test_a_failure_of_the_command_itself(bare_python: tuple[str, str]) -> None:
    """An unexpected exception (planted in clean): exit 3, its traceback on stderr, the document on stdout."""
    python, only_wrapt = bare_python
    crash = (
        "import sys, vllm_hotfix.commands.clean as c; c.clean = lambda *a, **k: 1 / 0;"
        " from vllm_hotfix.commands.cli import main; sys.exit(main(['clean', '--json']))"
    )
    done = run(python, [only_wrapt], ["-c", crash])
    found = one_document(done, "clean", 3)
    assert "ZeroDivisionError" in found["reason"] and "Traceback" in done.stderr


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the test environment's vLLM")
def test_with_vllm_a_report_dir_that_is_a_file_and_an_invalid_setting(places: dict[str, str]) -> None:
    """Found by verify's and the audit's runs after vLLM's log took fd 1: the document still comes
    on stdout, and the audit's names the audit."""
    data = Path(places["data"])
    (data / "hs_0.safetensors").unlink()
    import torch
    from safetensors.torch import save_file

    save_file(
        {"hidden_states": torch.zeros(2, 1, 4), "token_ids": torch.arange(2)}, str(data / "hs_0.safetensors")
    )
    audit = ["audit", places["data"], places["model"], "--ids", "1"]
    for argv, env, command, said in [
        (["verify", places["model"], "--report-dir", places["file"]], {}, "verify", "--report-dir"),
        (
            ["verify", places["model"]],
            {"VLLMHOTFIX_VERIFY_TOKENS": "0"},
            "verify",
            "VLLMHOTFIX_VERIFY_TOKENS",
        ),
        ([*audit, "--report-dir", places["file"]], {}, "audit", "--report-dir"),
    ]:
        done = run(sys.executable, [], ["-m", "vllm_hotfix", *argv, "--json"], **env)
        found = one_document(done, command, 4)
        assert found["reason"].startswith(f"usage error: {said}"), found
