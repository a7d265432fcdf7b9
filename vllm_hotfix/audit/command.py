"""`vllm-hotfix audit DATA MODEL --ids IDS [--sample N | --all] [-- ENGINE ARGS]`.

The files are checked before vLLM is imported (files.py): a path, an id list or a sample size that
cannot work is a usage error (exit 4) at once; a file that cannot be audited is `n/a` with why.
Then the pre-flight check's own run (verify/command.py) starts an engine with the user's flags and
runs the files' tokens as its prompts, prefill only, without prefix caching or chunked prefill so
that each prompt is whole in one forward; the engine also computes the neighbours of the ids (an
id off by one shows as such). In its processes worker.py judges each file against the recomputed
states. The check must PASS, or the reference is unproven and no file is called ok or wrong.

Exit codes: 0 every audited file ok, 1 some file wrong, 2 not everything could be audited (a file
`n/a`, or the check not PASS), 3 the command or vLLM failed, 4 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_hotfix import exit_codes, own_engine
from vllm_hotfix.audit import files as files_mod
from vllm_hotfix.audit import precision
from vllm_hotfix.audit.worker import MANIFEST_VAR
from vllm_hotfix.cli_output import Parser, UsageError, aux_ids, exit_usage
from vllm_hotfix.verify import command as verify_command
from vllm_hotfix.verify import outcome as outcome_mod

SCHEMA = 1
DEFAULT_SAMPLE = 32
PROMPTS_PER_CALL = 64  # files' tokens the command holds at once: one generate call's prompts


@dataclass
class Chosen:
    """The files this run audits, and those it cannot, with why."""

    data: Path
    ids: list[int]
    audited: list[files_mod.DataFile] = field(default_factory=list)
    na: list[files_mod.DataFile] = field(default_factory=list)
    total: int = 0


def _vocab_size(model: str) -> int | None:
    """The checkpoint's vocabulary, where MODEL is a directory with a config.json."""
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    size = text.get("vocab_size") if isinstance(text, dict) else None
    return size if isinstance(size, int) else None


def choose(data: str, model: str, ids: list[int], sample: int | None, seed: int) -> Chosen:
    """Read the chosen files' headers and tokens; UsageError when nothing could be audited."""
    root = Path(data)
    if not root.is_dir():
        raise UsageError(f"DATA {data}: no such directory")
    problem = verify_command.usage_problem(model)
    if problem:
        raise UsageError(problem)
    paths = files_mod.discover(root)
    if not paths:
        raise UsageError(f"DATA {data}: no {files_mod.SUFFIX} files in it")
    chosen = Chosen(root, ids, total=len(paths))
    vocab = _vocab_size(model)
    for path in files_mod.choose(paths, sample, seed):
        found = files_mod.read_header(path)
        if found.na is None and found.ids != len(ids):
            found = files_mod.DataFile(
                path, na=f"holds {found.ids} ids per token, not the {len(ids)} of --ids {ids}"
            )
        if found.na is None and vocab is not None:
            beyond = [t for t in files_mod.token_ids(found) if not 0 <= t < vocab]
            if beyond:
                found = files_mod.DataFile(path, na=f"token ids {beyond[:3]} beyond the vocabulary ({vocab})")
        (chosen.audited if found.na is None else chosen.na).append(found)
    if not chosen.audited:
        reasons = sorted({str(f.na) for f in chosen.na})
        raise UsageError(f"no file of DATA {data} can be audited: {'; '.join(reasons[:3])}")
    return chosen


def engine_ids(ids: list[int], layers: int) -> list[int]:
    """The ids the engine computes: the files' and each one's neighbours within 1..layers, in the
    order the model returns them. Id 0 only where the files hold it: many models' forwards cannot
    capture it (no residual before layer 0), so it is never added as a neighbour."""
    wanted = {n for i in ids for n in (i - 1, i + 1) if 1 <= n <= layers}
    return sorted(wanted | set(ids))


class Audit(verify_command.Run):
    """The check's run, with the files' tokens as its workload and their judgement as its output."""

    def __init__(self, args: argparse.Namespace, stdout: Any, chosen: Chosen) -> None:
        super().__init__(args, stdout)
        self.chosen = chosen
        self.out = ""
        self.max_len: int | None = None
        self._rows: tuple[outcome_mod.Outcome, list[dict[str, Any]]] | None = None

    def before_vllm(self, plan: verify_command.Plan) -> None:
        self.out = os.path.join(plan.report_dir, plan.run_id, "audit")
        os.makedirs(self.out, exist_ok=True)
        manifest = {
            "ids": self.chosen.ids,
            "tolerance": getattr(self.args, "tolerance", None),
            "out": self.out,
            "files": [
                {"path": str(f.path), "tokens_key": files_mod.tokens_key(files_mod.token_ids(f))}
                for f in self.chosen.audited
            ],
        }
        path = os.path.join(plan.report_dir, plan.run_id, "audit-manifest.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(manifest, handle)
        os.environ[MANIFEST_VAR] = path

    def adjust_engine(self, engine: Any, config: Any) -> None:
        assert self.plan is not None
        if self.plan.ids is None:
            raise own_engine.CommandError(
                "the audit runs extract_hidden_states with --ids itself: leave --speculative-config out"
            )
        layers = int(config.hf_text_config.num_hidden_layers)
        computed = engine_ids(self.chosen.ids, layers)
        self.plan.ids = computed
        engine.speculative_config["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] = (
            computed
        )
        engine.enable_prefix_caching = False  # a cached prefix would leave a prompt's start out
        engine.enable_chunked_prefill = False  # each prompt whole in one forward

    def workload(self, vocab: int, max_len: int, sampling: Any) -> None:
        self.max_len = max_len
        prefill = sampling(max_tokens=1, temperature=0.0)
        runnable = [f for f in self.chosen.audited if f.tokens + 1 <= max_len]
        done = 0
        for start in range(0, len(runnable), PROMPTS_PER_CALL):
            batch = runnable[start : start + PROMPTS_PER_CALL]
            self.phase = f"auditing files {start + 1} to {start + len(batch)} of {len(runnable)}"
            prompts = [{"prompt_token_ids": files_mod.token_ids(f)} for f in batch]
            self.llm.generate(prompts, prefill, use_tqdm=False)
            done += len(batch)
            if sys.stderr.isatty() and not self.args.json:
                print(f"\rvllm-hotfix audit: {done} of {len(runnable)} files", end="", file=sys.stderr)
        if sys.stderr.isatty() and not self.args.json:
            print(file=sys.stderr)

    # -- the judgement -------------------------------------------------------------------------
    def results(self, judged: outcome_mod.Outcome) -> list[dict[str, Any]]:
        """Each file's row, read once per judgement (the document, the text and the exit code
        all need them, and a dataset's results are a file each)."""
        if self._rows is None or self._rows[0] is not judged:
            self._rows = (judged, self._read_results(judged))
        return self._rows[1]

    def _read_results(self, judged: outcome_mod.Outcome) -> list[dict[str, Any]]:
        proven = judged.verdict == outcome_mod.PASS
        rows = []
        for index, found in enumerate(self.chosen.audited):
            row: dict[str, Any] = {"file": str(found.path), "status": "n/a", "per_id": []}
            if self.max_len is not None and found.tokens + 1 > self.max_len:
                row["why"] = f"{found.tokens} tokens: longer than the engine's max_model_len {self.max_len}"
            else:
                try:
                    with open(os.path.join(self.out, f"{index}.json"), encoding="utf-8") as handle:
                        row.update(json.load(handle))
                except (OSError, ValueError):  # never recomputed: the run ended early, or no forward fit
                    row["why"] = "not recomputed: " + (
                        "the run ended before its prompt ran (see the verdict)"
                        if judged.error
                        else "no forward of the engine carried its tokens whole"
                    )
            if row["status"] != "n/a" and not proven:
                row["measured"], row["status"] = row["status"], "n/a"
                row["why"] = f"the reference is unproven: the pre-flight check says {judged.verdict}"
            rows.append(row)
        rows += [{"file": str(f.path), "status": "n/a", "why": f.na, "per_id": []} for f in self.chosen.na]
        return rows

    def verdict(self, judged: outcome_mod.Outcome, rows: list[dict[str, Any]]) -> tuple[str, int, str]:
        count = {s: sum(r["status"] == s for r in rows) for s in ("ok", "wrong", "n/a")}
        summary = f"{count['ok']} ok, {count['wrong']} wrong, {count['n/a']} n/a of {len(rows)} files audited"
        if judged.exit_code == exit_codes.ERROR:
            return outcome_mod.UNKNOWN, exit_codes.ERROR, f"{judged.reason}; {summary}"
        broken = [r for r in rows if r.get("error")]  # a recomputed state not finite
        if broken:
            return (
                outcome_mod.UNKNOWN,
                exit_codes.ERROR,
                f"{broken[0]['why']} ({broken[0]['file']}); {summary}",
            )
        if judged.verdict != outcome_mod.PASS:
            return outcome_mod.UNKNOWN, exit_codes.INCOMPLETE, f"the pre-flight check says {judged.verdict}"
        if count["wrong"]:
            return outcome_mod.FAIL, exit_codes.WRONG, summary
        if count["n/a"]:
            return outcome_mod.UNKNOWN, exit_codes.INCOMPLETE, summary
        return outcome_mod.PASS, exit_codes.OK, summary

    def document(self, judged: outcome_mod.Outcome, timed_out: bool) -> dict[str, Any]:
        rows = self.results(judged)
        verdict, code, reason = self.verdict(judged, rows)
        return {
            "schema": SCHEMA,
            "command": "audit",
            "verdict": verdict,
            "exit_code": code,
            "reason": reason,
            "data": str(self.chosen.data),
            "model": self.args.model,
            "ids": self.chosen.ids,
            "precision": precision.for_the_run(getattr(self.args, "tolerance", None)),
            "files_in_data": self.chosen.total,
            "check": super().document(judged, timed_out),
            "files": rows,
        }

    def text(self, judged: outcome_mod.Outcome) -> str:
        document = self.document(judged, False)
        lines = [f"pre-flight check: {judged.verdict} ({judged.reason})"]
        for row in document["files"]:
            if row["status"] == "wrong":
                bad = [e for e in row["per_id"] if e["status"] == "wrong"]
                said = "; ".join(
                    f"id {e['id']}: max rel diff {e['max_rel_diff']:.3g}"
                    + (f" ({e['cause']})" if e.get("cause") else "")
                    for e in bad
                )
                lines.append(f"wrong {row['file']}: {said}")
            elif row["status"] == "ok" and any(e.get("note") for e in row["per_id"]):
                said = "; ".join(f"id {e['id']}: {e['note']}" for e in row["per_id"] if e.get("note"))
                lines.append(f"ok    {row['file']}: {said}")
            elif row["status"] == "n/a":
                lines.append(f"n/a   {row['file']}: {row.get('why')}")
        lines.append(f"verdict: {document['verdict']} ({document['reason']}); exit {document['exit_code']}")
        return "\n".join(lines)

    def exit_code(self, judged: outcome_mod.Outcome) -> int:
        return self.verdict(judged, self.results(judged))[1]


def _sample(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of files >= 1")
    return int(text)


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def run(args: argparse.Namespace) -> int:
    sample = None if args.all else (args.sample or DEFAULT_SAMPLE)
    try:
        chosen = choose(args.data, args.model, args.ids, sample, args.seed)
    except UsageError as error:
        exit_usage("vllm-hotfix audit", str(error), Parser.json_requested)
    args.engine_args = list(args.engine_args)
    return verify_command.run_with(Audit(args, own_engine.keep_stdout(), chosen))


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
        " be audited, 3 the command or vLLM failed, 4 usage error.",
    )
    audit.add_argument(
        "data", help="the dataset's directory (its *.safetensors files, in subdirectories too)"
    )
    audit.add_argument("model", help="the checkpoint that made the data (a directory or a Hugging Face id)")
    audit.add_argument(
        "--ids",
        type=aux_ids,
        required=True,
        help="the aux layer ids the data was made with, in the files' order, e.g. 2,30,58,61",
    )
    which = audit.add_mutually_exclusive_group()
    which.add_argument(
        "--sample", type=_sample, help=f"audit this many files, chosen by --seed (default {DEFAULT_SAMPLE})"
    )
    which.add_argument("--all", action="store_true", help="audit every file")
    audit.add_argument("--seed", type=int, default=0, help="which files --sample picks (default 0)")
    audit.add_argument(
        "--tolerance",
        type=_tolerance,
        help="the largest per-token relative difference of a right state, for every file and id,"
        " no token over it allowed (default: the precision rule, by each file's dtype and the engine's)",
    )
    own_engine.add_options(audit, "where the engine's processes write their records and results")
    audit.set_defaults(run=run, engine_args=[], prompt_lengths=None, batch_sizes=None)
