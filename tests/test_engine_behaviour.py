"""How the hotfix behaves inside a process with the real vLLM: arming, idempotency, removal,
foreign replacements, switches, strict mode and the one decision line per fix.

Each test runs one of the functions defined here (not collected: their names do not start with
`test`) in a fresh interpreter of the test environment (tests/in_subprocess.py) and checks what it
returns and what the process logged. Those functions import vllm_hotfix and vLLM themselves, in
the order the test is about; `# isort: split` keeps that order.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from harness.testenv import BUG, FIXED
from tests.in_subprocess import decision_lines, log_lines, run_failing_in_subprocess, run_in_subprocess

pytestmark = pytest.mark.vllm
DS = "deepseek-final-aux"
CPU = "cpu-sampler-fp64-gumbel"


def expected(facts: dict[str, Any], version: str = BUG, disabled: tuple[str, ...] = ()) -> dict[str, str]:
    """What status() must say of every registered fix, from the registry (each fix's declared range,
    module and `absent`) and the stored sources, given the fix modules the child imported: so a new
    fix needs no edit here, and a wrong decision still fails (tests/declared.py)."""
    from tests.declared import expected_status  # not at the top: the child imports this module

    return expected_status(version, facts["imported"], disabled)


def imported_fix_modules() -> list[str]:
    """The registered fixes' modules this process has imported (in the child)."""
    import sys

    from vllm_hotfix.fixes import ALL_FIXES

    return sorted({fix.module for fix in ALL_FIXES if fix.module in sys.modules})


def forward_of(module: Any) -> Any:
    """The DeepseekV2Model.forward installed now, read without descriptors."""
    return vars(module.DeepseekV2Model)["forward"]


def fix_status(fix_id: str = DS) -> dict[str, Any]:
    import vllm_hotfix

    return {f["fix"]: f for f in vllm_hotfix.status()["fixes"]}[fix_id]


def decisions() -> dict[str, str]:
    import vllm_hotfix

    return {f["fix"]: f["decision"] for f in vllm_hotfix.status()["fixes"]}


def import_before_vllm() -> dict[str, Any]:
    import sys

    import vllm_hotfix

    assert "vllm" not in sys.modules and "torch" not in sys.modules and "wrapt" not in sys.modules
    from vllm.model_executor.models import deepseek_v2 as m

    # isort: split
    import vllm.utils.cpu_triton_utils as c

    fwd = forward_of(m)
    vllm_hotfix.apply()
    vllm_hotfix.apply()
    patched_impl = c._sample_recovered_tokens_kernel_impl
    wrapper_patched = c.sample_recovered_tokens_kernel.func is patched_impl and hasattr(
        patched_impl, "__vllm_hotfix__"
    )
    return {
        "marker": vars(fwd.__vllm_hotfix__),
        "same_after_apply": forward_of(m) is fwd,
        "wrapped_file": fwd.__wrapped__.__code__.co_filename,
        "file": fwd.__code__.co_filename,
        "plain": type(fwd).__name__,
        "wrapper_patched": wrapper_patched,
        "status": vllm_hotfix.status(),
        "imported": imported_fix_modules(),
    }


def test_import_before_vllm_patches_on_import_with_one_line_per_fix(testenv) -> None:
    facts = run_in_subprocess(testenv, import_before_vllm)
    assert facts["plain"] == "function" and facts["same_after_apply"]
    assert facts["marker"]["fix_id"] == DS and facts["marker"]["version"]
    assert facts["wrapped_file"].endswith("deepseek_v2.py")
    assert facts["file"].endswith(f"{facts['marker']['digest']}.py")
    ((level, line),) = decision_lines(facts, DS)
    assert level == "INFO"
    for part in ("pid=", "vllm=0.24.0", f"fix={DS}", "decision='patched'", "reason="):
        assert part in line
    assert len(decision_lines(facts, CPU)) == 1 and facts["wrapper_patched"]
    decided = {f["fix"]: f["decision"] for f in facts["status"]["fixes"]}
    assert decided == expected(facts)
    assert decided[DS] == decided[CPU] == "patched"


def remove_and_apply_again() -> dict[str, Any]:
    import random
    import threading

    from vllm.model_executor.models import deepseek_v2 as m

    # isort: split
    import vllm.utils.cpu_triton_utils as c

    original = forward_of(m)
    original_impl = c._sample_recovered_tokens_kernel_impl
    import vllm_hotfix  # modules already imported: patches at once

    patched = forward_of(m)
    vllm_hotfix.remove()
    restored = forward_of(m) is original
    vllm_hotfix.apply()
    again = forward_of(m)
    churn_errors = []

    def churn(seed: int) -> None:
        try:
            rng = random.Random(seed)
            for _ in range(30):
                (vllm_hotfix.apply if rng.random() < 0.5 else vllm_hotfix.remove)()
        except BaseException as error:  # a thread's exception would otherwise only be printed
            churn_errors.append(repr(error))

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    vllm_hotfix.apply()
    final = forward_of(m)
    vllm_hotfix.remove()
    return {
        "patched": patched is not original and patched.__wrapped__ is original,
        "restored": restored,
        "again": again is not original and hasattr(again, "__vllm_hotfix__"),
        "final_ok": hasattr(final, "__vllm_hotfix__") and final.__wrapped__ is original,
        "final_restored": forward_of(m) is original,
        # the sampler fix's put() repointed the wrapper's .func to the fix, and back on remove()
        "wrapper_restored": c._sample_recovered_tokens_kernel_impl is original_impl
        and c.sample_recovered_tokens_kernel.func is original_impl,
        "churn_errors": churn_errors,
    }


def test_remove_restores_the_exact_original_and_apply_repatches(testenv) -> None:
    facts = run_in_subprocess(testenv, remove_and_apply_again)
    errors = facts.pop("churn_errors")
    assert errors == [], f"apply()/remove() raised in a churn thread: {errors}"
    checks = {key: value for key, value in facts.items() if key != "_log"}
    assert len(checks) == 6 and all(value is True for value in checks.values()), checks


def forward_replaced_by_another_plugin() -> dict[str, Any]:
    from vllm.model_executor.models import deepseek_v2 as m

    original = forward_of(m)

    def other_plugin_forward(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    m.DeepseekV2Model.forward = other_plugin_forward
    import vllm_hotfix  # noqa: F401  (arms and decides at once)

    status = fix_status()
    return {
        "untouched": forward_of(m) is other_plugin_forward,
        "decision": status["decision"],
        "reason": status["reason"],
    }


def test_forward_replaced_by_another_plugin_is_left_alone(testenv) -> None:
    facts = run_in_subprocess(testenv, forward_replaced_by_another_plugin)
    assert facts["untouched"] and facts["decision"] == "unknown"
    assert "replaced by another plugin" in facts["reason"]
    ((level, message),) = decision_lines(facts, DS)
    assert level == "WARNING"
    assert "NOT applied" in message and "vllm-hotfix status --json" in message


def forward_wrapped_in_a_proxy() -> dict[str, Any]:
    import wrapt
    from vllm.model_executor.models import deepseek_v2 as m

    wrapt.wrap_function_wrapper(m, "DeepseekV2Model.forward", lambda w, i, a, k: w(*a, **k))
    proxy = forward_of(m)
    import vllm_hotfix  # noqa: F401  (arms and decides at once)

    return {"untouched": forward_of(m) is proxy, "reason": fix_status()["reason"]}


def test_wrapt_proxy_installed_by_someone_else_is_left_alone(testenv) -> None:
    facts = run_in_subprocess(testenv, forward_wrapped_in_a_proxy)
    assert facts["untouched"] and "FunctionWrapper" in facts["reason"]


def replaced_after_patching_then_removed() -> dict[str, Any]:
    import vllm_hotfix

    # isort: split
    from vllm.model_executor.models import deepseek_v2 as m

    def later(self, *a, **k):
        return None

    m.DeepseekV2Model.forward = later
    vllm_hotfix.remove()
    return {"kept": forward_of(m) is later, "notes": fix_status()["notes"]}


def test_remove_does_not_undo_a_later_replacement(testenv) -> None:
    facts = run_in_subprocess(testenv, replaced_after_patching_then_removed)
    assert facts["kept"] and "left untouched" in facts["notes"][-1]


def replaced_before_import_in_strict_mode() -> None:
    from vllm.model_executor.models import deepseek_v2 as m

    m.DeepseekV2Model.forward = lambda self, *a, **k: None
    import vllm_hotfix  # noqa: F401  (raises HotfixError in strict mode)


def test_strict_mode_raises_where_it_would_leave_the_bug(testenv) -> None:
    stderr = run_failing_in_subprocess(testenv, replaced_before_import_in_strict_mode, VLLMHOTFIX_STRICT="1")
    assert "HotfixError" in stderr and "deepseek-final-aux not applied" in stderr


def decisions_after_importing_both_targets() -> dict[str, Any]:
    import vllm_hotfix  # noqa: F401

    # isort: split
    from vllm.model_executor.models import deepseek_v2 as m

    # isort: split
    import vllm.utils.cpu_triton_utils  # noqa: F401

    return {
        "status": decisions(),
        "patched": hasattr(forward_of(m), "__vllm_hotfix__"),
        "imported": imported_fix_modules(),
    }


def test_disable_switches(testenv) -> None:
    from vllm_hotfix.fixes import FIX_IDS

    all_off = run_in_subprocess(testenv, decisions_after_importing_both_targets, VLLMHOTFIX_DISABLE="1")
    assert all_off["status"] == expected(all_off, disabled=FIX_IDS) and not all_off["patched"]
    assert all_off["status"][DS] == all_off["status"][CPU] == "disabled"
    one_off = run_in_subprocess(testenv, decisions_after_importing_both_targets, VLLMHOTFIX_DISABLE=CPU)
    assert one_off["status"] == expected(one_off, disabled=(CPU,)) and one_off["patched"]
    assert (one_off["status"][DS], one_off["status"][CPU]) == ("patched", "disabled")
    invalid = run_in_subprocess(
        testenv,
        decisions_after_importing_both_targets,
        VLLMHOTFIX_DISABLE="deepseek-final-axu",
        VLLMHOTFIX_STRICT="perhaps",
    )
    assert invalid["status"] == expected(invalid)  # the safe default: fixes stay on
    assert invalid["status"][DS] == invalid["status"][CPU] == "patched"
    errors = [line for level, line in log_lines(invalid) if level == "ERROR"]
    assert any("VLLMHOTFIX_DISABLE" in e and "'deepseek-final-axu'" in e for e in errors)
    assert any("VLLMHOTFIX_STRICT" in e and "'perhaps'" in e for e in errors)


def armed_after_a_model_exists() -> dict[str, Any]:
    from vllm.model_executor.models import deepseek_v2 as m

    built = object.__new__(m.DeepseekV2Model)  # stands for a model built before arming
    import vllm_hotfix  # noqa: F401  (arms and decides at once)

    notes = fix_status()["notes"]
    del built
    return {"notes": notes}


def test_arming_after_a_model_exists_says_so(testenv) -> None:
    facts = run_in_subprocess(testenv, armed_after_a_model_exists)
    assert any("existed before the fix was armed" in n for n in facts["notes"])
    assert any(level == "WARNING" for level, _ in log_lines(facts, "existed before the fix was armed"))


def on_a_fixed_release() -> dict[str, Any]:
    from vllm.model_executor.models import deepseek_v2 as m

    # isort: split
    import vllm.utils.cpu_triton_utils as c

    before = forward_of(m), c._sample_recovered_tokens_kernel_impl
    import vllm_hotfix  # noqa: F401  (arms and decides at once)

    after = forward_of(m), c._sample_recovered_tokens_kernel_impl
    return {
        "identical": all(a is b for a, b in zip(before, after, strict=True)),
        "status": decisions(),
        "imported": imported_fix_modules(),
    }


def test_fixed_upstream_release_is_untouched(testenv) -> None:
    facts = run_in_subprocess(testenv, on_a_fixed_release, version=FIXED)
    assert facts["identical"]
    assert facts["status"] == expected(facts, version=FIXED)
    assert facts["status"][DS] == facts["status"][CPU] == "fixed upstream"
    ((_, line),) = decision_lines(facts, DS)
    assert "vllm=0.25.0" in line and "decision='fixed upstream'" in line


@pytest.mark.parametrize(("version", "decision"), [("0.24.0", "patched"), (FIXED, "fixed upstream")])
def test_status_command_probes_the_installed_vllm(testenv, version: str, decision: str) -> None:
    import json

    done = testenv.run(["-m", "vllm_hotfix", "status", "--json"], version=version, hotfix=True)
    assert done.returncode == 0, done.stderr[-2000:]
    status = json.loads(done.stdout)
    assert status["vllm_loaded"] == version and status["armed"]
    assert {f["fix"]: f["decision"] for f in status["fixes"]}[DS] == decision
    text = testenv.run(["-m", "vllm_hotfix", "status"], version=version, hotfix=True).stdout
    assert f"fix {DS}: {decision}" in text and f"vLLM: {version}" in text


def status_command_after_a_replacement() -> dict[str, Any]:
    import contextlib
    import io

    import vllm.model_executor.models.deepseek_v2 as m

    m.DeepseekV2Model.forward = lambda s: 0
    from vllm_hotfix.commands.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exit_code = main(["status"])
    return {"exit_code": exit_code, "stdout": out.getvalue()}


def test_status_command_exits_2_when_a_fix_is_left_out(testenv) -> None:
    facts = run_in_subprocess(testenv, status_command_after_a_replacement)
    assert facts["exit_code"] == 2 and f"fix {DS}: unknown" in facts["stdout"]


def load_altered_deepseek() -> dict[str, Any]:
    """A build of vLLM whose forward differs from every release: same bug, loop written differently."""
    import importlib.util
    import pathlib
    import sys
    import tempfile

    import vllm.model_executor.models as models

    real = pathlib.Path(models.__file__).with_name("deepseek_v2.py").read_text()
    altered = real.replace(
        "if idx in self.aux_hidden_state_layers:", "if self.aux_hidden_state_layers.__contains__(idx):"
    )
    assert altered != real
    path = pathlib.Path(tempfile.mkdtemp()) / "deepseek_v2.py"
    path.write_text(altered)
    name = "vllm.model_executor.models.deepseek_v2"
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    original = forward_of(m)
    import vllm_hotfix  # noqa: F401  (arms and decides at once)

    status = fix_status()
    return {
        "decision": status["decision"],
        "reason": status["reason"],
        "patched": forward_of(m) is not original,
    }


def test_unknown_shape_is_left_alone_with_advice(testenv) -> None:
    facts = run_in_subprocess(testenv, load_altered_deepseek)
    assert facts["decision"] == "unknown" and not facts["patched"]
    assert "missing: a layer loop" in facts["reason"]
    ((level, line),) = decision_lines(facts, DS)
    assert level == "WARNING" and f"VLLMHOTFIX_FORCE={DS}" in line


def test_force_patches_an_unknown_shape_that_takes_the_change(testenv) -> None:
    facts = run_in_subprocess(testenv, load_altered_deepseek, VLLMHOTFIX_FORCE=DS)
    assert facts["decision"] == "patched" and facts["patched"]
    assert facts["reason"].startswith("forced by VLLMHOTFIX_FORCE")


def transform_that_raises() -> dict[str, Any]:
    from vllm_hotfix.fixes.deepseek_final_aux import DeepseekFinalAux

    def transform_source(self, source):
        raise RuntimeError("transform broke")

    DeepseekFinalAux.transform_source = transform_source
    import vllm_hotfix  # noqa: F401

    # isort: split
    from vllm.model_executor.models import deepseek_v2 as m

    # isort: split
    from vllm_hotfix.commands.cli import main

    status = fix_status()
    return {
        "decision": status["decision"],
        "reason": status["reason"],
        "exit_code": main(["status", "--no-probe"]),
        "patched": hasattr(forward_of(m), "__vllm_hotfix__"),
    }


def test_an_error_while_patching_is_failed_and_left_alone(testenv) -> None:
    facts = run_in_subprocess(testenv, transform_that_raises)
    assert facts["decision"] == "failed" and not facts["patched"]
    assert facts["reason"] == "RuntimeError: transform broke"
    assert facts["exit_code"] == 2
    ((level, line),) = decision_lines(facts, DS)
    assert level == "WARNING" and "decision='failed'" in line and "NOT applied" in line


def import_both() -> None:
    import vllm_hotfix  # noqa: F401

    # isort: split
    from vllm.model_executor.models import deepseek_v2  # noqa: F401


def test_strict_mode_raises_on_an_invalid_switch(testenv) -> None:
    stderr = run_failing_in_subprocess(
        testenv, import_both, VLLMHOTFIX_STRICT="1", VLLMHOTFIX_DISABLE="deepseek-final-axu"
    )
    assert "HotfixError" in stderr and "VLLMHOTFIX_DISABLE: 'deepseek-final-axu' is not a fix id" in stderr


def replace_forward(replacement: str) -> dict[str, Any]:
    """Another plugin's function in DeepseekV2Model.forward, then the hotfix armed."""
    from vllm.model_executor.models import deepseek_v2 as m

    if replacement == "another plugin's function":
        # another plugin's module holding a copy of the forward: the very shape the fix knows
        import importlib.util
        import inspect
        import pathlib
        import tempfile
        import textwrap

        path = pathlib.Path(tempfile.mkdtemp()) / "other_plugin.py"
        source = textwrap.dedent(inspect.getsource(forward_of(m)))
        path.write_text("from __future__ import annotations\n" + source)
        spec = importlib.util.spec_from_file_location("other_plugin", path)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        m.DeepseekV2Model.forward = other.forward
    elif replacement == "a proxy":
        import wrapt

        wrapt.wrap_function_wrapper(m, "DeepseekV2Model.forward", lambda w, i, a, k: w(*a, **k))
    else:
        raise ValueError(replacement)
    replaced = forward_of(m)
    import vllm_hotfix  # noqa: F401  (arms and decides at once)

    status = fix_status()
    return {
        "untouched": forward_of(m) is replaced,
        "decision": status["decision"],
        "reason": status["reason"],
    }


@pytest.mark.parametrize("replacement", ["a proxy", "another plugin's function"])
def test_force_never_patches_another_plugins_function(testenv, replacement: str) -> None:
    facts = run_in_subprocess(testenv, replace_forward, replacement, VLLMHOTFIX_FORCE=DS)
    assert facts["untouched"] and facts["decision"] == "unknown", facts["reason"]
    assert "forced" not in facts["reason"]
    expected = "replaced by another plugin?" if replacement.startswith("another") else "FunctionWrapper"
    assert expected in facts["reason"]


def generated_file() -> dict[str, Any]:
    import vllm_hotfix  # noqa: F401

    # isort: split
    from vllm.model_executor.models import deepseek_v2 as m

    status = fix_status()
    return {
        "decision": status["decision"],
        "file": status["generated_file"],
        "notes": status["notes"],
        "code_file": forward_of(m).__code__.co_filename,
    }


def test_cache_dir_switch_is_honoured(testenv, tmp_path: Path) -> None:
    cache = tmp_path / "my-cache"
    facts = run_in_subprocess(testenv, generated_file, VLLMHOTFIX_CACHE_DIR=str(cache))
    assert facts["decision"] == "patched" and facts["notes"] == []
    generated = Path(facts["file"])
    assert generated.parent == cache / "generated" and facts["code_file"] == str(generated)
    assert generated.is_file() and "vllm-hotfix" in generated.read_text()


def test_no_usable_directory_still_patches_and_warns(testenv, tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    temp = tmp_path / "tmp"
    temp.mkdir()
    (temp / f"vllm-hotfix-{os.getuid()}").write_text("")  # the temporary place cannot be made
    facts = run_in_subprocess(
        testenv, generated_file, VLLMHOTFIX_CACHE_DIR=str(blocked / "cache"), TMPDIR=str(temp)
    )
    assert facts["decision"] == "patched"
    assert facts["file"].startswith("<") and facts["code_file"] == facts["file"]
    # one warning per fix that generated a function (shared-capture-id0 does in this process too)
    lines = log_lines(facts, "no usable directory")
    warnings = [line for level, line in lines if level == "WARNING" and f"fix={DS}:" in line]
    assert len(warnings) == 1 and "VLLM_DISABLE_COMPILE_CACHE=1" in warnings[0]
    assert str(blocked / "cache" / "generated") in warnings[0] and str(temp) in warnings[0]
