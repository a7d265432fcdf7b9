"""`vllm-hotfix audit DATA MODEL --ids IDS [--sample N | --all] [--max-tokens K] [--world-size W
--rank R] [-- ENGINE ARGS]`: the files chosen and read before vLLM (selection.py), then the
pre-flight check's run (commands/verify.py) with the audit's job on it (job.py); the verdict and the
estimate for the whole dataset from verdict.py, the rule merge.py applies to shards' documents too.

Exit codes: 0 every audited file ok, 1 some file wrong, 2 not everything could be audited (a file
`n/a`, or the check not PASS), 3 the command or vLLM failed, 4 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

from vllm_hotfix.audit import verdict as verdict_mod
from vllm_hotfix.audit.selection import DEFAULT_SAMPLE, Chosen, choose
from vllm_hotfix.commands import session
from vllm_hotfix.commands import verify as verify_command
from vllm_hotfix.commands.audit_job import Audit
from vllm_hotfix.commands.output import Parser, UsageError, aux_ids, exit_usage
from vllm_hotfix.judging import exit_codes
from vllm_hotfix.runtime.errors import one_line


def _sample(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of files >= 1")
    return int(text)


def _count(what: str, least: int) -> Any:
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {what} >= {least}")
        return int(text)

    return parse


def _without_engine(args: argparse.Namespace, chosen: Chosen) -> int:
    """Every chosen file is wrong as it stands, n/a, or none is in this shard: no engine needed."""
    audit = Audit(args, chosen)
    document = audit.document(None, None, False)
    print(json.dumps(document, indent=2) if args.json else audit.text(None, None), flush=True)
    code: int = document["exit_code"]
    return code


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def run(args: argparse.Namespace) -> int:
    try:  # before DATA is read: its reader comes with vLLM, and no file is worth a line without it
        session.need_vllm("audit")
    except session.NoVllm as missing:
        print(
            json.dumps(verdict_mod.failure(args, str(missing)), indent=2) if args.json else missing,
            flush=True,
        )
        return exit_codes.ERROR
    try:
        chosen = choose(args)
    except UsageError as error:
        exit_usage("vllm-hotfix audit", str(error), Parser.json_requested)
    except Exception as error:  # the command's own failure: exit 3, with a document under --json
        if args.debug:
            traceback.print_exc()
        reason = f"the audit failed while reading DATA: {one_line(error)}"
        print(f"vllm-hotfix audit: {reason}", file=sys.stderr)
        if args.json:
            print(json.dumps(verdict_mod.failure(args, reason), indent=2), flush=True)
        return exit_codes.ERROR
    if not chosen.audited:
        return _without_engine(args, chosen)
    args.engine_args = list(args.engine_args)
    args.ids = chosen.ids  # the check's run works in vLLM's order too; the audit's note says it
    return verify_command.run_with(verify_command.Run(args, session.keep_stdout(), Audit(args, chosen)))


def add_parser(commands: Any) -> None:
    audit = commands.add_parser(
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
    audit.add_argument(
        "data", help="the dataset's directory (its *.safetensors files, in subdirectories too)"
    )
    audit.add_argument("model", help="the checkpoint that made the data (a directory or a Hugging Face id)")
    audit.add_argument(
        "--ids",
        type=aux_ids,
        required=True,
        help="the aux layer ids the data was made with, in any order (vLLM stores them in ascending"
        " order, and the audit reads the files so), e.g. 2,30,58,61",
    )
    which = audit.add_mutually_exclusive_group()
    which.add_argument(
        "--sample",
        type=_sample,
        metavar="N",
        help=f"audit this many files, chosen at random by --seed, and bound the wrong fraction of the"
        f" whole dataset at 95%% confidence (default {DEFAULT_SAMPLE})",
    )
    which.add_argument("--all", action="store_true", help="audit every file")
    audit.add_argument("--seed", type=int, default=0, help="which files --sample picks (default 0)")
    audit.add_argument(
        "--max-tokens",
        type=_count("tokens", 1),
        metavar="K",
        help="judge the first K tokens of each file only (a K-token prefill each; default: every token)",
    )
    audit.add_argument(
        "--world-size",
        type=_count("shards", 1),
        metavar="W",
        default=1,
        help="split the chosen files into this many shards by a hash of their path (default 1)",
    )
    audit.add_argument(
        "--rank",
        type=_count("ranks", 0),
        default=0,
        metavar="R",
        help="the shard this run audits, 0 to W-1 (default 0)",
    )
    audit.add_argument(
        "--list-every-file",
        action="store_true",
        help="name every audited file in the output, ok ones too (default: the wrong and n/a ones;"
        " ok files are counted, so that the output does not grow with the dataset)",
    )
    audit.add_argument(
        "--tolerance",
        type=_tolerance,
        help="the largest per-token relative difference of a right state, for every file and id,"
        " no token over it allowed (default: the precision rule, by each file's dtype and the engine's)",
    )
    session.add_options(audit, "where the engine's processes write their records and results (not in DATA)")
    audit.set_defaults(run=run, engine_args=[], prompt_lengths=None, batch_sizes=None)
