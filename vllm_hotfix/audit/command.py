"""`vllm-hotfix audit DATA MODEL --ids IDS [--sample N | --all] [--max-tokens K] [--world-size W
--rank R] [-- ENGINE ARGS]`.

The files are checked before vLLM is imported (files.py): a path, an id list or a sample size that
cannot work is a usage error (exit 4) at once; a file that cannot be audited is `n/a` with why, a
file with fewer state rows than tokens `wrong`, and neither costs another file its judgement.
Then the pre-flight check's own run (verify/command.py) starts an engine with the user's flags and
runs the files' tokens (their first K with --max-tokens) as its prompts, prefill only, without
prefix caching or chunked prefill so that each prompt is whole in one forward; the engine also
computes the neighbours of the ids (an id off by one shows as such). In its processes worker.py
judges each file against the recomputed states. The check must PASS, or the reference is unproven
and no file is called ok or wrong on its states. The verdict and the estimate for the whole
dataset come from verdict.py, the rule merge.py applies to shards' documents too.

Exit codes: 0 every audited file ok, 1 some file wrong, 2 not everything could be audited (a file
`n/a`, or the check not PASS), 3 the command or vLLM failed, 4 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from vllm_hotfix import cli_output, exit_codes, own_engine, precision
from vllm_hotfix.audit import files as files_mod
from vllm_hotfix.audit import verdict as verdict_mod
from vllm_hotfix.audit.results import Results
from vllm_hotfix.audit.worker import MANIFEST_VAR
from vllm_hotfix.cli_output import Parser, UsageError, aux_ids, exit_usage, in_vllm_order
from vllm_hotfix.errors import one_line
from vllm_hotfix.verify import command as verify_command
from vllm_hotfix.verify import outcome as outcome_mod
from vllm_hotfix.verify import settings as verify_settings

SCHEMA = cli_output.SCHEMAS["audit"]  # 3: counts and per_id over the files; the files worth naming
DEFAULT_SAMPLE = 32
PROMPTS_PER_CALL = 64  # the most files' tokens the command holds at once: one generate call's prompts
T = TypeVar("T")


@dataclass
class Chosen:
    """The files this run audits, and those it cannot or need not, with why."""

    data: Path
    ids: list[int]  # in vLLM's order (ascending), the order of the files' columns
    audited: list[files_mod.DataFile] = field(default_factory=list)
    na: list[files_mod.DataFile] = field(default_factory=list)
    wrong: list[files_mod.DataFile] = field(default_factory=list)  # wrong as they stand
    total: int = 0  # files in DATA, each once
    ids_given: list[int] | None = None
    max_tokens: int | None = None
    sample: int | None = None
    seed: int = 0
    world_size: int = 1
    rank: int = 0
    in_shard: int = 0  # files of DATA in this rank's part
    links: int = 0  # links to a file already listed, left out
    digest: str = ""  # files.Listing.digest

    @property
    def ids_note(self) -> str | None:
        return None if self.ids_given is None else in_vllm_order(self.ids_given)[1]

    def judged_tokens(self, found: files_mod.DataFile) -> int:
        """The tokens of `found` the audit recomputes and judges: its first --max-tokens."""
        return found.tokens if self.max_tokens is None else min(found.tokens, self.max_tokens)

    def selection(self) -> dict[str, Any]:
        return {
            "sample": self.sample,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "world_size": self.world_size,
            "rank": self.rank,
            "files_in_data": self.total,
            "files_in_shard": self.in_shard,
            "links_counted_once": self.links,
        }


def _text_config(model: str) -> dict[str, Any]:
    """The checkpoint's text config, where MODEL is a directory with a config.json."""
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return {}
    text = config.get("text_config") or config if isinstance(config, dict) else None
    return text if isinstance(text, dict) else {}


def _size(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def unfit(found: files_mod.DataFile, ids: list[int], hidden: int | None) -> str | None:
    """Why a readable file cannot hold this model's states for these ids."""
    if found.ids != len(ids):
        return f"holds {found.ids} ids per token, not the {len(ids)} of --ids {ids}"
    if hidden is not None and found.hidden != hidden:
        return f"hidden size {found.hidden}, not the model's {hidden}"
    return None


def inside(path: str, directory: Path) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(directory)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def choose(args: argparse.Namespace) -> Chosen:
    """Read the chosen files' headers (their tokens are read once, when their batch runs);
    UsageError when nothing could be audited."""
    root = Path(args.data)
    if not root.is_dir():
        raise UsageError(f"DATA {args.data}: no such directory")
    problem = verify_command.usage_problem(args.model)
    if problem:
        raise UsageError(problem)
    if args.report_dir and inside(args.report_dir, root):
        raise UsageError(
            f"--report-dir {args.report_dir} is inside DATA {args.data}: the audit never writes there"
        )
    repeated = sorted({i for i in args.ids if args.ids.count(i) > 1})
    if repeated:
        raise UsageError(f"--ids lists {repeated} more than once")
    if not 0 <= args.rank < args.world_size:
        raise UsageError(
            f"--rank {args.rank}: must be 0 to {args.world_size - 1} for --world-size {args.world_size}"
        )
    try:
        files_mod.reader()
    except files_mod.ReaderMissing as error:
        raise UsageError(str(error)) from None
    found = files_mod.listing(root)
    if not found.files:
        raise UsageError(f"DATA {args.data}: no {files_mod.SUFFIX} files in it")
    ids, _ = in_vllm_order(args.ids)
    sample = None if args.all else (args.sample or DEFAULT_SAMPLE)
    chosen = Chosen(root, ids, total=len(found.files), links=found.links, digest=found.digest)
    chosen.ids_given, chosen.max_tokens, chosen.seed = list(args.ids), args.max_tokens, args.seed
    chosen.sample, chosen.world_size, chosen.rank = sample, args.world_size, args.rank
    names = [name for name, _ in found.files]
    chosen.in_shard = sum(files_mod.shard(name, args.world_size) == args.rank for name in names)
    paths = dict(found.files)
    hidden = _size(_text_config(args.model), "hidden_size")
    for name in files_mod.choose(names, sample, args.seed):
        if files_mod.shard(name, args.world_size) == args.rank:
            add(chosen, files_mod.read_header(paths[name], name), hidden)
    if not chosen.audited and not chosen.wrong and chosen.na and args.world_size == 1:
        reasons = sorted({str(f.na) for f in chosen.na})
        raise UsageError(f"no file of DATA {args.data} can be audited: {'; '.join(reasons[:3])}")
    return chosen


def add(chosen: Chosen, found: files_mod.DataFile, hidden: int | None) -> None:
    """File `found` into audited, n/a or wrong."""
    if found.na is None:
        why = unfit(found, chosen.ids, hidden)
        if why:
            found = dataclasses.replace(found, na=why, wrong=None)
    if found.na is not None:
        chosen.na.append(found)
    elif found.wrong is not None:
        chosen.wrong.append(found)
    else:
        chosen.audited.append(found)


def engine_ids(ids: list[int], layers: int) -> list[int]:
    """The ids the engine computes: the files' and each one's neighbours within 1..layers, in the
    order the model returns them. Id 0 only where the files hold it: many models' forwards cannot
    capture it (no residual before layer 0), so it is never added as a neighbour."""
    wanted = {n for i in ids for n in (i - 1, i + 1) if 1 <= n <= layers}
    return sorted(wanted | set(ids))


def batches(found: Sequence[T], tokens: Callable[[T], int], checked: int) -> Iterator[list[T]]:
    """The files in generate calls of at most PROMPTS_PER_CALL prompts and `checked` tokens (the
    tokens the pre-flight compares per forward): no forward of a call holds more, so every judged
    token is one the run's own check compared, except past the first `checked` of a longer file
    (alone in its call; worker.py counts those)."""
    batch: list[T] = []
    held = 0
    for one in found:
        if batch and (len(batch) == PROMPTS_PER_CALL or held + tokens(one) > checked):
            yield batch
            batch, held = [], 0
        batch.append(one)
        held += tokens(one)
    if batch:
        yield batch


class Audit:
    """The audit's job on the check's run (verify_command.Job): the files' tokens as its workload,
    their judgement as its output. Each generate call's results and the check's records are taken
    once the call returns (and removed), so neither memory nor the report directory grows with the
    number of files."""

    command = "audit"
    remove_records = True

    def __init__(self, args: argparse.Namespace, chosen: Chosen) -> None:
        self.args = args
        self.chosen = chosen
        self.out = ""
        self.results = Results(chosen.ids, bool(getattr(args, "list_every_file", False)))
        self.manifest = ""
        self._document: tuple[outcome_mod.Outcome | None, dict[str, Any]] | None = None

    def before_vllm(self, run: verify_command.Run) -> None:
        plan = run.plan
        assert plan is not None
        self.out = os.path.join(plan.report_dir, plan.run_id, "audit")
        os.makedirs(self.out, exist_ok=True)
        self.manifest = os.path.join(plan.report_dir, plan.run_id, "audit-manifest.json")

    def adjust_engine(self, run: verify_command.Run, engine: Any, config: Any) -> None:
        assert run.plan is not None
        if run.plan.ids is None:
            raise own_engine.CommandError(
                "the audit runs extract_hidden_states with --ids itself: leave --speculative-config out"
            )
        self._fit_hidden_size(int(getattr(config.hf_text_config, "hidden_size", 0) or 0) or None)
        layers = int(config.hf_text_config.num_hidden_layers)
        computed = engine_ids(self.chosen.ids, layers)
        run.plan.ids = computed
        engine.speculative_config["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] = (
            computed
        )
        engine.enable_prefix_caching = False  # a cached prefix would leave a prompt's start out
        engine.enable_chunked_prefill = False  # each prompt whole in one forward
        self._write_manifest([])
        os.environ[MANIFEST_VAR] = self.manifest

    def _fit_hidden_size(self, hidden: int | None) -> None:
        """Files of another hidden size than the engine's model: `n/a` before it starts (a
        checkpoint named by its Hugging Face id has no config.json to read earlier)."""
        kept = []
        for found in self.chosen.audited:
            why = unfit(found, self.chosen.ids, hidden)
            if why:
                self.chosen.na.append(dataclasses.replace(found, na=why))
            else:
                kept.append(found)
        self.chosen.audited = kept
        if not kept:
            raise own_engine.CommandError("no chosen file fits the model: " + str(self.chosen.na[0].na))

    def _write_manifest(self, entries: list[dict[str, Any]]) -> None:
        """The files of the next generate call, for the worker (worker.py reads it again when it
        changes); each file's states are judged at its stored dtype's precision too (compare.py)."""
        assert self.manifest, "before_vllm names the manifest's path"
        manifest = {
            "ids": self.chosen.ids,
            "tolerance": getattr(self.args, "tolerance", None),  # --tolerance replaces the rule
            "out": self.out,
            "files": entries,
        }
        with open(self.manifest + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(manifest, handle)
        os.replace(self.manifest + ".tmp", self.manifest)

    def row(self, index: int) -> dict[str, Any]:
        """What the command knows of audited file `index` before its result."""
        found = self.chosen.audited[index]
        row: dict[str, Any] = {"file": str(found.path), "status": "n/a", "per_id": []}
        judged = self.chosen.judged_tokens(found)
        return row | {"tokens": found.tokens, "judged_tokens": judged, "dtype": found.dtype}

    def workload(self, run: verify_command.Run, vocab: int, max_len: int, sampling: Any) -> None:
        prefill = sampling(max_tokens=1, temperature=0.0)
        chosen, runnable = self.chosen, []
        for index, found in enumerate(chosen.audited):
            if chosen.judged_tokens(found) + 1 <= max_len:
                runnable.append(index)
            else:
                why = f"{chosen.judged_tokens(found)} tokens: longer than the engine's max_model_len"
                why += f" {max_len}"
                self.results.add(self.row(index) | {"why": why}, index)

        def judged(index: int) -> int:
            return chosen.judged_tokens(chosen.audited[index])

        done = 0
        for batch in batches(runnable, judged, verify_settings.read().tokens):
            run.phase = f"auditing files {done + 1} to {done + len(batch)} of {len(runnable)}"
            prompts, entries = self._prompts(batch, vocab)
            self._write_manifest(entries)
            if prompts:
                run.llm.generate(prompts, prefill, use_tqdm=False)
            for entry in entries:
                self.results.take(self.out, entry["index"], self.row(entry["index"]))
            run.records().consume()  # the forwards of this call, every rank's record in
            done += len(batch)
            if sys.stderr.isatty() and not self.args.json:
                print(f"\rvllm-hotfix audit: {done} of {len(runnable)} files", end="", file=sys.stderr)
        if sys.stderr.isatty() and not self.args.json:
            print(file=sys.stderr)

    def _prompts(self, batch: list[int], vocab: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The batch's prompts and the manifest's entries, each file's tokens read here, once; a
        file whose tokens are unreadable or beyond the vocabulary is `n/a`, alone."""
        prompts, entries = [], []
        for index in batch:
            found = self.chosen.audited[index]
            judged = self.chosen.judged_tokens(found)
            try:
                prompt = files_mod.token_ids(found)[:judged]
            except Exception as error:  # the header was sound, the bytes are not
                why = f"unreadable token ids: {type(error).__name__}: {error}"
                self.results.add(self.row(index) | {"why": why}, index)
                continue
            beyond = [t for t in prompt if not 0 <= t < vocab]
            if beyond:
                why = f"token ids {beyond[:3]} beyond the vocabulary ({vocab})"
                self.results.add(self.row(index) | {"why": why}, index)
                continue
            key = files_mod.tokens_key(prompt)
            entries.append({"index": index, "path": str(found.path), "tokens_key": key, "rows": judged})
            prompts.append({"prompt_token_ids": prompt})
        return prompts, entries

    def collect(self) -> None:
        """Take the results the worker left that no batch took (a run cut short mid-call)."""
        names = os.listdir(self.out) if self.out and os.path.isdir(self.out) else []
        left = (name.removesuffix(".json") for name in names if name.endswith(".json"))
        for index in sorted(int(stem) for stem in left if stem.isdigit()):
            if index not in self.results.taken and index < len(self.chosen.audited):
                self.results.take(self.out, index, self.row(index))

    # -- the judgement -------------------------------------------------------------------------
    def judgement(
        self, judged: outcome_mod.Outcome | None
    ) -> tuple[dict[str, int], list[dict[str, Any]], list[str]]:
        """(counts, the rows to name, notes) of every chosen file: the results taken, those the run
        never reached, the files wrong as they stand and n/a before the engine. Where the pre-flight
        check did not PASS the reference is unproven: no file is ok or wrong on its states."""
        proven = judged is not None and judged.verdict == outcome_mod.PASS
        counts, rows, notes = dict(self.results.counts), [], []
        every = self.results.list_every_file
        if not proven and judged is not None:
            why = f"the reference is unproven: the pre-flight check says {judged.verdict}"
            for row in self.results.rows:
                if row["status"] != "n/a":
                    row = row | {"measured": row["status"], "status": "n/a", "why": why}
                rows.append(row)
            unproven = counts["ok"] + counts["wrong"]
            counts = {"ok": 0, "wrong": 0, "n/a": counts["n/a"] + unproven}
            if unproven:
                notes.append(f"{unproven} files judged against the recomputed states are n/a: {why}")
        else:
            rows = list(self.results.rows)
        unreached = [i for i in range(len(self.chosen.audited)) if i not in self.results.taken]
        if unreached:
            ended = judged is None or judged.error
            why = "not recomputed: " + (
                "the run ended before its prompt ran (see the verdict)"
                if ended
                else "no forward of the engine carried its tokens whole"
            )
            counts["n/a"] += len(unreached)
            if every or not ended:
                rows += [self.row(index) | {"why": why} for index in unreached]
            else:
                notes.append(f"{len(unreached)} files n/a, {why}")
        rows += [
            {"file": str(f.path), "status": "wrong", "why": f.wrong, "tokens": f.tokens, "rows": f.rows}
            | {"per_id": []}
            for f in self.chosen.wrong
        ]
        rows += [{"file": str(f.path), "status": "n/a", "why": f.na, "per_id": []} for f in self.chosen.na]
        counts["wrong"] += len(self.chosen.wrong)
        counts["n/a"] += len(self.chosen.na)
        return counts, rows, notes

    def verdict(
        self, judged: outcome_mod.Outcome | None, counts: dict[str, int], rows: list[dict[str, Any]]
    ) -> tuple[str, int, str]:
        """(verdict, exit code, reason) of the counts, the rows named and the check's verdict."""
        if judged is None:
            return verdict_mod.verdict(counts, rows, None)
        error = judged.reason if judged.exit_code == exit_codes.ERROR else None
        return verdict_mod.verdict(counts, rows, judged.verdict, error)

    def document(
        self, run: verify_command.Run | None, judged: outcome_mod.Outcome | None, timed_out: bool
    ) -> dict[str, Any]:
        """The document, built once per judgement; a failure to build it is exit 3 with a
        document still (never a traceback, never exit 1). No run: no engine was needed."""
        if self._document is None or self._document[0] is not judged:
            try:
                built = self._build(run, judged, timed_out)
            except Exception as error:
                if getattr(self.args, "debug", False):
                    traceback.print_exc()
                built = failure(self.args, f"the audit failed while judging: {one_line(error)}")
            self._document = (judged, built)
        return self._document[1]

    def _build(
        self, run: verify_command.Run | None, judged: outcome_mod.Outcome | None, timed_out: bool
    ) -> dict[str, Any]:
        self.collect()
        counts, rows, notes = self.judgement(judged)
        verdict, code, reason = self.verdict(judged, counts, rows)
        chosen = self.chosen
        in_sample = sum(counts.values())
        shard_sample = None if chosen.sample is None or chosen.sample >= chosen.total else in_sample
        per_id = self.results.per_id_summary()
        said = [note for note in (chosen.ids_note, self._coverage_note()) if note]
        notes = said + notes + moe_notes(per_id)
        return cli_output.document(
            "audit",
            code,
            reason,
            verdict=verdict,
            data=str(chosen.data),
            dataset={"files": chosen.total, "listing_sha256": chosen.digest},
            model=self.args.model,
            ids=chosen.ids,
            ids_given=chosen.ids_given,
            precision=precision.for_the_run(getattr(self.args, "tolerance", None)),
            notes=notes,
            files_in_data=chosen.total,
            selection=chosen.selection(),
            estimate=verdict_mod.estimate(counts, chosen.in_shard, shard_sample, chosen.seed),
            check=None
            if run is None or judged is None
            else verify_command.check_document(run, judged, timed_out),
            counts=counts,
            per_id=per_id,
            files_listed="every file" if self.results.list_every_file else "wrong and n/a",
            files=rows,
        )

    def _coverage_note(self) -> str | None:
        """How many judged tokens the run's own pre-flight did not check (worker.py counts them)."""
        short = self.results.not_preflighted
        if not short["files"]:
            return None
        return (
            f"{short['tokens']} judged tokens of {short['files']} files lie beyond the first"
            f" {verify_settings.read().tokens} tokens of their forward, which the pre-flight check"
            f" compares ({verify_settings.TOKENS_VAR}); see each file's not_preflighted_tokens"
            " (--list-every-file lists the ok ones too)"
        )

    def text(self, run: verify_command.Run | None, judged: outcome_mod.Outcome | None) -> str:
        document = self.document(run, judged, False)
        lines = [] if judged is None else [f"pre-flight check: {judged.verdict} ({judged.reason})"]
        lines += text_lines(document)
        return "\n".join(lines)

    def exit_code(self, run: verify_command.Run | None, judged: outcome_mod.Outcome | None) -> int:
        code: int = self.document(run, judged, False)["exit_code"]
        return code


def moe_notes(per_id: list[dict[str, Any]]) -> list[str]:
    """Per id, the ok files with tokens over the tolerance, within a MoE model's allowance."""
    return [
        f"id {e['id']}: {e['files_with_tokens_over']} ok files have tokens over the tolerance (at"
        f" most {e['most_tokens_over']['tokens']} of {e['most_tokens_over']['of']}), within what a"
        " MoE model's routing may move (precision.py)"
        for e in per_id
        if e["files_with_tokens_over"]
    ]


def text_lines(document: dict[str, Any]) -> list[str]:
    """A document's files, notes, estimate and verdict as text (a run's, or merged shards')."""
    lines = []
    for row in document.get("files") or []:
        if row["status"] == "wrong":
            bad = [e for e in row["per_id"] if e["status"] == "wrong"]
            said = "; ".join(
                f"id {e['id']}: max rel diff {e['max_rel_diff']:.3g}"
                + (f" ({e['cause']})" if e.get("cause") else "")
                for e in bad
            )
            lines.append(f"wrong {row['file']}: {said or row.get('why')}")
        elif row["status"] == "ok" and any(e.get("note") for e in row.get("per_id") or []):
            said = "; ".join(f"id {e['id']}: {e['note']}" for e in row["per_id"] if e.get("note"))
            lines.append(f"ok    {row['file']}: {said}")
        elif row["status"] == "n/a":
            lines.append(f"n/a   {row['file']}: {row.get('why')}")
    lines += [f"note: {note}" for note in document.get("notes") or []]
    if document.get("estimate"):
        lines.append(verdict_mod.estimate_line(document["estimate"]))
    lines.append(f"verdict: {document['verdict']} ({document['reason']}); exit {document['exit_code']}")
    return lines


def failure(args: argparse.Namespace, reason: str, command: str = "audit") -> dict[str, Any]:
    """The document of a run that failed in the command itself: exit 3."""
    data, model = getattr(args, "data", None), getattr(args, "model", None)
    return cli_output.document(command, exit_codes.ERROR, reason, data=data, model=model, files=[])


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
        own_engine.need_vllm("audit")
    except own_engine.NoVllm as missing:
        print(json.dumps(failure(args, str(missing)), indent=2) if args.json else missing, flush=True)
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
            print(json.dumps(failure(args, reason), indent=2), flush=True)
        return exit_codes.ERROR
    if not chosen.audited:
        return _without_engine(args, chosen)
    args.engine_args = list(args.engine_args)
    args.ids = chosen.ids  # the check's run works in vLLM's order too; the audit's note says it
    return verify_command.run_with(verify_command.Run(args, own_engine.keep_stdout(), Audit(args, chosen)))


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
    own_engine.add_options(
        audit, "where the engine's processes write their records and results (not in DATA)"
    )
    audit.set_defaults(run=run, engine_args=[], prompt_lengths=None, batch_sizes=None)
