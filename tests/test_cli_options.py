"""A command's own options, told apart from vLLM's engine flags before vLLM is imported: a near miss
of one of ours (`--prompt-length 16`) is a usage error that says "did you mean", `--model` says MODEL
is positional, and every engine flag of the test environment's vLLM releases still goes to vLLM,
with or without `--`. Without vLLM, `verify` is one line and exit 3."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness.testenv import NEWEST, OLDEST, REPO, TestEnv, outside_checkout
from tests.engine_flags import refused_engine_flags
from tests.in_subprocess import run_in_subprocess


def parse(*argv: str) -> int:
    """The exit code of reading the command line (0: read, the command would run)."""
    from vllm_hotfix.commands import cli

    try:
        cli.parse(list(argv))
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["verify", "M", "--prompt-length", "16"], "--prompt-lengths"),
        (["verify", "M", "--prompt-length=16"], "--prompt-lengths"),
        (["verify", "M", "--prompt_lengths", "16"], "--prompt-lengths"),
        (["verify", "M", "--batch-size", "2"], "--batch-sizes"),
        (["verify", "M", "--tiemout", "5"], "--timeout"),
        (["verify", "M", "--report_dir", "r"], "--report-dir"),
        (["verify", "M", "--jsno"], "--json"),
        (["verify", "M", "--js"], "--json"),  # as close to --ids, but --json is what it begins
        (["verify", "--prompt-length", "16", "M"], "--prompt-lengths"),
        (["audit", "D", "M", "--ids", "1", "--sampel", "3"], "--sample"),
        (["audit", "D", "M", "--sampel", "3"], "--sample"),  # before argparse's "--ids is required"
        (["status", "--jsn"], "--json"),
        (["clean", "--dry-runn"], "--dry-run"),
    ],
)
def test_a_near_miss_of_our_option_is_a_usage_error_before_vllm(
    argv: list[str], meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse(*argv) == 4
    out, err = capsys.readouterr()
    typed = next(a for a in argv if a.startswith("--") and a not in ("--ids",)).split("=")[0]
    assert out == "" and error_lines(err) == [
        f"vllm-hotfix {argv[0]}: error: unrecognized argument {typed}: did you mean {meant}?"
    ]


def test_under_json_the_usage_error_is_a_json_document(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse("verify", "M", "--json", "--prompt-length", "16") == 4
    found = json.loads(capsys.readouterr().out)
    assert (found["command"], found["exit_code"], found["verdict"]) == ("verify", 4, "UNKNOWN")
    assert found["error"] == "unrecognized argument --prompt-length: did you mean --prompt-lengths?"


@pytest.mark.parametrize(
    ("argv", "form"),
    [
        (["verify", "--model", "X"], "vllm-hotfix verify MODEL [options]"),
        (["verify", "--model=X"], "vllm-hotfix verify MODEL [options]"),
        (["verify", "--json", "--model", "X", "--ids", "1"], "vllm-hotfix verify MODEL [options]"),
        (["audit", "D", "--model", "M", "--ids", "1"], "vllm-hotfix audit DATA MODEL [options]"),
    ],
)
def test_model_as_an_option_says_model_is_positional(
    argv: list[str], form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse(*argv) == 4
    said = capsys.readouterr().err
    assert f"--model: MODEL is positional, not an option: {form}" in error_lines(said)[0]


def test_model_among_the_engine_arguments_is_a_usage_error_before_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_hotfix.commands import cli, session

    monkeypatch.setattr(session, "parse_engine_args", lambda *a: pytest.fail("vLLM reached"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["verify", "M", "--report-dir", str(tmp_path), "--", "--model", "X"])
    assert stop.value.code == 4
    assert "--model in the engine arguments: give the model as MODEL (positional)" in capsys.readouterr().err


def test_engine_flags_go_to_vllm_with_or_without_the_separator() -> None:
    from vllm_hotfix.commands import cli

    flags = ["-tp", "2", "--ubatch-size", "2", "--load-format", "dummy", "--seed", "1", "-O3"]
    assert cli.parse(["verify", "M", *flags]).engine_args == flags
    after = ["--prompt-length", "16", "--ids", "1"]  # after `--` nothing is ours
    assert cli.parse(["verify", "M", "--", *after]).engine_args == after
    assert cli.parse(["status", "--js"]).json  # an abbreviation argparse takes is not a near miss


@pytest.mark.vllm
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_no_engine_flag_of_vllm_is_taken_for_a_near_miss(testenv: TestEnv, version: str) -> None:
    facts = run_in_subprocess(testenv, refused_engine_flags, version=version)
    assert facts["flags"] > 100 and facts["refused"] == {"verify": [], "audit": []}, facts["refused"]


def verify_in(
    bare: tuple[str, str], *argv: str, command: str = "verify", **env: str
) -> subprocess.CompletedProcess[str]:
    python, only_wrapt = bare
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLLMHOTFIX_", "PYTHON"))}
    return subprocess.run(
        [python, "-m", "vllm_hotfix", command, *argv],
        capture_output=True,
        text=True,
        env={**base, "PYTHONPATH": os.pathsep.join([str(REPO), only_wrapt]), **env},
        cwd=outside_checkout(),
        timeout=120,
    )


def test_verify_without_vllm_is_one_line_and_exit_3(bare_python: tuple[str, str], tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    done = verify_in(bare_python, str(model))
    assert done.returncode == 3 and done.stdout == "", done.stdout + done.stderr  # a message: stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"vllm-hotfix verify: no vLLM importable by {bare_python[0]}:")
    assert "run `python -m vllm_hotfix verify` there" in line

    done = verify_in(bare_python, str(model), "--json")
    found = json.loads(done.stdout)
    assert done.returncode == found["exit_code"] == 3 and found["reason"] == line
    assert (found["verdict"], found["ranks"], found["report_dir"]) == ("UNKNOWN", [], None)
    # a usage error is still one, and comes first
    assert verify_in(bare_python, str(model), "--prompt-length", "16").returncode == 4
    assert verify_in(bare_python, str(tmp_path / "nonesuch")).returncode == 4
    assert verify_in(bare_python, str(model), VLLMHOTFIX_VERIFY_TOKENS="x").returncode == 4


def test_audit_without_vllm_is_one_line_and_exit_3(bare_python: tuple[str, str], tmp_path: Path) -> None:
    """No line per file: the files are not read (their reader comes with vLLM)."""
    data, model = tmp_path / "data", tmp_path / "model"
    data.mkdir()
    model.mkdir()
    for n in range(3):
        (data / f"hs_{n}.safetensors").write_bytes(b"not read")
    done = verify_in(bare_python, str(data), str(model), "--ids", "1,2", command="audit")
    assert done.returncode == 3 and done.stdout == "", done.stdout + done.stderr  # a message: stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"vllm-hotfix audit: no vLLM importable by {bare_python[0]}:")
    done = verify_in(bare_python, str(data), str(model), "--ids", "1,2", "--json", command="audit")
    found = json.loads(done.stdout)
    assert done.returncode == found["exit_code"] == 3 and found["reason"] == line and found["files"] == []
    # usage first, as verify: each mistake exits 4 before the missing vLLM is looked for
    for argv, env in (
        (["--ids", "1,2", "--rank", "1"], {}),
        (["--ids", "1,2", "--", "--model", "M"], {}),
        (["--ids", "1,2"], {"VLLMHOTFIX_VERIFY_TOKENS": "x"}),
    ):
        done = verify_in(bare_python, str(data), str(model), *argv, command="audit", **env)
        assert done.returncode == 4 and "no vLLM" not in done.stderr, (argv, done.stderr)
    done = verify_in(bare_python, str(data / "hs_0.safetensors"), str(model), "--ids", "1", command="audit")
    assert done.returncode == 4 and "a file, not a directory" in done.stderr, done.stderr


def test_status_without_vllm_says_an_invalid_setting_first(bare_python: tuple[str, str]) -> None:
    """A bad VLLMHOTFIX_DISABLE is a usage error (exit 4), as docs/usage.md says, vLLM or not."""
    done = verify_in(bare_python, command="status", VLLMHOTFIX_DISABLE="bogus")
    assert done.returncode == 4 and "'bogus' is not a fix id" in done.stdout + done.stderr, done.stderr
    done = verify_in(bare_python, command="status")
    assert done.returncode == 2 and done.stdout == "" and "no vLLM importable" in done.stderr
