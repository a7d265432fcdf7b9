"""The vLLM engine a command starts of its own (`verify`, `audit`), with the user's `vllm serve` flags.

The flags go to the installed vLLM's own parser, so every flag works and a refusal is vLLM's own
message (CommandError: exit 3). What can be checked before vLLM is imported is checked then (usage
errors, exit 4). The engine is always stopped, and none of its processes outlives the command.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any, TextIO, cast

from vllm_hotfix.commands.output import UsageError, seconds
from vllm_hotfix.runtime.errors import one_line

DEFAULT_TIMEOUT = 3600.0  # s: a tiny model takes 1-2 min on CPU; a large one's load and cold compile tens


class CommandError(Exception):
    """vLLM refused the engine arguments, or the run could not go on: exit 3, in one line."""


def add_options(parser: argparse.ArgumentParser, report_dir_help: str) -> None:
    """The options of every command that starts an engine of its own."""
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout, nothing else")
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=DEFAULT_TIMEOUT,
        help="seconds for the whole run; then exit 3, the engine shut down (default %(default)g)",
    )
    parser.add_argument("--debug", action="store_true", help="print tracebacks of errors")
    parser.add_argument("--report-dir", help=report_dir_help)


def model_path_problem(model: str) -> str | None:
    """Why MODEL cannot be a checkpoint where it names a path (absolute, ./, ../, ~, more than one
    slash, an existing file), before vLLM is imported; a Hugging Face id (org/name) is vLLM's."""
    path = os.path.expanduser(model)
    if model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or os.path.exists(path):
        if not os.path.isdir(path):
            return f"MODEL {model}: no such checkpoint directory"
    return None


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


class NoVllm(CommandError):
    """This Python finds no vLLM: the command says so in one line (exit 3), and nothing else."""


def need_vllm(command: str) -> None:
    """NoVllm unless this Python finds vLLM; checked once the command line is known to be right,
    before anything else the command does."""
    from vllm_hotfix.runtime import status as report

    if not report.vllm_found():
        raise NoVllm(report.no_vllm(command))


def model_flag_problem(engine_args: list[str]) -> str | None:
    """`--model` among the engine arguments (after `--`): MODEL is the command's positional."""
    if any(arg == "--model" or arg.startswith("--model=") for arg in engine_args):
        return "--model in the engine arguments: give the model as MODEL (positional), not as --model"
    return None


def parse_engine_args(model: str, engine_args: list[str]) -> argparse.Namespace:
    """`vllm serve`'s own flags, parsed by the installed vLLM's parser; CommandError when it refuses
    them (its message, without argparse's exit)."""
    refused = model_flag_problem(engine_args)
    if refused:
        raise CommandError(refused)
    if importlib.util.find_spec("vllm") is None:
        raise CommandError("vLLM is not installed in this Python environment: install vllm-hotfix beside it")
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
    return kept
