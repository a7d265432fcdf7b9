"""runtime/containment.py, the error policy: strict mode or not, one line on stderr, never a raise of its own;
and it is a leaf, so deciding whether an error may reach the host cannot fail with the package."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import vllm_hotfix
from harness.testenv import REPO
from vllm_hotfix.runtime import containment, settings

PACKAGE = REPO / "vllm_hotfix"


def _imported(path: Path) -> set[str]:
    """Every module the file imports, at any depth (a `from a import b` gives `a` and `a.b`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names |= {base, *(f"{base}.{alias.name}" for alias in node.names)} if node.level == 0 else {"."}
    return names


def test_the_leaf_imports_nothing_from_the_package() -> None:
    imported = _imported(PACKAGE / "runtime/containment.py")
    assert not [name for name in imported if name == "." or name.split(".")[0] == "vllm_hotfix"], imported
    assert {name.split(".")[0] for name in imported} <= {"__future__", "os", "sys", "collections"}, imported


def test_the_front_applies_the_leafs_policy_inline() -> None:
    """The package's `__init__.py` arms before the leaf may be imported (the leaf may be what is
    broken, and importing it at start-up would cost every Python process a module file), so it reads
    the same switch with the same words; the rest of the package uses the leaf."""
    assert vllm_hotfix._STRICT_VAR == containment.STRICT_VAR
    assert vllm_hotfix._STRICT_WORDS == containment.STRICT_WORDS
    assert "vllm_hotfix.runtime.containment" not in _imported(PACKAGE / "__init__.py")
    assert "vllm_hotfix.runtime.containment" in _imported(PACKAGE / "runtime/arming.py")


@pytest.mark.parametrize("broken", ["arm raises", "arming unimportable"])
def test_an_arming_error_is_one_line_unless_strict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], broken: str
) -> None:
    """What the trigger does at `import vllm` when arming fails, also when the package cannot be imported."""
    if broken == "arm raises":
        from vllm_hotfix.runtime import arming

        monkeypatch.setattr(arming, "arm", lambda: _raise(RuntimeError("two\nlines")))
        expected = "vllm-hotfix: not armed: RuntimeError: two lines\n"
    else:
        monkeypatch.delattr(sys.modules["vllm_hotfix.runtime"], "arming", raising=False)
        monkeypatch.setitem(
            sys.modules, "vllm_hotfix.runtime.arming", None
        )  # importing it raises ImportError
        expected = (
            "vllm-hotfix: not armed: ModuleNotFoundError:"
            " import of vllm_hotfix.runtime.arming halted; None in sys.modules\n"
        )
    monkeypatch.setenv(containment.STRICT_VAR, "0")
    vllm_hotfix._arm_engine()
    assert capsys.readouterr().err == expected
    monkeypatch.setenv(containment.STRICT_VAR, " On ")
    with pytest.raises(RuntimeError if broken == "arm raises" else ImportError):
        vllm_hotfix._arm_engine()
    assert capsys.readouterr().err == ""


def test_the_strict_check_agrees_with_settings() -> None:
    assert set(containment.STRICT_WORDS) == settings.TRUE_WORDS
    assert containment.STRICT_VAR == settings.STRICT_VAR


@pytest.mark.parametrize(("value", "strict"), [("1", True), (" On ", True), ("0", False), ("perhaps", False)])
def test_strict_requested(monkeypatch: pytest.MonkeyPatch, value: str, strict: bool) -> None:
    monkeypatch.setenv(containment.STRICT_VAR, value)
    assert containment.strict_requested() is strict


def test_strict_requested_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(containment.STRICT_VAR, raising=False)
    assert containment.strict_requested() is False


def test_report_error_writes_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    containment.report_error("not armed", RuntimeError("two\nlines"))
    assert capsys.readouterr().err == "vllm-hotfix: not armed: RuntimeError: two lines\n"


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("no text")


class _BrokenStream:
    def write(self, text: str) -> int:
        raise OSError("stderr closed")


def test_report_error_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    containment.report_error("x", _Unprintable())
    monkeypatch.setattr("sys.stderr", _BrokenStream())
    containment.report_error("x", RuntimeError("y"))


def _raise(error: Exception) -> None:
    raise error


def test_contain_reports_and_returns_the_error_outside_strict_mode(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(containment.STRICT_VAR, "0")
    error = RuntimeError("broken")
    assert containment.contain("fix x not decided", lambda: _raise(error)) is error
    assert capsys.readouterr().err == "vllm-hotfix: fix x not decided: RuntimeError: broken\n"
    assert containment.contain("fine", lambda: None) is None
    assert capsys.readouterr().err == ""


def test_contain_raises_in_strict_mode(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(containment.STRICT_VAR, "1")
    with pytest.raises(RuntimeError, match="broken"):
        containment.contain("what", lambda: _raise(RuntimeError("broken")))
    assert capsys.readouterr().err == ""


def test_contain_lets_the_passthrough_errors_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(containment.STRICT_VAR, "0")
    with pytest.raises(KeyError):
        containment.contain("what", lambda: _raise(KeyError("meant for the host")), (KeyError,))
