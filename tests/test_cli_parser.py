"""The top-level command line as a newcomer types it: `-V`, "did you mean" for a mistyped command,
a help that lists only the current commands and names no source file; the old site-hook command
names still run, unlisted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_hotfix._version import describe
from vllm_hotfix.commands import cli
from vllm_hotfix.judging import verdicts


def run(*argv: str) -> int:
    try:
        return cli.main(list(argv))
    except SystemExit as stop:
        return int(stop.code or 0)


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_the_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(flag) == verdicts.OK
    assert capsys.readouterr().out == f"vllm-hotfix {describe()}\n"


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("stauts", "status"),
        ("verfy", "verify"),
        ("audti", "audit"),
        ("clena", "clean"),
        ("install-site-hooks", "install-site-hook"),
        ("install-sitecustomise", "install-site-hook"),
    ],
)
def test_a_mistyped_command_says_did_you_mean(
    typed: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(typed, "x") == verdicts.USAGE
    out, err = capsys.readouterr()
    assert out == "" and [line for line in err.splitlines() if "error:" in line] == [
        f"vllm-hotfix: error: argument COMMAND: invalid choice: '{typed}': did you mean '{meant}'?"
    ]


def test_another_word_lists_the_current_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("nonesuch") == verdicts.USAGE
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == (
        "vllm-hotfix: error: argument COMMAND: invalid choice: 'nonesuch' (choose from status, clean,"
        " verify, audit, audit-merge, install-site-hook, uninstall-site-hook)"
    )


def test_the_help_lists_the_current_commands_and_no_source_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--help") == verdicts.OK
    text = capsys.readouterr().out
    assert "sitecustomize" not in text
    assert not re.search(r"\w\.py\b", text), text
    for command in ("status", "clean", "verify", "audit", "install-site-hook", "uninstall-site-hook"):
        assert re.search(rf"^    {command}\b", text, re.M), command
    assert "-V, --version" in text


def test_the_old_names_still_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("install-sitecustomize", "--site-dir", "/no/such/dir") == verdicts.USAGE
    assert "--site-dir /no/such/dir" in capsys.readouterr().err
    assert run("uninstall-sitecustomize", "--help") == verdicts.OK
    assert "site hook" in capsys.readouterr().out


def test_a_file_given_as_the_site_directory_is_called_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "site-packages"
    a_file.write_text("")
    assert run("install-site-hook", "--site-dir", str(a_file)) == verdicts.USAGE
    assert f"--site-dir {a_file}: a file, not a directory" in capsys.readouterr().err


def test_clean_refuses_an_age_with_all(capsys: pytest.CaptureFixture[str]) -> None:
    """--all removes whatever the age: an age given too would be ignored silently."""
    assert run("clean", "--days", "5", "--all") == verdicts.USAGE
    assert "argument --all: not allowed with argument --days" in capsys.readouterr().err
