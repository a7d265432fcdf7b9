"""`vllm-hotfix verify MODEL [OPTIONS] [-- ENGINE ARGS]`: start an engine of its own with the
user's flags (the installed vLLM's own parser), compiled, CUDA graphs off through its public config;
run a bounded workload and judge every forward of it from the ranks' records (outcome.py). Exit
codes: judging/exit_codes.py. Only the verdict goes to stdout; vLLM's log goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Protocol, TextIO

from vllm_hotfix.check import inductor_order
from vllm_hotfix.check import outcome as outcome_mod
from vllm_hotfix.check import records as records_mod
from vllm_hotfix.commands import output, session
from vllm_hotfix.commands.output import Parser, UsageError, aux_ids, exit_usage, in_vllm_order, numbers
from vllm_hotfix.commands.session import CommandError, writable
from vllm_hotfix.judging import engine_facts as runtime
from vllm_hotfix.judging import exit_codes
from vllm_hotfix.runtime import settings
from vllm_hotfix.runtime.errors import one_line

DECODE = 2  # tokens generated per prompt of the workload: its prefill and a decode step are checked
DEFAULT_LENGTHS = (16, 64, 512, 2048)  # long prefills can take other kernel paths than short prompts
DEFAULT_BATCHES = (1, 4)
SCHEMA = output.SCHEMAS["verify"]  # 4: a per-id status is ok, wrong or n/a; 5: tokens as totals
PLAN_KEYS = ("run_id", "method", "ids", "model_class", "compilation", "load_format", "report_dir")  # document
VERDICT_FILE = "verdict.json"  # the --json document, kept beside the run's records in --report-dir
DUMMY_CAVEAT = (
    "--load-format dummy: vLLM gives every weight small random values, not the checkpoint's. This"
    " run shows that the aux states arrive, are finite and agree between ranks; it cannot show that"
    " their values are right for the model. Run it again on the checkpoint before trusting a PASS."
)


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


def _say(text: str) -> None:
    print(f"vllm-hotfix verify: {text}", file=sys.stderr, flush=True)


def _figure(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def format_reports(reports: list[dict[str, Any]]) -> str:
    """The reports as text: the model and modes once, a line or two per rank, each id once over the
    ranks (the --json document has every rank's figures)."""
    if not reports:
        return "no worker recorded a forward of this run"
    first, lines = reports[0], []
    if first.get("model") is not None:
        compiled = first.get("compilation") or {}
        lines.append(
            f"model {first['model']} ({first.get('model_class')}), ids {first.get('ids')}, vLLM"
            f" {first.get('vllm_version')}; compilation mode {compiled.get('mode')}, CUDA graphs"
            f" {compiled.get('cudagraph_mode')}"
        )
    for r in reports:
        agree, count = r.get("ranks_agree") or {}, r.get("count") or {}
        tokens, checked = r.get("tokens") or {}, r.get("checked_tokens") or {}
        lines.append(
            f"rank {r.get('rank')}/{r.get('world')} (pid {r.get('pid')}): {r.get('verdict')}; forwards"
            f" checked: {r.get('steps')}"
        )
        if r.get("steps"):
            lines[-1] += (
                f" ({tokens.get('smallest')} to {tokens.get('largest')} tokens, {tokens.get('total')} in all)"
            )
        if checked.get("cut_forwards"):
            lines[-1] += (
                f"; {checked['cut_forwards']} compared on their first"
                f" {settings.read_verify().tokens} tokens ({settings.TOKENS_VAR})"
            )
        if r.get("steps"):
            tolerance = "n/a" if agree.get("tolerance") is None else f"{agree['tolerance']:.0e}"
            worst = f", worst at id {agree['worst_id']}" if agree.get("worst_id") is not None else ""
            lines.append(
                f"  count and shape: {'ok' if count.get('ok') else 'FAIL: ' + str(count.get('detail'))};"
                f" finite: {'ok' if (r.get('finite') or {}).get('ok') else 'FAIL'}; ranks agree:"
                f" {'ok' if agree.get('ok') else 'FAIL'} (max rel diff {_figure(agree.get('max_rel_diff'))},"
                f" tolerance {tolerance}{worst})"
            )
        lines += [
            f"  error on rank {e.get('rank')} at {e.get('stage')}: {e.get('message')}"
            for e in r.get("errors") or []
        ]
        lines += [f"  failed on ranks: {r['failed_ranks']}"] if r.get("failed_ranks") else []
        lines += [f"  {key}: {r[key]}" for key in ("note", "hint") if r.get(key)]
    for e in outcome_mod.per_id(reports):
        against = f" vs {e['reference']}" if e.get("reference") else ""
        why = f": {e['why']}" if e.get("why") else ""
        lines.append(f"id {e['id']}: {e['status']} (max rel diff {_figure(e['max_rel_diff'])}{against}){why}")
    return "\n".join(lines)


@dataclasses.dataclass
class Plan:
    """What the run checks, fixed before vLLM starts (workload trimmed once the engine says its
    max_model_len)."""

    run_id: str
    report_dir: str
    lengths: list[int]
    batches: list[int]
    ids: list[int] | None = None  # None: the user's own speculative config decides them
    method: str = "extract_hidden_states"
    world: outcome_mod.World = dataclasses.field(default_factory=outcome_mod.World)
    load_format: str | None = None
    skipped_lengths: list[int] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    model_class: str | None = None  # `module:Class`, resolved by vLLM's registry (hook.py hooks it)
    compilation: dict[str, Any] | None = None  # the modes the engine ran with

    @property
    def caveats(self) -> list[str]:
        return [DUMMY_CAVEAT] if self.load_format == "dummy" else []


class Job(Protocol):
    """What a command runs on the check's engine: verify's bounded workload (Check) or the audit's
    files (commands/audit.py). Run owns the engine, the watchdog and the one end, and calls these."""

    command: str  # the command a usage error names
    remove_records: bool  # each record once judged: verify keeps them, the audit's forwards are many

    def before_vllm(self, run: Run) -> None:
        """Set what the engine's processes must inherit (vLLM is not imported yet)."""

    def adjust_engine(self, run: Run, engine: Any, config: Any) -> None:
        """Change vLLM's EngineArgs (read from the user's flags) before the engine is built."""

    def workload(self, run: Run, vocab: int, max_len: int, sampling: Any) -> None:
        """The prompts the engine runs; every forward of them is checked."""

    def document(self, run: Run, judged: outcome_mod.Outcome, timed_out: bool) -> dict[str, Any]:
        """The --json document (also kept as the run's verdict.json)."""

    def text(self, run: Run, judged: outcome_mod.Outcome) -> str:
        """The output without --json."""

    def exit_code(self, run: Run, judged: outcome_mod.Outcome) -> int:
        """The command's exit code."""


class Check:
    """verify's job: the bounded workload of run_workload, judged by the check alone."""

    command = "verify"
    remove_records = False

    def before_vllm(self, run: Run) -> None:
        return None

    def adjust_engine(self, run: Run, engine: Any, config: Any) -> None:
        return None

    def workload(self, run: Run, vocab: int, max_len: int, sampling: Any) -> None:
        assert run.plan is not None
        run_workload(run.llm, run.plan, vocab, sampling, run)

    def document(self, run: Run, judged: outcome_mod.Outcome, timed_out: bool) -> dict[str, Any]:
        return check_document(run, judged, timed_out)

    def text(self, run: Run, judged: outcome_mod.Outcome) -> str:
        return check_text(run, judged)

    def exit_code(self, run: Run, judged: outcome_mod.Outcome) -> int:
        return judged.exit_code


class Run:
    """One run of a job: the plan, the engine, the watchdog, and the one place that ends it (finish)."""

    def __init__(self, args: argparse.Namespace, stdout: TextIO, job: Job) -> None:
        self.args = args
        self.stdout = stdout
        self.job = job
        self.llm: Any = None
        self.engine: Any = None  # vLLM's EngineArgs, once parsed
        self.plan: Plan | None = None
        self.phase = "reading the options"
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.own_dir: str | None = None  # a temporary report directory this run made (removed at the end)
        self._records: records_mod.RunRecords | None = None

    # -- the end -------------------------------------------------------------------------------
    def finish(self, error: str | None = None, timed_out: bool = False) -> None:
        """Stop the engine (its processes have written every record), combine, judge, print, exit.
        Called once (the watchdog may race the main thread)."""
        if not self.lock.acquire(blocking=False):
            time.sleep(3600)  # the other thread is ending the process
        session.stop(self.llm, forced=timed_out or self.llm is None)
        plan, ignored = self.plan, 0
        reports: list[dict[str, Any]] = []
        if plan is not None:
            try:
                found = self.records()
                found.consume(final=True)
                reports, ignored = found.reports(), found.other_runs()
            except Exception as failed:  # e.g. no torch: the command's own failure
                error = error or f"the reports could not be combined: {one_line(failed)}"
        world = plan.world if plan is not None else outcome_mod.World()
        judged = outcome_mod.verdict_of_run(reports, plan.run_id if plan else "", world, error, ignored)
        document = self.job.document(self, judged, timed_out)
        if plan is not None and self.own_dir is None:  # beside the records, in a directory kept
            with contextlib.suppress(OSError):
                (run_dir := Path(plan.report_dir, plan.run_id)).mkdir(parents=True, exist_ok=True)
                (run_dir / VERDICT_FILE).write_text(json.dumps(document, indent=2), encoding="utf-8")
        with contextlib.suppress(Exception):
            said = json.dumps(document, indent=2) if self.args.json else self.job.text(self, judged)
            print(said, file=self.stdout)
            self.stdout.flush()
            sys.stderr.flush()
        code = self.job.exit_code(self, judged)
        if self.own_dir is not None:  # never a directory the user gave: only the one made here
            shutil.rmtree(self.own_dir, ignore_errors=True)
        os._exit(code)  # vLLM's engine processes may hold the interpreter's exit

    def records(self) -> records_mod.RunRecords:
        """The run's records, judged as they arrive (removed once judged where the job says so)."""
        assert self.plan is not None
        if self._records is None:
            plan = self.plan
            self._records = records_mod.RunRecords(plan.report_dir, plan.run_id, self.job.remove_records)
        return self._records

    def expire(self) -> None:
        limit = self.args.timeout
        self.finish(f"--timeout {limit:g} s expired while {self.phase}; the engine was shut down", True)

    # -- the run -------------------------------------------------------------------------------
    def prepare(self) -> Plan:
        args = self.args
        problem = usage_problem(args.model) or session.model_flag_problem(list(args.engine_args))
        if problem:
            raise UsageError(problem)
        report_dir = args.report_dir
        if report_dir:
            writable(report_dir)
        session.need_vllm(getattr(args, "command", None) or "verify")  # the command line is right
        if not report_dir:
            report_dir = self.own_dir = tempfile.mkdtemp(prefix="vllm-hotfix-verify-")
        lengths = sorted(set(args.prompt_lengths or DEFAULT_LENGTHS))
        batches = sorted(set(args.batch_sizes or DEFAULT_BATCHES))
        plan = Plan(uuid.uuid4().hex, report_dir, lengths, batches)
        given = list(args.engine_args)
        self.plan = plan  # from here on the output names the report directory and the run id
        # Before vLLM is imported (by its argument parser): every process of the engine inherits them.
        os.environ.pop(settings.VERIFY_VAR, None)  # the retired switch: not this run's business
        os.environ[settings.REPORT_VAR] = report_dir
        os.environ[settings.RUN_ID_VAR] = plan.run_id
        self.job.before_vllm(self)
        keyed_compile_cache()
        self.phase = "parsing the engine arguments"
        namespace = session.parse_engine_args(args.model, given)
        sizes = (
            int(getattr(namespace, f"{n}_parallel_size", 1) or 1) for n in ("tensor", "pipeline", "data")
        )
        plan.world = outcome_mod.World(*sizes)
        plan.load_format = str(getattr(namespace, "load_format", None) or "") or None
        engine = session.engine_args_from(namespace, given)
        self.phase = "reading the model's config"
        config = session.vllm_checks(args.model, given, engine.create_model_config)
        own = engine.speculative_config
        if own:
            if args.ids:
                raise CommandError(
                    "--ids sets extract_hidden_states' layer ids; with your own --speculative-config"
                    " its aux layer ids are the ones checked (set them there)"
                )
            method = own.get("method") if isinstance(own, dict) else getattr(own, "method", None)
            plan.method = f"your --speculative-config (method {method!r})"
        else:
            layers = int(config.hf_text_config.num_hidden_layers)
            if args.ids:
                check_ids(args.ids, layers)
                plan.ids, note = in_vllm_order(args.ids)
                plan.notes += [note] if note else []
            else:
                plan.ids = default_ids(layers)
            engine.speculative_config = {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": plan.ids}},
            }
        self.job.adjust_engine(self, engine, config)
        no_cuda_graphs(engine)
        self.phase = "resolving the model class"
        plan.model_class = model_class(config)
        os.environ[settings.MODEL_VAR] = plan.model_class
        from vllm_hotfix.check import hook

        hook.arm()  # this process too: an engine vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        self.engine = engine
        return plan

    def main(self) -> None:
        args = self.args
        plan = self.prepare()
        if not session.plugin_reachable():
            _say(
                "WARNING: vLLM's worker processes will not load vllm-hotfix (no `vllm.general_plugins`"
                " entry point of vllm_hotfix, or VLLM_PLUGINS filters it out, and no site hook): the"
                " check cannot run in them. Install vllm-hotfix with pip in vLLM's environment."
            )
        for caveat in plan.caveats:
            _say(caveat)
        _say(
            f"starting vLLM with {args.model} ({plan.world.tensor_parallel} tensor x"
            f" {plan.world.pipeline_parallel} pipeline parallel; {plan.method}; aux ids"
            f" {plan.ids if plan.ids is not None else 'from your speculative config'}; model class"
            f" {plan.model_class}; run {plan.run_id}); vLLM's own log follows. Records: {plan.report_dir}"
        )
        self.phase = "starting vLLM"
        from vllm import SamplingParams

        try:
            self.llm = session.start(self.engine)
            plan.compilation = runtime.compilation(self.llm.llm_engine.vllm_config)
            model_config = self.llm.llm_engine.model_config
            vocab, max_len = model_config.get_vocab_size(), int(model_config.max_model_len)
            plan.skipped_lengths = [n for n in plan.lengths if n + DECODE > max_len]
            if plan.skipped_lengths:
                plan.notes.append(
                    f"prompt lengths {plan.skipped_lengths} left out: with the {DECODE} tokens each"
                    f" generates, over max_model_len {max_len}"
                )
            plan.lengths = [n for n in plan.lengths if n + DECODE <= max_len]
            _say(f"vLLM started in {time.monotonic() - self.started:.0f} s")
            self.job.workload(self, vocab, max_len, SamplingParams)
        except CommandError:
            raise
        except Exception as error:  # vLLM's own error: exit 3, with whatever the check saw
            if args.debug:
                traceback.print_exc()
            self.finish(f"vLLM failed while {self.phase}: {one_line(error)}")
        self.phase = "reading the reports"
        self.finish()


def check_text(run: Run, judged: outcome_mod.Outcome) -> str:
    """The check's verdict as text: the ranks, the run's notes and caveats, the verdict line."""
    lines = [format_reports(judged.reports)]
    plan = run.plan
    if judged.ignored and plan is not None:
        lines.append(f"ignored {judged.ignored} report(s) of other runs in {plan.report_dir}")
    if plan is not None:
        lines += [f"note: {note}" for note in plan.notes]
        lines += [f"caveat: {caveat}" for caveat in plan.caveats]
    lines += [f"torch: {why}" for why in inductor_order.reported(judged.reports)]
    lines += [f"problem: {problem}" for problem in judged.problems if problem != judged.reason]
    if judged.error and judged.verdict == outcome_mod.FAIL:
        lines.append(f"vLLM stopped with an error: {judged.error}")
    elif not judged.error and not judged.reports and not judged.ignored:
        lines.append(
            "no record came back: is vllm-hotfix armed in vLLM's workers (pip install; VLLM_PLUGINS)?"
        )
    lines.append(f"verdict: {judged.verdict} ({judged.reason}); exit {judged.exit_code}")
    return "\n".join(lines)


def check_document(run: Run, judged: outcome_mod.Outcome, timed_out: bool) -> dict[str, Any]:
    """The check's --json document (the audit's holds it as `check`)."""
    plan = run.plan
    workload = plan and {
        "prompt_lengths": plan.lengths,
        "skipped_lengths": plan.skipped_lengths,
        "batch_sizes": plan.batches,
        "decode_tokens": DECODE,
    }
    return output.document(
        "verify",
        judged.exit_code,
        judged.reason,
        verdict=judged.verdict,
        problems=judged.problems,
        error=judged.error,
        timed_out=timed_out,
        model=run.args.model,
        engine_args=list(run.args.engine_args),
        **{key: getattr(plan, key, None) for key in PLAN_KEYS},
        world=plan and plan.world.as_dict(),
        workload=workload,
        caveats=plan.caveats if plan else [],
        notes=plan.notes if plan else [],
        ignored_reports=judged.ignored,
        per_id=outcome_mod.per_id(judged.reports),
        coverage=outcome_mod.coverage(judged.reports),
        ranks=judged.reports,
        seconds=round(time.monotonic() - run.started, 1),
    )


def run_workload(llm: Any, plan: Plan, vocab: int, sampling: Any, run: Any = None) -> None:
    """Each prompt length in each batch size, greedy, DECODE tokens each: its prefill and decode
    forwards are all checked. Distinct prompts: no prefix-cache hit hides a prefill."""
    counter, span = 0, max(vocab - 1, 2)
    greedy = sampling(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    for batch in plan.batches:
        for length in plan.lengths:
            if run is not None:
                run.phase = f"generating {batch} prompt(s) of {length} tokens"
            # fixed token ids inside the vocabulary (no tokenizer needed), distinct per prompt
            ids = [
                [(37 * n + 101 * t + 7 * n * t + 5) % span + 1 for t in range(length)]
                for n in range(counter, counter + batch)
            ]
            counter += batch
            llm.generate([{"prompt_token_ids": p} for p in ids], greedy, use_tqdm=False)


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


def usage_problem(model: str) -> str | None:
    """What refuses a run before vLLM is imported: MODEL's path, or a bad VLLMHOTFIX_VERIFY_TOKENS,
    which the engine's workers would otherwise replace by its default without a word."""
    return session.model_path_problem(model) or settings.read_verify().problem


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


CHECKED_CACHES = "vllm-hotfix-verify"  # the directory, under vLLM's cache root, of checked runs' caches


def keyed_compile_cache() -> None:
    """vLLM's compile caches under `<vLLM's cache root>/vllm-hotfix-verify/<key>`, the key a digest of
    the package version and the check's code, set before vLLM reads it: vLLM's ahead-of-time artifact
    is not keyed on hooks, so in a shared directory a checked run could load a graph traced without
    the taps (every id `n/a`), or store one with them for engines without the check."""
    import hashlib

    from vllm_hotfix._version import __version__

    digest = hashlib.sha256(__version__.encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "vllm"
    )
    root = os.path.expanduser(root).rstrip(os.sep)
    if os.path.basename(os.path.dirname(root)) == CHECKED_CACHES:  # already a checked run's root
        root = os.path.dirname(os.path.dirname(root))
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(root, CHECKED_CACHES, digest.hexdigest()[:12])


def run(args: argparse.Namespace) -> int:
    return run_with(Run(args, session.keep_stdout(), Check()))


def run_with(runner: Run) -> int:
    """Every end, Ctrl-C too, goes through finish (the verdict, the engine stopped, the temporary
    directory removed)."""
    args = runner.args
    watchdog = threading.Timer(args.timeout, runner.expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        runner.main()
    except UsageError as error:
        _usage_exit(str(error), command=runner.job.command, stream=runner.stdout)
    except session.NoVllm as missing:  # one line (under --json the document, with it as reason)
        if args.json:
            runner.finish(str(missing))
        print(missing, file=runner.stdout, flush=True)
        return exit_codes.ERROR
    except KeyboardInterrupt:
        runner.finish(f"interrupted (Ctrl-C) while {runner.phase}")
    except Exception as error:  # CommandError says why; any other is the command's own failure
        if args.debug:
            traceback.print_exc()
        own = isinstance(error, CommandError)
        runner.finish(str(error) if own else f"the command failed while {runner.phase}: {one_line(error)}")
    finally:
        watchdog.cancel()  # reached only where finish did not exit (a stood-in os._exit)
    return exit_codes.ERROR  # not reached: finish exits


def _usage_exit(
    message: str, usage: str | None = None, command: str = "verify", stream: TextIO | None = None
) -> Any:
    """A usage error's line, and its document on the stdout the run kept (vLLM's log has fd 1)."""
    exit_usage(f"vllm-hotfix {command}", message, Parser.json_requested, usage, stream)


def add_parser(commands: Any) -> None:
    verify = commands.add_parser(
        "verify",
        allow_abbrev=False,  # a vLLM flag must never be taken for an abbreviation of one of ours
        help="a pre-flight: start vLLM on MODEL with your flags; say whether the aux states are right",
        usage="vllm-hotfix verify MODEL [options] [-- ENGINE ARGS (any `vllm serve` flag)]",
        description="Starts an engine of its own with your flags (compiled, CUDA graphs off), checks"
        " every forward of a bounded workload and prints the verdict per rank and per id. Exit codes:"
        " 0 PASS, 1 FAIL, 2 not everything checked, 3 the command or vLLM failed, 4 usage error."
        " Engine arguments (after `--`, or any flag this command does not know and that is not a"
        " near miss of one of its own) go to the installed vLLM's own parser: give it your server's"
        " flags.",
    )
    verify.error = lambda message: _usage_exit(message, verify.format_usage().strip())
    verify.add_argument("model", help="a checkpoint directory or a Hugging Face model id")
    verify.add_argument(
        "--ids",
        type=aux_ids,
        help="aux layer ids for extract_hidden_states, 0 to L (the model's layers), e.g. 2,30,58,61"
        " (default: the EAGLE3 convention 2,L//2,L-3 plus the final layer L); not with your own"
        " --speculative-config",
    )
    verify.add_argument(
        "--prompt-lengths",
        type=numbers("prompt lengths", 1),
        help="prompt lengths in tokens, e.g. 16,64,512,2048 (the default; those over max_model_len are"
        " left out and named)",
    )
    verify.add_argument(
        "--batch-sizes",
        type=numbers("batch sizes", 1),
        help="prompts per generate call, each length in each (default 1,4)",
    )
    session.add_options(
        verify,
        "where the engine's processes write their records (a directory per run id); on storage every"
        " node sees in multi-node runs (default: a new temporary directory, removed at the end)",
    )
    verify.set_defaults(run=run, engine_args=[])
