"""The engine's one record per fix, on the toy fix (no vLLM): built once, after patching, from
decide()'s plan and what patching.patch() installed; an error is a `failed` record, and an error
outside deciding is contained (one line on stderr) unless strict mode raises it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.toy_fix import BUGGY, FIXED, TOY, load
from vllm_hotfix.runtime import arming, patching
from vllm_hotfix.runtime.decisions import Decision


@pytest.fixture(autouse=True)
def armed(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's own records, armed, with no switch set."""
    monkeypatch.setattr(arming, "_records", {})
    monkeypatch.setattr(arming, "_armed", True)
    for name in ("VLLMHOTFIX_DISABLE", "VLLMHOTFIX_FORCE", "VLLMHOTFIX_STRICT"):
        monkeypatch.delenv(name, raising=False)


def test_a_patched_record_holds_what_was_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = load(tmp_path, BUGGY, monkeypatch)
    original = module.scale
    arming._on_import(TOY, module)
    record = arming.records()[TOY.fix_id]
    assert record.decision is Decision.PATCHED and record.reason.startswith("multiplies by 2")
    assert record.original is original and record.installed is module.scale and module.scale(1) == 3
    assert record.generated_file == module.scale.__code__.co_filename
    assert Path(record.generated_file).parent == tmp_path / "cache" / "generated"
    assert record.notes == () and not hasattr(record, "fixed_source")
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.notes = ("later",)  # type: ignore[misc]

    arming._on_import(TOY, module)  # still the function installed: the record stands
    assert arming.records()[TOY.fix_id] is record


def test_a_record_that_installs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arming._on_import(TOY, load(tmp_path, FIXED, monkeypatch))
    record = arming.records()[TOY.fix_id]
    assert record.decision is Decision.FIXED_UPSTREAM
    assert (record.original, record.installed, record.generated_file, record.notes) == (None, None, None, ())


def _broken(*args: object, **kwargs: object) -> None:
    raise RuntimeError("broken on purpose")


def test_an_error_while_patching_is_a_failed_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = load(tmp_path, BUGGY, monkeypatch)
    original = module.scale
    monkeypatch.setattr(patching, "patch", _broken)
    arming._on_import(TOY, module)
    record = arming.records()[TOY.fix_id]
    assert record.decision is Decision.FAILED and record.reason == "RuntimeError: broken on purpose"
    assert record.installed is None and module.scale is original


def test_an_error_outside_deciding_is_contained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = load(tmp_path, BUGGY, monkeypatch)
    monkeypatch.setattr(arming, "_settings", _broken)
    arming._on_import(TOY, module)
    assert capsys.readouterr().err == "vllm-hotfix: fix toy not decided: RuntimeError: broken on purpose\n"
    assert arming.records()[TOY.fix_id].decision is Decision.FAILED

    monkeypatch.setenv("VLLMHOTFIX_STRICT", "1")
    with pytest.raises(RuntimeError, match="broken on purpose"):
        arming._on_import(TOY, module)
