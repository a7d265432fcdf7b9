"""The command line as a new user meets it: `--version`, one exit-code scheme in which a usage error
(4) is never a verdict, no traceback for a bad argument, paths checked before anything is written,
one JSON vocabulary, and a bad setting reported the same way at import and by `status`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.testenv import REPO, outside_checkout
from vllm_hotfix._version import describe
from vllm_hotfix.commands import cli
from vllm_hotfix.commands.output import SCHEMA, SCHEMAS
from vllm_hotfix.judging import verdicts


def run(*argv: str) -> int:
    """cli.main in this process, as the console script calls it: its return or exit code."""
    try:
        return cli.main(list(argv))
    except SystemExit as stop:
        return int(stop.code or 0)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--version") == verdicts.OK
    assert capsys.readouterr().out == f"vllm-hotfix {describe()}\n"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["status", "--bogus"], "unrecognized arguments: --bogus"),
        (["clean", "--days", "abc"], "argument --days: 'abc' is not a number of days >= 0"),
        (["clean", "--days", "nan"], "argument --days: 'nan' is not a number of days >= 0"),
        (["install-site-hook", "--site-dir", "/no/such/dir"], "--site-dir /no/such/dir: no such directory"),
        (["uninstall-site-hook", "--site-dir", "/no/such/dir"], "--site-dir /no/such/dir: no such directory"),
        (["nonesuch"], "invalid choice: 'nonesuch'"),
        (["releases"], "invalid choice: 'releases'"),  # maintainer tooling: python -m harness.releases
    ],
)
def test_a_usage_error_is_one_line_and_exit_4(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(*argv) == verdicts.USAGE
    out, err = capsys.readouterr()
    assert out == "" and said in err and "Traceback" not in err
    assert [line for line in err.splitlines() if "error:" in line] == [
        next(line for line in err.splitlines() if said in line)
    ]


def test_a_usage_error_under_json_is_a_document(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["audit", "data", "model", "--json", "--seed", "banana"])
    assert stop.value.code == verdicts.USAGE
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == SCHEMAS["audit"] and document["exit_code"] == verdicts.USAGE
    assert document["command"] == "audit" and "banana" in document["error"]


def test_install_site_hook_says_when_the_directory_is_not_on_sys_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("install-site-hook", "--site-dir", str(tmp_path)) == verdicts.OK
    out, err = capsys.readouterr()
    assert out.startswith("installed the vllm-hotfix site hook") and "is not on this Python's sys.path" in err
    assert run("uninstall-site-hook", "--site-dir", str(tmp_path)) == verdicts.OK
    assert list(tmp_path.iterdir()) == []


def test_a_file_it_did_not_write_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_hotfix.runtime.site_hook import PTH_NAME

    (tmp_path / PTH_NAME).write_text("someone else's\n")
    assert run("install-site-hook", "--site-dir", str(tmp_path)) == verdicts.ERROR
    err = capsys.readouterr().err
    assert "was not written by vllm-hotfix" in err and "Traceback" not in err


def test_status_json_is_a_document_and_an_invalid_setting_exits_4(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("VLLMHOTFIX_DISABLE", "VLLMHOTFIX_STRICT", "VLLMHOTFIX_FORCE"):
        monkeypatch.delenv(name, raising=False)
    code = run("status", "--json", "--no-probe")
    document = json.loads(capsys.readouterr().out)
    assert (document["schema"], document["command"], document["exit_code"]) == (SCHEMA, "status", code)
    assert code in (verdicts.OK, verdicts.INCOMPLETE) and "fixes" in document

    monkeypatch.setenv("VLLMHOTFIX_DISABLE", "typo")
    assert run("status", "--no-probe") == verdicts.USAGE
    out, err = capsys.readouterr()
    assert "settings problem: VLLMHOTFIX_DISABLE: 'typo' is not a fix id" in out
    assert "1 invalid setting(s)" in err


def _import(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLLMHOTFIX_", "PYTHON"))}
    return subprocess.run(
        [sys.executable, "-c", "import vllm_hotfix; print(vllm_hotfix.HotfixError.__name__)"],
        capture_output=True,
        text=True,
        env={**base, "PYTHONPATH": str(REPO), **env},
        cwd=outside_checkout(),
    )


def test_a_bad_setting_is_reported_at_import_the_same_way_and_never_raised_there() -> None:
    """Strict mode raises when the fixes are decided, inside vLLM's import of the model
    (tests/test_engine_behaviour.py): raised at import, vLLM's plugin loader would swallow it."""
    done = _import(VLLMHOTFIX_FORCE="typo")
    assert done.returncode == 0 and done.stdout == "HotfixError\n"
    assert done.stderr.startswith("vllm-hotfix: settings problem: VLLMHOTFIX_FORCE: 'typo' is not a fix id")

    done = _import(VLLM_HOTFIX_DISABLE="1")
    assert done.stderr == (
        "vllm-hotfix: settings problem: VLLM_HOTFIX_DISABLE is no longer read: rename it to"
        " VLLMHOTFIX_DISABLE (vLLM claims every VLLM_ name)\n"
    )

    done = _import(VLLMHOTFIX_FORCE="typo", VLLMHOTFIX_STRICT="1")
    assert done.returncode == 0 and "settings problem: VLLMHOTFIX_FORCE: 'typo'" in done.stderr

    assert _import().stderr == ""  # nothing set: nothing read, nothing said


def test_a_bad_verify_setting_is_reported_at_import_the_same_way() -> None:
    done = _import(VLLMHOTFIX_VERIFY_TOKENS="-5")
    assert done.returncode == 0 and done.stderr == (
        "vllm-hotfix: settings problem: VLLMHOTFIX_VERIFY_TOKENS='-5' is not valid:"
        " use a whole number of tokens > 0\n"
    )
    assert _import(VLLMHOTFIX_VERIFY_TOKENS="64").stderr == ""


def test_the_names_read_at_import_are_the_settings_modules() -> None:
    """__init__.py keeps copies, so that nothing is imported when none of them is set."""
    import vllm_hotfix
    from vllm_hotfix.runtime import settings

    assert vllm_hotfix._READ_AT_IMPORT == settings.READ_AT_IMPORT
    assert set(settings.READ_AT_IMPORT) == {*settings.SWITCHES, settings.TOKENS_VAR}
    assert vllm_hotfix._OLD_PREFIX == settings.OLD_PREFIX


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["verify", "/no/such/model"], "MODEL /no/such/model: no such checkpoint directory"),
        (["verify", "./relative/model"], "MODEL ./relative/model: no such checkpoint directory"),
        (["audit", "/no/data", "/no/model", "--ids", "1"], "DATA /no/data: no such directory"),
    ],
)
def test_a_missing_path_is_a_usage_error_before_vllm(argv: list[str], said: str) -> None:
    done = _command(*argv)
    assert done.returncode == verdicts.USAGE and said in done.stderr and "Traceback" not in done.stderr


def _command(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLLMHOTFIX_", "PYTHON"))}
    return subprocess.run(
        [sys.executable, "-m", "vllm_hotfix", *argv],
        capture_output=True,
        text=True,
        env={**base, "PYTHONPATH": str(REPO), **env},
        cwd=outside_checkout(),
    )


@pytest.mark.parametrize("command", ["verify", "audit"])
def test_a_bad_verify_setting_is_a_usage_error_before_vllm(command: str, tmp_path: Path) -> None:
    """VLLMHOTFIX_VERIFY_TOKENS is read by the check in the engine's workers, which would use the
    default instead: refused before vLLM is imported, as a bad flag is."""
    model = tmp_path / "model"
    model.mkdir()
    argv = ["verify", str(model)]
    if command == "audit":  # DATA is read after the settings are
        (tmp_path / "sample.safetensors").write_bytes(b"")
        argv = ["audit", str(tmp_path), str(model), "--ids", "1"]
    done = _command(*argv, VLLMHOTFIX_VERIFY_TOKENS="-5")
    assert done.returncode == verdicts.USAGE, done.stderr[-2000:]
    assert "VLLMHOTFIX_VERIFY_TOKENS='-5' is not valid" in done.stderr and "Traceback" not in done.stderr


def test_a_hugging_face_id_is_left_to_vllm() -> None:
    from vllm_hotfix.commands.session import model_path_problem

    assert model_path_problem("deepseek-ai/DeepSeek-V3") is None
    assert model_path_problem("/no/such/dir") == "MODEL /no/such/dir: no such checkpoint directory"
    assert model_path_problem("a/b/c") is not None  # more than one slash: a path


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["-V"], verdicts.OK),
        (["--json", "-V"], verdicts.OK),
        (["status", "--json", "--no-probe"], verdicts.OK),
        (["stauts", "--json"], verdicts.USAGE),
        (["verify", "M", "--json", "--ids", "x"], verdicts.USAGE),
    ],
)
def test_a_closed_pipe_ends_quietly_with_the_commands_code(argv: list[str], code: int) -> None:
    """`vllm-hotfix -V | true`: the reader is gone before the first write; no traceback, and the
    exit code stays the command's (not 1, the FAIL code)."""
    reader, writer = os.pipe()
    os.close(reader)  # the reader went away
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLMHOTFIX_", "PYTHON"))}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "vllm_hotfix", *argv],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "PYTHONPATH": str(REPO)},
            cwd=outside_checkout(),
            timeout=120,
        )
    finally:
        os.close(writer)
    assert done.returncode == code and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, (
        done.stderr
    )


def test_json_before_the_command_is_the_commands_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--json", "status", "--no-probe") == verdicts.OK
    document = json.loads(capsys.readouterr().out)
    assert (document["command"], document["exit_code"]) == ("status", verdicts.OK)


def test_a_site_dir_that_cannot_be_written_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """/proc passes os.access for root, and refuses every new file: the directory is named, not
    a temporary file of the hook's."""
    assert run("install-site-hook", "--site-dir", "/proc") == verdicts.USAGE
    err = capsys.readouterr().err
    assert "--site-dir /proc: the directory cannot be written" in err and ".tmp" not in err, err


def test_importing_main_runs_nothing() -> None:
    """`vllm_hotfix.__main__` is `python -m vllm_hotfix`; imported, it runs no command."""
    done = subprocess.run(
        [sys.executable, "-c", "import vllm_hotfix.__main__; print('imported')"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=outside_checkout(),
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout == "imported\n", done.stdout + done.stderr
