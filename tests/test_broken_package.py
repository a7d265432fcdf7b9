"""A broken install of the hotfix never breaks vLLM outside strict mode, whatever module is broken
and whichever way it came in.

The package is copied with one module broken (a syntax error, an ImportError, an exception at
import), for every module that the way in loads (read at collection, so a new module is covered
and a case never breaks a module the path does not load), and a child process imports vLLM
through each way in: vLLM's plugin loader calling the
`vllm.general_plugins` entry point `vllm_hotfix.plugin:register`, the site hook's `.pth` line, and
`import vllm_hotfix` in the script; then it imports the model module, where the fix is decided.
The stand-in vLLM (harness/stand_in_vllm.py) keeps the ~400 runs fast; one case runs on the real
vLLM of the test environment.

Outside strict mode nothing may raise (a one-line message on stderr is fine), and a fix that is not
applied is never silent. The one exception is `import vllm_hotfix` of a package whose own
`__init__.py` cannot be imported: that import is the error. In strict mode it may raise; through
`import vllm_hotfix` it must, unless the fix is applied. vLLM's plugin loader and Python's `.pth`
processing catch errors raised while the package is imported, so there a strict run is only sure
to report the breakage.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from harness import stand_in_vllm
from harness.testenv import TestEnv
from vllm_hotfix.runtime import site_hook

BREAKAGES = {
    "syntax-error": "\ndef broken(:\n",
    "import-error": "\nimport vllm_hotfix_no_such_module\n",
    "raises": "\nraise RuntimeError('broken on purpose')\n",
}
WAYS = {
    "plugin": "import vllm, vllm.plugins\nvllm.plugins.load_general_plugins()\n",
    "site": "import site\nsite.addsitedir({hook_dir!r})\nimport vllm\n",
    "import": "import vllm_hotfix\nimport vllm\n",
}
TAIL = f"from vllm.model_executor.models import deepseek_v2\nprint('APPLIED', {stand_in_vllm.FIX_APPLIED})\n"
PLUGIN_LOAD_FAILED = "Failed to load plugin vllm_hotfix"
LOADED = "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] == 'vllm_hotfix'))\n"


def _module_file(name: str) -> str:
    """`vllm_hotfix.fixes.base` -> `fixes/base.py`; a package -> its `__init__.py`."""
    parts = name.split(".")[1:]
    path = Path(stand_in_vllm.REPO, "vllm_hotfix", *parts)
    return "/".join([*parts, "__init__.py"] if path.is_dir() else [*parts[:-1], parts[-1] + ".py"])


def _cases() -> list[tuple[str, str]]:
    """(module, way) for every module of the package that the way loads before the model module is
    patched: breaking a module the path never loads could not reach vLLM, so its case could not fail.
    Read by running each way once on an intact copy (at collection, about a second)."""
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stand_in_vllm.write(work / "stand-in")
        (work / "hook").mkdir()
        (work / "hook" / site_hook.PTH_NAME).write_text(site_hook.PTH_TEXT)
        stand_in_vllm.copy_hotfix(work / "intact")
        for way in sorted(WAYS):
            done = run(work, work / "intact", way, strict=False, extra="import sys\n" + LOADED)
            (line,) = [line for line in done.stdout.splitlines() if line.startswith("LOADED ")]
            cases += [(_module_file(name), way) for name in ast.literal_eval(line[len("LOADED ") :])]
    return sorted(cases)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("broken-package")
    stand_in_vllm.write(root / "stand-in")
    (root / "hook").mkdir()
    (root / "hook" / site_hook.PTH_NAME).write_text(site_hook.PTH_TEXT)
    return root


def broken_copy(work: Path, module: str, breakage: str) -> Path:
    """A directory holding the package with `module` broken (made once per module and breakage)."""
    target = work / "copies" / f"{module.replace('/', '.')}-{breakage}"
    if not target.exists():
        stand_in_vllm.copy_hotfix(target)
        with open(target / "vllm_hotfix" / module, "a", encoding="utf-8") as handle:
            handle.write(BREAKAGES[breakage])
    return target


def run(work: Path, copy: Path, way: str, strict: bool, extra: str = "") -> subprocess.CompletedProcess[str]:
    code = WAYS[way].format(hook_dir=str(work / "hook")) + TAIL + extra
    env = {
        "PYTHONPATH": f"{copy}:{work / 'stand-in'}",
        "VLLM_PLUGINS": "vllm_hotfix",
        "XDG_CACHE_HOME": str(work / "cache"),
        "VLLMHOTFIX_STRICT": "1" if strict else "0",
    }
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(work), timeout=120
    )


def applied(done: subprocess.CompletedProcess[str]) -> bool:
    return "APPLIED True" in done.stdout


def reported(done: subprocess.CompletedProcess[str]) -> bool:
    """The breakage was said: our one line on stderr, or vLLM's plugin loader's log."""
    return any(line.startswith("vllm-hotfix: ") for line in done.stderr.splitlines()) or (
        PLUGIN_LOAD_FAILED in done.stdout
    )


CASES = _cases()
# Where errors are contained and what is loaded before anything can be: a way that left one of
# them out of its cases would leave its breakage untested.
ALWAYS_LOADED = (
    "__init__.py",
    "runtime/containment.py",
    "_version.py",
    "runtime/arming.py",
    "runtime/decide.py",
)


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
@pytest.mark.parametrize(("module", "way"), CASES)
def test_a_broken_module_never_breaks_vllm_outside_strict_mode(
    work: Path, module: str, breakage: str, way: str
) -> None:
    copy = broken_copy(work, module, breakage)
    done = run(work, copy, way, strict=False)
    output = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    if module == "__init__.py" and way == "import":
        assert done.returncode != 0, "importing a package whose __init__ is broken cannot succeed"
        return
    assert done.returncode == 0 and "APPLIED" in done.stdout, output
    lines = done.stderr.splitlines()
    assert all(line.startswith("vllm-hotfix: ") and len(line) < 300 for line in lines), output
    assert len(lines) <= 2, output
    assert applied(done) or reported(done), "the fix is not applied and nothing says so\n" + output

    strict = run(work, copy, way, strict=True)
    output = f"stdout:\n{strict.stdout[-3000:]}\nstderr:\n{strict.stderr[-3000:]}"
    if strict.returncode == 0 and not applied(strict):
        assert way != "import", "strict mode let vLLM run unpatched\n" + output
        assert reported(strict), "strict mode: not applied and nothing says so\n" + output


@pytest.mark.parametrize("way", sorted(WAYS))
def test_every_way_covers_the_modules_it_always_loads(way: str) -> None:
    assert {(module, way) for module in ALWAYS_LOADED} <= set(CASES)


def test_an_error_while_deciding_never_breaks_vllm_outside_strict_mode(work: Path) -> None:
    """Broken at call time, not at import: the switches cannot be read when the module is imported."""
    copy = work / "read-settings-raises"
    stand_in_vllm.copy_hotfix(copy)
    with open(copy / "vllm_hotfix" / "runtime/settings.py", "a", encoding="utf-8") as handle:
        handle.write("\n\ndef read_settings(*args, **kwargs):\n    raise RuntimeError('broken on purpose')\n")
    for way in WAYS:
        done = run(work, copy, way, strict=False)
        assert done.returncode == 0 and "APPLIED False" in done.stdout, (way, done.stderr[-3000:])
        assert done.stderr.splitlines() == [
            "vllm-hotfix: fix deepseek-final-aux not decided: RuntimeError: broken on purpose"
        ], (way, done.stderr[-3000:])
        strict = run(work, copy, way, strict=True)
        assert strict.returncode != 0 and "RuntimeError: broken on purpose" in strict.stderr, way


def test_the_intact_copy_patches_through_every_way(work: Path) -> None:
    copy = work / "intact"
    stand_in_vllm.copy_hotfix(copy)
    for way in WAYS:
        for strict in (False, True):
            done = run(work, copy, way, strict)
            assert done.returncode == 0 and applied(done) and not done.stderr, (way, strict, done.stderr)


@pytest.mark.vllm
def test_a_broken_settings_module_never_breaks_the_real_vllm(testenv: TestEnv, tmp_path: Path) -> None:
    """On the real vLLM, the launch-script import and the plugin (both installed): runtime/settings.py
    raising at import once made `import vllm` itself raise, from the arming's error handler."""
    copy = tmp_path / "copy"
    stand_in_vllm.copy_hotfix(copy)
    with open(copy / "vllm_hotfix" / "runtime/settings.py", "a", encoding="utf-8") as handle:
        handle.write(BREAKAGES["raises"])
    code = (
        "import vllm_hotfix\n"
        "import vllm\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.model_executor.models import deepseek_v2 as m\n"
        "print('APPLIED', hasattr(vars(m.DeepseekV2Model)['forward'], '__vllm_hotfix__'))\n"
    )
    env = {"VLLM_PLUGINS": "vllm_hotfix", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = testenv.run(["-c", code], paths=(str(copy),), **env)
    assert done.returncode == 0 and "APPLIED False" in done.stdout, done.stderr[-3000:]
    ours = {line for line in done.stderr.splitlines() if line.startswith("vllm-hotfix")}
    assert ours == {"vllm-hotfix: not armed: RuntimeError: broken on purpose"}, done.stderr[-3000:]
    strict = testenv.run(["-c", code], paths=(str(copy),), VLLMHOTFIX_STRICT="1", **env)
    assert strict.returncode != 0 and "RuntimeError: broken on purpose" in strict.stderr
