"""The vLLM engine a command starts of its own (`verify`, `audit`): one session, from the user's
`vllm serve` flags to the verdict, with one end.

What the engine must be is data (`Engine`: the model, the user's flags, the aux ids, prefix caching
and chunked prefill); the flags go to the installed vLLM's own parser, so every flag works and a
refusal is vLLM's own message (CommandError: exit 3). What can be checked before vLLM is imported
is checked by the command first (usage errors, exit 4). Every end of a session, the watchdog's
--timeout and Ctrl-C included, goes through `Session._end`: the engine stopped (none of its
processes outlives the command), the run's records judged, the command's verdict printed, its
temporary directory removed, the process ended with the command's exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, NoReturn, TextIO, cast

from vllm_hotfix.check import outcome as outcome_mod
from vllm_hotfix.check import records as records_mod
from vllm_hotfix.commands.output import QuietPipe
from vllm_hotfix.judging import engine_facts
from vllm_hotfix.judging.verdicts import UsageError
from vllm_hotfix.runtime import settings
from vllm_hotfix.runtime.errors import one_line

VERDICT_FILE = "verdict.json"  # the --json document, kept beside the run's records in --report-dir
CHECKED_CACHES = "vllm-hotfix-verify"  # the directory, under vLLM's cache root, of checked runs' caches
DUMMY_CAVEAT = (
    "--load-format dummy: vLLM gives every weight small random values, not the checkpoint's. This"
    " run shows that the aux states arrive, are finite and agree between ranks; it cannot show that"
    " their values are right for the model. Run it again on the checkpoint before trusting a PASS."
)


class CommandError(Exception):
    """vLLM refused the engine arguments, or the run could not go on: exit 3, in one line."""


class NoVllm(CommandError):
    """This Python finds no vLLM: the command says so in one line (exit 3), and nothing else."""


@dataclasses.dataclass(frozen=True)
class Engine:
    """What the command's engine must be."""

    model: str
    flags: list[str]  # the user's `vllm serve` flags
    ids: list[int] | None = None  # extract_hidden_states' aux ids; None: the default ids, or the
    # user's own --speculative-config's
    neighbours: bool = False  # each id's neighbours computed too (the audit: an id off by one shows)
    prefix_caching: bool | None = None  # None: as the flags say
    chunked_prefill: bool | None = None


@dataclasses.dataclass
class Facts:
    """What the session's engine is, as its documents say: fixed before vLLM starts."""

    run_id: str
    report_dir: str
    ids: list[int] | None = None  # None: the user's own speculative config decides them
    method: str = "extract_hidden_states"
    world: outcome_mod.World = dataclasses.field(default_factory=outcome_mod.World)
    load_format: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    model_class: str | None = None  # `module:Class`, resolved by vLLM's registry (check/hook.py hooks it)
    compilation: dict[str, Any] | None = None  # the modes the engine ran with

    @property
    def caveats(self) -> list[str]:
        return [DUMMY_CAVEAT] if self.load_format == "dummy" else []


class Said(NamedTuple):
    """A command's verdict: its --json document, its text, its exit code."""

    document: dict[str, Any]
    text: str
    code: int


def check_ids(ids: list[int], layers: int) -> None:
    """Aux layer ids must name the model's layers (0..L, L the final norm's input); a larger id
    would make vLLM fail late, or check nothing."""
    wrong = [i for i in ids if not 0 <= i <= layers]
    if wrong:
        raise CommandError(f"--ids {wrong}: beyond the model's layers; valid ids are 0 to {layers}")


def default_ids(layers: int) -> list[int]:
    """The EAGLE3 convention (vLLM's default aux layers: 2, L // 2, L - 3) plus the final layer L.
    Id 0 is left out: vLLM's forwards have no residual before layer 0."""
    eagle3 = {i for i in (2, layers // 2, layers - 3) if 1 <= i < layers}
    return [*sorted(eagle3), layers]


def with_neighbours(ids: list[int], layers: int) -> list[int]:
    """The ids and each one's neighbours within 1..layers, in the order the model returns them. Id
    0 only where asked: many models' forwards cannot capture it (no residual before layer 0), so it
    is never added as a neighbour."""
    wanted = {n for i in ids for n in (i - 1, i + 1) if 1 <= n <= layers}
    return sorted(wanted | set(ids))


class Session:
    """One engine of the command's own, from the flags to the verdict: `open` (vLLM's parser, the
    model's config, the check armed), `start` (the engine), the command's workload, then the one
    end, `_end`, reached by leaving the `with` block in any way or by the watchdog's --timeout.
    `render` makes the command's verdict from the check's outcome."""

    def __init__(
        self,
        command: str,
        engine: Engine,
        render: Callable[[Session, outcome_mod.Outcome, bool], Said],
        *,
        report_dir: str | None,
        timeout: float,
        debug: bool = False,
        remove_records: bool = False,
    ) -> None:
        self.command = command
        self.engine = engine
        self.render = render
        self.timeout = timeout
        self.debug = debug
        self.remove_records = remove_records  # each record once judged (the audit's are many)
        self.given_dir = report_dir
        self.own_dir: str | None = None  # a temporary report directory made here (removed at the end)
        self.facts = Facts(uuid.uuid4().hex, report_dir or "")
        self.phase = "reading the options"
        self.started = time.monotonic()
        self.stdout: TextIO = sys.stdout
        self.llm: Any = None
        self.vllm_started = False
        self.hidden_size: int | None = None
        self.vocab = 0
        self.max_len = 0
        self._args: Any = None  # vLLM's EngineArgs, once read from the flags
        self._records: records_mod.RunRecords | None = None
        self._ending = threading.Lock()
        self._watchdog = threading.Timer(timeout, self._expire)
        self._watchdog.daemon = True

    @property
    def run_dir(self) -> str:
        return os.path.join(self.facts.report_dir, self.facts.run_id)

    @property
    def seconds(self) -> float:
        return round(time.monotonic() - self.started, 1)

    # -- the session ---------------------------------------------------------------------------
    def __enter__(self) -> Session:
        self.stdout = keep_stdout()
        self._watchdog.start()
        if not self.given_dir:
            self.facts.report_dir = self.own_dir = tempfile.mkdtemp(prefix="vllm-hotfix-verify-")
        # Before vLLM is imported (by its argument parser): every process of the engine inherits them.
        os.environ.pop(settings.VERIFY_VAR, None)  # the retired switch: not this run's business
        os.environ[settings.REPORT_VAR] = self.facts.report_dir
        os.environ[settings.RUN_ID_VAR] = self.facts.run_id
        keyed_compile_cache()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: TracebackType | None
    ) -> None:
        """The one way out: whatever ended the block, the session's end."""
        if error is None:
            self.phase = "reading the reports"
            self._end()
        if isinstance(error, KeyboardInterrupt):
            self._end(f"interrupted (Ctrl-C) while {self.phase}")
        if self.debug:
            traceback.print_exception(error)
        if isinstance(error, CommandError):
            self._end(str(error))
        whose = "vLLM" if self.vllm_started else "the command"
        self._end(f"{whose} failed while {self.phase}: {one_line(error)}")

    def _expire(self) -> None:
        self._end(f"--timeout {self.timeout:g} s expired while {self.phase}; the engine was shut down", True)

    def _end(self, error: str | None = None, timed_out: bool = False) -> NoReturn:
        """Stop the engine (its processes have written every record), judge, print, exit: the
        session's one end. The watchdog may race the main thread: the first to come ends the
        process, the other waits for that."""
        if not self._ending.acquire(blocking=False):
            threading.Event().wait()  # the other thread's os._exit ends this one too
        self._watchdog.cancel()
        stop(self.llm, forced=timed_out or self.llm is None)
        reports: list[dict[str, Any]] = []
        ignored = 0
        try:
            found = self.records()
            found.consume(final=True)
            reports, ignored = found.reports(), found.other_runs()
        except Exception as failed:  # e.g. no torch: the command's own failure
            error = error or f"the reports could not be combined: {one_line(failed)}"
        judged = outcome_mod.verdict_of_run(reports, self.facts.run_id, self.facts.world, error, ignored)
        said = self.render(self, judged, timed_out)
        if self.own_dir is None:  # beside the records, in a directory kept
            with contextlib.suppress(OSError):
                Path(self.run_dir).mkdir(parents=True, exist_ok=True)
                Path(self.run_dir, VERDICT_FILE).write_text(
                    json.dumps(said.document, indent=2), encoding="utf-8"
                )
        with contextlib.suppress(Exception):
            print(said.text, file=self.stdout)
            self.stdout.flush()
            sys.stderr.flush()
        if self.own_dir is not None:  # never a directory the user gave: only the one made here
            shutil.rmtree(self.own_dir, ignore_errors=True)
        os._exit(said.code)  # vLLM's engine processes may hold the interpreter's exit

    def records(self) -> records_mod.RunRecords:
        """The run's records, judged as they arrive (removed once judged where the command says so)."""
        if self._records is None:
            self._records = records_mod.RunRecords(
                self.facts.report_dir, self.facts.run_id, self.remove_records
            )
        return self._records

    # -- the engine ----------------------------------------------------------------------------
    def open(self) -> None:
        """Read the flags with vLLM's parser and the model's config; settle the aux ids; arm the
        check in this process (and, by the environment, in the engine's)."""
        want, facts = self.engine, self.facts
        self.phase = "parsing the engine arguments"
        namespace = parse_engine_args(want.model, want.flags)
        sizes = (
            int(getattr(namespace, f"{n}_parallel_size", 1) or 1) for n in ("tensor", "pipeline", "data")
        )
        facts.world = outcome_mod.World(*sizes)
        facts.load_format = str(getattr(namespace, "load_format", None) or "") or None
        engine = engine_args_from(namespace, want.flags)
        self.phase = "reading the model's config"
        config = vllm_checks(want.model, want.flags, engine.create_model_config)
        text_config = config.hf_text_config
        self.hidden_size = int(getattr(text_config, "hidden_size", 0) or 0) or None
        own = engine.speculative_config
        if own:
            if want.ids:
                raise CommandError(
                    "--ids sets extract_hidden_states' layer ids; with your own --speculative-config"
                    " its aux layer ids are the ones checked (set them there)"
                )
            method = own.get("method") if isinstance(own, dict) else getattr(own, "method", None)
            facts.method = f"your --speculative-config (method {method!r})"
        else:
            layers = int(text_config.num_hidden_layers)
            if want.ids:
                check_ids(want.ids, layers)
                facts.ids, note = engine_facts.in_vllm_order(want.ids)
                facts.notes += [note] if note else []
            else:
                facts.ids = default_ids(layers)
            if want.neighbours:
                facts.ids = with_neighbours(facts.ids, layers)
            engine.speculative_config = {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": facts.ids}},
            }
        if want.prefix_caching is not None:
            engine.enable_prefix_caching = want.prefix_caching
        if want.chunked_prefill is not None:
            engine.enable_chunked_prefill = want.chunked_prefill
        no_cuda_graphs(engine)
        self.phase = "resolving the model class"
        facts.model_class = model_class(config)
        os.environ[settings.MODEL_VAR] = facts.model_class
        from vllm_hotfix.check import hook

        hook.arm()  # this process too: an engine vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        self._args = engine

    def start(self) -> None:
        """Start the engine `open` read (its processes load the check), saying what it is."""
        facts = self.facts
        if not plugin_reachable():
            say(
                self.command,
                "WARNING: vLLM's worker processes will not load vllm-hotfix (no `vllm.general_plugins`"
                " entry point of vllm_hotfix, or VLLM_PLUGINS filters it out, and no site hook): the"
                " check cannot run in them. Install vllm-hotfix with pip in vLLM's environment.",
            )
        for caveat in facts.caveats:
            say(self.command, caveat)
        say(
            self.command,
            f"starting vLLM with {self.engine.model} ({facts.world.tensor_parallel} tensor x"
            f" {facts.world.pipeline_parallel} pipeline parallel; {facts.method}; aux ids"
            f" {facts.ids if facts.ids is not None else 'from your speculative config'}; model class"
            f" {facts.model_class}; run {facts.run_id}); vLLM's own log follows. Records: {facts.report_dir}",
        )
        self.phase = "starting vLLM"
        self.vllm_started = True
        self.llm = start(self._args)
        facts.compilation = engine_facts.compilation(self.llm.llm_engine.vllm_config)
        model_config = self.llm.llm_engine.model_config
        self.vocab, self.max_len = model_config.get_vocab_size(), int(model_config.max_model_len)
        say(self.command, f"vLLM started in {time.monotonic() - self.started:.0f} s")


def say(command: str, text: str) -> None:
    """A message of the command's on stderr (vLLM's log is there too)."""
    print(f"vllm-hotfix {command}: {text}", file=sys.stderr, flush=True)


def model_path_problem(model: str) -> str | None:
    """Why MODEL cannot be a checkpoint where it names a path (absolute, ./, ../, ~, more than one
    slash, an existing file), before vLLM is imported; a Hugging Face id (org/name) is vLLM's."""
    path = os.path.expanduser(model)
    if model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or os.path.exists(path):
        if not os.path.isdir(path):
            return f"MODEL {model}: no such checkpoint directory"
    return None


def usage_problem(model: str, flags: list[str]) -> str | None:
    """What refuses a run before vLLM is imported: MODEL's path, `--model` among the engine flags,
    or a bad VLLMHOTFIX_VERIFY_TOKENS, which the engine's workers would otherwise replace by its
    default without a word."""
    return model_path_problem(model) or model_flag_problem(flags) or settings.read_verify().problem


def writable(directory: str) -> None:
    """UsageError unless `directory` can be made and written (before the engine starts)."""
    try:
        os.makedirs(directory, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as error:
        raise UsageError(f"--report-dir {directory}: not writable ({error.strerror or error})") from None


def plugin_reachable() -> bool:
    """Whether the engine's processes will load vllm-hotfix: its plugin entry point, not filtered
    out by VLLM_PLUGINS, or its site hook."""
    from importlib.metadata import entry_points

    from vllm_hotfix.runtime import site_hook

    names = {entry.value for entry in entry_points(group="vllm.general_plugins")}
    allowed = os.environ.get("VLLM_PLUGINS")
    plugin = "vllm_hotfix.plugin:register" in names and (
        allowed is None or "vllm_hotfix" in allowed.split(",")
    )
    return plugin or site_hook.installed_path() is not None


def need_vllm(command: str) -> None:
    """NoVllm unless this Python finds vLLM; checked once the command line is known to be right,
    before anything else the command does."""
    from vllm_hotfix.commands.status import no_vllm
    from vllm_hotfix.runtime import status as report

    if not report.vllm_found():
        raise NoVllm(no_vllm(command))


def model_flag_problem(engine_args: list[str]) -> str | None:
    """`--model` among the engine arguments (after `--`): MODEL is the command's positional."""
    if any(arg == "--model" or arg.startswith("--model=") for arg in engine_args):
        return "--model in the engine arguments: give the model as MODEL (positional), not as --model"
    return None


def parse_engine_args(model: str, engine_args: list[str]) -> argparse.Namespace:
    """`vllm serve`'s own flags, parsed by the installed vLLM's parser; CommandError when it refuses
    them (its message, without argparse's exit)."""
    from vllm.engine.arg_utils import EngineArgs, FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):  # type: ignore[misc]  # vLLM's class: Any here
        def error(self, message: str) -> Any:
            raise CommandError(f"vLLM refused the engine arguments {engine_args}: {message}")

    parser = EngineArgs.add_cli_args(Parser(prog="vllm-hotfix --"))
    try:
        namespace = parser.parse_args(["--model", model, *engine_args])
    except SystemExit as stop:  # e.g. --help, or a parser that exits by itself
        raise CommandError(f"vLLM's argument parser stopped (exit {stop.code}) on {engine_args}") from None
    return cast(argparse.Namespace, namespace)


def vllm_checks(model: str, given: list[str], make: Callable[[], Any]) -> Any:
    """`make()`, where vLLM checks the values of MODEL and the engine arguments (a checkpoint without
    a config, a tokenizer): exit 3."""
    try:
        return make()
    except Exception as error:
        said = f"vLLM refused MODEL {model} or the engine arguments {given}: {one_line(error)}"
        raise CommandError(said) from error


def engine_args_from(namespace: argparse.Namespace, given: list[str]) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return vllm_checks(str(namespace.model), given, lambda: EngineArgs.from_cli_args(namespace))


def start(engine: Any) -> Any:
    """vLLM's offline `LLM`, built from the EngineArgs `engine` as they stand."""
    from vllm import LLM

    return LLM(**{f.name: getattr(engine, f.name) for f in dataclasses.fields(engine) if f.init})


def stop(llm: Any, forced: bool) -> None:
    """vLLM's own shutdown (bounded), then any child process still running is killed: an engine
    that timed out, or failed while starting, must not outlive the command."""

    def shutdown() -> None:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()

    if llm is not None:
        done = threading.Thread(target=shutdown, daemon=True)
        done.start()
        done.join(30)
    with contextlib.suppress(Exception):
        import psutil  # a dependency of vLLM's, not of vllm-hotfix: the command runs beside vLLM

        children = psutil.Process().children(recursive=True)
        for child in children:
            with contextlib.suppress(Exception):
                child.send_signal(signal.SIGTERM if not forced else signal.SIGKILL)
        # after vLLM's own shutdown what is left is mostly multiprocessing's resource tracker,
        # which ignores SIGTERM: waiting 10 s on it was a tenth of a tiny model's whole check
        for child in psutil.wait_procs(children, timeout=2)[1]:
            with contextlib.suppress(Exception):
                child.kill()


def keep_stdout() -> TextIO:
    """The real stdout, for the verdict alone; fd 1 (vLLM's log, its child processes) goes to stderr."""
    sys.stdout.flush()
    kept = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    return cast(TextIO, QuietPipe(kept))


def model_class(config: Any) -> str:
    """`module:Class` of the model vLLM will build: its registry's entry where nothing else applies
    (no conversion, vLLM's own implementation), without importing the model's module (about 30 s
    for deepseek_v2 on 2 cores); otherwise vLLM's `get_model_architecture`, as its loader does."""
    registry = getattr(config, "registry", None)
    plain = str(getattr(config, "convert_type", "none") or "none") == "none"
    if registry is not None and plain and str(getattr(config, "model_impl", "auto")) in ("auto", "vllm"):
        for arch in getattr(config, "architectures", None) or []:
            try:
                entry = registry.models.get(registry._normalize_arch(arch, config))
            except Exception:
                entry = None
            if getattr(entry, "module_name", None) and getattr(entry, "class_name", None):
                return f"{entry.module_name}:{entry.class_name}"
            if entry is not None:
                break
    from vllm.model_executor.model_loader.utils import get_model_architecture

    cls, _ = get_model_architecture(config)
    return f"{cls.__module__}:{cls.__qualname__}"


def no_cuda_graphs(engine: Any) -> None:
    """CUDA graphs off through vLLM's public compilation config, where the release has it: every
    forward runs the compiled code, taps included (--enforce-eager compiles nothing)."""
    if getattr(engine, "enforce_eager", False):
        return
    config = getattr(engine, "compilation_config", None)
    if isinstance(config, dict):
        config["cudagraph_mode"] = "NONE"
    elif config is not None and hasattr(config, "cudagraph_mode"):
        from vllm.config import CUDAGraphMode

        config.cudagraph_mode = CUDAGraphMode.NONE


def keyed_compile_cache() -> None:
    """vLLM's compile caches under `<vLLM's cache root>/vllm-hotfix-verify/<key>`, the key a digest of
    the package version and the check's code, set before vLLM reads it: vLLM's ahead-of-time artifact
    is not keyed on hooks, so in a shared directory a checked run could load a graph traced without
    the taps (every id `n/a`), or store one with them for engines without the check."""
    from vllm_hotfix import check
    from vllm_hotfix._version import __version__

    digest = hashlib.sha256(__version__.encode())
    for path in sorted(Path(check.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "vllm"
    )
    root = os.path.expanduser(root).rstrip(os.sep)
    if os.path.basename(os.path.dirname(root)) == CHECKED_CACHES:  # already a checked run's root
        root = os.path.dirname(os.path.dirname(root))
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(root, CHECKED_CACHES, digest.hexdigest()[:12])
