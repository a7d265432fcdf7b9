"""decide(): the plan for one fix, on a module made here (no vLLM): what it concludes, what a
`patched` plan carries for patching.patch(), and that it installs and records nothing itself."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from tests.toy_fix import BUGGY, FIXED, NO_SWITCHES, TOY, ToyFix, load
from vllm_hotfix.runtime import patching, settings
from vllm_hotfix.runtime.decide import Plan, decide
from vllm_hotfix.runtime.decisions import Decision


def test_a_buggy_shape_is_a_patched_plan_and_nothing_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load(tmp_path, BUGGY, monkeypatch)
    original = module.scale
    plan = decide(TOY, module, NO_SWITCHES, None)
    assert isinstance(plan, Plan) and plan.decision is Decision.PATCHED
    assert plan.original is original and plan.fixed_source == FIXED
    assert plan.reason.startswith("multiplies by 2; vLLM version unknown")
    assert module.scale is original  # decide() only decides
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.decision = Decision.FAILED  # type: ignore[misc]


def test_a_fixed_shape_carries_nothing_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = decide(TOY, load(tmp_path, FIXED, monkeypatch), NO_SWITCHES, None)
    assert plan == Plan("toy", Decision.FIXED_UPSTREAM, "multiplies by 3; vLLM version unknown", None)


def test_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = settings.read_settings(("toy",), environ={settings.DISABLE_VAR: "toy"})
    plan = decide(TOY, load(tmp_path, BUGGY, monkeypatch), found, None)
    assert plan is not None and plan.decision is Decision.DISABLED and plan.fixed_source is None


def test_the_function_this_process_installed_needs_no_new_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load(tmp_path, BUGGY, monkeypatch)
    plan = decide(TOY, module, NO_SWITCHES, None)
    assert plan is not None and plan.original is not None and plan.fixed_source is not None
    installed = patching.patch(TOY, module, plan.original, plan.fixed_source, None).function
    assert decide(TOY, module, NO_SWITCHES, installed) is None
    other_copy = decide(TOY, module, NO_SWITCHES, None)  # ours by its marker, not by this process
    assert other_copy is not None and other_copy.decision is Decision.UNKNOWN
    assert "another copy of vllm-hotfix" in other_copy.reason


def test_a_function_from_another_file_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = load(tmp_path, BUGGY, monkeypatch)
    namespace: dict[str, object] = {}
    exec(compile(BUGGY, str(tmp_path / "other_plugin.py"), "exec"), namespace)
    module.scale = namespace["scale"]
    plan = decide(TOY, module, NO_SWITCHES, None)
    assert plan is not None and plan.decision is Decision.UNKNOWN
    assert "replaced by another plugin" in plan.reason


def test_a_transform_that_fails_its_self_check_is_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ToyFix, "transform_source", lambda self, source: source.replace("* 2", "* 4"))
    plan = decide(TOY, load(tmp_path, BUGGY, monkeypatch), NO_SWITCHES, None)
    assert plan is not None and plan.decision is Decision.FAILED and plan.fixed_source is None
    assert plan.reason.startswith("self-check of the generated source failed")


METHODS = """\
class Base:
    def scale(self, x):
        return x


class Scaler(Base):
    def scale(self, x):
        return super().scale(x) * 2


def closure_over_k():
    k = 2

    def scale(self, x):
        return x * k

    return scale
"""


class MethodFix(ToyFix):
    owner = "Scaler"

    def transform_source(self, source: str) -> str:
        return super().transform_source(textwrap.dedent(source))  # a method's source is indented


def test_a_method_calling_super_is_patched_and_its_super_still_resolves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Zero-argument super() gives a method a `__class__` cell: not a closure to refuse; the fixed
    source is built with `__class__` bound to the owner class."""
    fix = MethodFix()
    module = load(tmp_path, METHODS, monkeypatch)
    assert module.Scaler.scale.__code__.co_freevars == ("__class__",)
    plan = decide(fix, module, NO_SWITCHES, None)
    assert plan is not None and plan.decision is Decision.PATCHED, plan
    assert plan.original is not None and plan.fixed_source is not None
    patching.patch(fix, module, plan.original, plan.fixed_source, None)
    assert module.Scaler().scale(5) == 15


def test_a_method_closing_over_anything_else_is_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fix = MethodFix()
    module = load(tmp_path, METHODS, monkeypatch)
    module.Scaler.scale = module.closure_over_k()
    plan = decide(fix, module, NO_SWITCHES, None)
    assert plan is not None and plan.decision is Decision.UNKNOWN and "is a closure" in plan.reason


def test_a_related_module_is_read_from_its_file_without_importing_its_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package whose import fails while the fix is decided (vLLM's halfway through its own
    imports) still gives its submodule's text; a missing module gives None."""
    import sys

    from vllm_hotfix.runtime.decide import related_sources

    outer = tmp_path / "toypkg_related"
    (outer / "inner").mkdir(parents=True)
    (outer / "__init__.py").write_text("raise ImportError('not importable now')\n")
    (outer / "inner" / "__init__.py").write_text("raise ImportError('not importable now')\n")
    (outer / "inner" / "target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fix = ToyFix()
    monkeypatch.setattr(fix, "related", ("toypkg_related.inner.target", "toypkg_related.inner.missing"))
    texts = related_sources(fix)
    assert texts == {"toypkg_related.inner.target": "VALUE = 1\n", "toypkg_related.inner.missing": None}
    assert "toypkg_related" not in sys.modules
