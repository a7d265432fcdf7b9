"""The command line of every `vllm-hotfix` command, read in one place: the parser of each command,
their argument types, and how a mistake is reported (a usage error: one line on stderr, under
`--json` also a document on stdout, exit verdicts.USAGE, before any slow work).

`verify` and `audit` pass what they do not know, and all after `--`, to vLLM's own engine parser;
an unknown option that is a near miss of one of theirs, or a positional given as an option
(`--model`), is a usage error here, before vLLM is imported.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from vllm_hotfix.commands.output import exit_usage, print_document
from vllm_hotfix.judging import verdicts

DESCRIPTION = """\
Run-time repairs of vLLM's aux hidden states: what they decide for the vLLM here (status), a
pre-flight check of a model's aux states (verify), an audit of a dataset of aux states already made
(audit), the site hook's install and removal, and the cleaning of generated sources.

Exit codes, the same for every command: 0 ok, 1 wrong, 2 not everything could be checked or
decided, 3 the command or vLLM failed, 4 usage error."""

JSON_HELP = "print one JSON document on stdout, nothing else"
# The site hook is a .pth file, not a sitecustomize module: the commands' old names still run, unlisted.
OLD_NAMES = {"install-sitecustomize": "install-site-hook", "uninstall-sitecustomize": "uninstall-site-hook"}
DEFAULT_TIMEOUT = 3600.0  # s: a tiny model takes 1-2 min on CPU; a large one's load and cold compile tens
DEFAULT_SAMPLE = 32  # files an audit judges unless --all or --sample says otherwise
NEAR = 0.8  # difflib's similarity at which an unknown option is taken for a typo of one of ours
# vLLM engine flags as near as that to an option of ours: they go to vLLM (tests/test_cli_options.py
# checks this list against the parsers of the test environment's vLLM releases)
ENGINE_FLAGS_NEAR_OURS = frozenset({"--ubatch-size"})


# -- argument types: a bad value is a usage error that says what is wanted --------------------------
def whole(what: str, least: int) -> Callable[[str], int]:
    """A whole number of `what` >= least."""

    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {what} >= {least}")
        return int(text)

    return parse


def real(what: str, above: float | None = None, least: float | None = None) -> Callable[[str], float]:
    """A finite number `what` (e.g. "of days"), > above or >= least."""
    bound = f"> {above:g}" if above is not None else f">= {least:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        low_ok = value > above if above is not None else value >= (least or 0.0)
        if not (low_ok and value < float("inf")):  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text!r} is not a number{what} {bound}")
        return value

    return parse


def numbers(what: str, least: int) -> Callable[[str], list[int]]:
    """A comma-separated list of whole numbers >= least."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be whole numbers, e.g. 1,4") from None
        if not values or min(values) < least:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be >= {least}")
        return values

    return parse


def aux_ids(text: str) -> list[int]:
    """Aux layer ids, each once (vLLM captures by membership: a repeated id is one state, so the
    files would hold fewer ids than the list names)."""
    ids = numbers("aux layer ids", 0)(text)
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r}: aux layer ids {repeated} repeated; name each once")
    return ids


days = real(" of days", least=0)
seconds = real(" of seconds", above=0)
tolerance = real("", above=0)


# -- the parser -------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse with the package's usage errors: verdicts.USAGE, not argparse's 2 (which would read
    as a verdict), and a JSON document when `--json` was asked for (`as_json`, given to every
    command's parser). A near miss of one of the command's own options, or a positional given as
    an option, is a usage error before argparse's own errors."""

    def __init__(self, *args: Any, as_json: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.as_json = as_json

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        exit_usage(self.prog, message, self.as_json, self.format_usage().strip())

    def parse_known_args(  # type: ignore[override]  # typeshed's overloads; same behaviour
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._subparsers is None and args is not None:  # a command's parser
            problem = self.not_ours(list(args))
            if problem is not None:
                self.error(problem)
        return super().parse_known_args(args, namespace)

    def not_ours(self, words: list[str]) -> str | None:
        """The usage error for an option word that is not one of ours but means one, None when none
        does: a positional given as an option (`--model`), or a near miss of one of our long
        options. Others (vLLM's engine flags) are left alone."""
        own = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        positionals = [action for action in self._actions if not action.option_strings]
        named = {f"--{action.dest}": action for action in positionals}
        for given in words:
            if given == "--":  # what follows is not an option of ours
                break
            word = given.split("=", 1)[0]
            if not word.startswith("--") or word in own:
                continue
            if self.allow_abbrev and any(option.startswith(word) for option in own):
                continue  # argparse takes it for ours (or says it is ambiguous)
            if word in named:
                form = " ".join(str(a.metavar or a.dest.upper()) for a in positionals)
                return (
                    f"{word}: {named[word].metavar or named[word].dest.upper()} is positional, not an"
                    f" option: {self.prog} {form} [options]"
                )
            if word.replace("_", "-") in ENGINE_FLAGS_NEAR_OURS:
                continue
            meant = closest(word.replace("_", "-"), own, NEAR)
            if meant is not None:
                return f"unrecognized argument {word}: did you mean {meant}?"
        return None


def closest(word: str, choices: Sequence[str], cutoff: float) -> str | None:
    """The package's one fuzzy match (difflib): of the choices at least `cutoff` similar to `word`,
    the most similar; of those as similar, one the word begins (`--js`: --json, not --ids)."""
    near = difflib.get_close_matches(word, choices, n=len(choices) or 1, cutoff=cutoff)
    if not near:
        return None
    score = {choice: difflib.SequenceMatcher(None, word, choice).ratio() for choice in near}
    return min(near, key=lambda choice: (-score[choice], not choice.startswith(word)))


class _Version(argparse.Action):
    """`-V`: the version (and, run from a checkout, its commit), as a document under --json."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from vllm_hotfix._version import __version__, checkout, describe

        line = f"vllm-hotfix {describe()}"
        if getattr(parser, "as_json", False):
            print_document("version", verdicts.OK, line, version=__version__, checkout=checkout())
        else:
            print(line, flush=True)
        parser.exit(verdicts.OK)


def _engine_options(parser: argparse.ArgumentParser, report_dir_help: str) -> None:
    """The options of every command that starts an engine of its own."""
    parser.add_argument("--json", action="store_true", help=JSON_HELP)
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=DEFAULT_TIMEOUT,
        help="seconds for the whole run; then exit 3, the engine shut down (default %(default)g)",
    )
    parser.add_argument("--debug", action="store_true", help="print tracebacks of errors")
    parser.add_argument("--report-dir", help=report_dir_help)


def build_parser(as_json: bool = False) -> argparse.ArgumentParser:
    """Every command's parser; `as_json`: usage errors print a JSON document too."""
    from vllm_hotfix.commands import audit, audit_merge, clean, site_hooks, status, verify
    from vllm_hotfix.runtime.decisions import PROBLEMS, Decision

    problems = " or ".join(f"'{decision.value}'" for decision in Decision if decision in PROBLEMS)
    parser = Parser(
        prog="vllm-hotfix",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        as_json=as_json,
    )
    parser.add_argument("-V", "--version", action=_Version, nargs=0, help="print the version and exit")
    parser.add_argument("--json", action="store_true", help=f"{JSON_HELP} (the same as after COMMAND)")
    commands = parser.add_subparsers(  # type: ignore[call-overload]  # a partial of a parser class
        dest="command",
        required=True,
        metavar="COMMAND",
        title="commands",
        parser_class=functools.partial(Parser, as_json=as_json),  # every command's parser knows --json
    )

    status_cmd = commands.add_parser(
        "status",
        help="say, per fix, what the hotfix decides for the vLLM of this environment",
        description="Imports vLLM's target modules (as vLLM would) and reports each fix's decision,"
        " the Python and vLLM it looked at, and the cache directory for generated sources."
        f" Exits 2 when a fix is {problems} or this Python has no vLLM (one line then), 3 when vLLM"
        " cannot be imported, 4 when a setting (VLLMHOTFIX_*) is invalid.",
    )
    status_cmd.add_argument("--json", action="store_true", help=JSON_HELP)
    status_cmd.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="do not import vLLM; report only what this process knows",
    )
    status_cmd.set_defaults(run=status.run)

    clean_cmd = commands.add_parser(
        "clean",
        help="remove generated sources that no process has used for a while",
        description="Removes this user's generated sources (the fixed functions' files, one per vLLM"
        " install, fix and hotfix version) that no process has written or reused for DAYS days,"
        " except those this process uses; only regular files named as generated sources, in the"
        " package's own directories, never through a link. Run it with the VLLMHOTFIX_CACHE_DIR,"
        " XDG_CACHE_HOME and TMPDIR your vLLM processes see. Exits 2 when a place could not be"
        " checked or a file could not be removed.",
    )
    age = clean_cmd.add_mutually_exclusive_group()  # --all ignores an age: both are a usage error
    age.add_argument(
        "--days",
        type=days,
        default=clean.DEFAULT_DAYS,
        help=f"remove files not used for this many days (default {clean.DEFAULT_DAYS:g})",
    )
    age.add_argument("--all", action="store_true", help="remove them whatever their age")
    clean_cmd.add_argument(
        "--dry-run", action="store_true", help="list what would be removed; remove nothing"
    )
    clean_cmd.add_argument("--json", action="store_true", help=JSON_HELP)
    clean_cmd.set_defaults(run=clean.run)

    checked = commands.add_parser(
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
    checked.add_argument("model", help="a checkpoint directory or a Hugging Face model id")
    checked.add_argument(
        "--ids",
        type=aux_ids,
        help="aux layer ids for extract_hidden_states, 0 to L (the model's layers), e.g. 2,30,58,61"
        " (default: the EAGLE3 convention 2,L//2,L-3 plus the final layer L); not with your own"
        " --speculative-config",
    )
    checked.add_argument(
        "--prompt-lengths",
        type=numbers("prompt lengths", 1),
        help="prompt lengths in tokens, e.g. 16,64,512,2048 (the default; those over max_model_len are"
        " left out and named)",
    )
    checked.add_argument(
        "--batch-sizes",
        type=numbers("batch sizes", 1),
        help="prompts per generate call, each length in each (default 1,4)",
    )
    _engine_options(
        checked,
        "where the engine's processes write their records (a directory per run id); on storage every"
        " node sees in multi-node runs (default: a new temporary directory, removed at the end)",
    )
    checked.set_defaults(run=verify.run, engine_args=[])

    audited = commands.add_parser(
        "audit",
        allow_abbrev=False,
        help="say which files of a dataset of aux states (extract_hidden_states, speculators) are wrong",
        usage="vllm-hotfix audit DATA MODEL --ids IDS [options] [-- ENGINE ARGS (any `vllm serve` flag)]",
        description="Recomputes the aux states of the files in DATA (safetensors with hidden_states"
        " [tokens, ids, hidden] and token_ids [tokens]) on an engine started with your flags, with"
        " the pre-flight check on, and says per file and per id whether the stored states are right."
        " MODEL and --ids must be the model and the aux layer ids that made the data: the audit"
        " cannot tell a dataset made with other ids or another model from a wrong one. Never writes"
        " into DATA. Exit codes: 0 every audited file ok, 1 some file wrong, 2 not everything could"
        " be audited, 3 the command or vLLM failed, 4 usage error. Shards' documents:"
        " `vllm-hotfix audit-merge`.",
    )
    audited.add_argument(
        "data", help="the dataset's directory (its *.safetensors files, in subdirectories too)"
    )
    audited.add_argument("model", help="the checkpoint that made the data (a directory or a Hugging Face id)")
    audited.add_argument(
        "--ids",
        type=aux_ids,
        required=True,
        help="the aux layer ids the data was made with, in any order (vLLM stores them in ascending"
        " order, and the audit reads the files so), e.g. 2,30,58,61",
    )
    which = audited.add_mutually_exclusive_group()
    which.add_argument(
        "--sample",
        type=whole("files", 1),
        metavar="N",
        help=f"audit this many files, chosen at random by --seed, and bound the wrong fraction of the"
        f" whole dataset at 95%% confidence (default {DEFAULT_SAMPLE})",
    )
    which.add_argument("--all", action="store_true", help="audit every file")
    audited.add_argument("--seed", type=int, default=0, help="which files --sample picks (default 0)")
    audited.add_argument(
        "--max-tokens",
        type=whole("tokens", 1),
        metavar="K",
        help="judge the first K tokens of each file only (a K-token prefill each; default: every token)",
    )
    audited.add_argument(
        "--world-size",
        type=whole("shards", 1),
        metavar="W",
        default=1,
        help="split the chosen files into this many shards by a hash of their path (default 1)",
    )
    audited.add_argument(
        "--rank",
        type=whole("ranks", 0),
        default=0,
        metavar="R",
        help="the shard this run audits, 0 to W-1 (default 0)",
    )
    audited.add_argument(
        "--list-every-file",
        action="store_true",
        help="name every audited file in the output, ok ones too (default: the wrong and n/a ones;"
        " ok files are counted, so that the output does not grow with the dataset)",
    )
    audited.add_argument(
        "--tolerance",
        type=tolerance,
        help="the largest per-token relative difference of a right state, for every file and id,"
        " no token over it allowed (default: the precision rule, by each file's dtype and the engine's)",
    )
    _engine_options(audited, "where the engine's processes write their records and results (not in DATA)")
    audited.set_defaults(run=audit.run, engine_args=[])

    merged = commands.add_parser(
        "audit-merge",
        help="combine the --json documents of an audit's shards (--world-size, --rank) into one verdict",
        description="Reads the --json documents of one audit's shards, refuses documents of different"
        " datasets, models, ids or selections, and prints one verdict and one estimate for the"
        " dataset. Exit codes as the audit's: 0 ok, 1 a file wrong, 2 not everything audited (a rank"
        " missing), 3 a shard failed, 4 usage error.",
    )
    merged.add_argument("reports", nargs="+", metavar="REPORT", help="a shard's --json document")
    merged.add_argument("--json", action="store_true", help=JSON_HELP)
    merged.set_defaults(run=audit_merge.run)

    old_names = {new: old for old, new in OLD_NAMES.items()}
    for name, run, verb in (
        ("install-site-hook", site_hooks.install, "write"),
        ("uninstall-site-hook", site_hooks.uninstall, "remove"),
    ):
        what = f"{verb} the site hook (a .pth file) that arms vllm-hotfix in every Python process"
        listed = commands.add_parser(name, description=what, help=what)
        # the old name gets no `help`: argparse then leaves it out of the list of commands
        for sub in (listed, commands.add_parser(old_names[name], description=what)):
            sub.add_argument("--site-dir", help="site-packages directory (default: the active environment's)")
            sub.add_argument("--json", action="store_true", help=JSON_HELP)
            sub.set_defaults(run=run)
    return parser


def _choices(parser: argparse.ArgumentParser) -> list[str]:
    """Every command name, old names included."""
    found = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return list(found[0].choices)


def _unknown_command(parser: argparse.ArgumentParser, word: str | None) -> str | None:
    """The usage error for a word that is not a command: "did you mean" the closest of ours, else
    the list of commands (old names left out, as in the help); None for a command."""
    if word is None or word in _choices(parser):
        return None
    listed = [name for name in _choices(parser) if name not in OLD_NAMES]
    close = closest(word, listed, 0.6)
    if close:
        return f"argument COMMAND: invalid choice: '{word}': did you mean '{close}'?"
    return f"argument COMMAND: invalid choice: '{word}' (choose from {', '.join(listed)})"


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line read; `verify` and `audit` pass what they do not know, and all after `--`,
    to vLLM's own engine parser. `--json` before the command is taken as given after it."""
    head, tail = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    at = next((n for n, arg in enumerate(head) if not arg.startswith("-")), len(head))
    if "--json" in head[:at]:  # `vllm-hotfix --json status`: the command's own --json
        head = [arg for arg in head[:at] if arg != "--json"] + head[at : at + 1] + ["--json"] + head[at + 1 :]
    command = next((arg for arg in head if not arg.startswith("-")), None)
    parser = build_parser(as_json="--json" in head)
    unknown = _unknown_command(parser, command)
    if unknown is not None:
        parser.error(unknown)
    args, extra = parser.parse_known_args(head)
    if getattr(args, "engine_args", None) is None:  # only verify and audit take engine arguments
        if extra or tail:
            parser.error(f"unrecognized arguments: {' '.join(extra + tail)}")
    else:
        args.engine_args = extra + tail
    args.command = OLD_NAMES.get(args.command, args.command)
    return args
