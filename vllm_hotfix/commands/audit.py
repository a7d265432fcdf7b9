"""`vllm-hotfix audit DATA MODEL --ids IDS [--sample N | --all] [--max-tokens K] [--world-size W
--rank R] [-- ENGINE ARGS]`: the files chosen and their headers read before vLLM (audit/selection.py),
then an engine session (session.py) with the pre-flight check on, which computes the files' ids
and each one's neighbours (an id off by one shows as such). The files' tokens (their first K with
--max-tokens) are its prompts, prefill only, without prefix caching or chunked prefill so that each
prompt is whole in one forward, in generate calls no larger than what the check compares. In the
engine's processes audit/worker.py (named to the check by settings.WORKER_VAR) judges each file
against the recomputed states; after each call its results and the check's records are taken and
removed. The check must PASS, or the reference is unproven and no file is called ok or wrong on
its states. The verdict and the estimate for the whole dataset: audit/verdict.py, the rule
audit-merge applies to shards' documents too.

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
from typing import Any, TypeVar

from vllm_hotfix.audit import files as files_mod
from vllm_hotfix.audit import selection, worker
from vllm_hotfix.audit import verdict as verdict_mod
from vllm_hotfix.audit.results import Results
from vllm_hotfix.audit.selection import Chosen, unfit
from vllm_hotfix.audit.verdict import files_
from vllm_hotfix.check import outcome as outcome_mod
from vllm_hotfix.commands import output, session
from vllm_hotfix.commands import verify as verify_command
from vllm_hotfix.judging import precision, verdicts
from vllm_hotfix.judging.verdicts import PASS, UsageError
from vllm_hotfix.runtime import settings
from vllm_hotfix.runtime.errors import one_line

PROMPTS_PER_CALL = 64  # the most files' tokens the command holds at once: one generate call's prompts
T = TypeVar("T")


def run(args: argparse.Namespace) -> int:
    """The audit, start to end: usage (exit 4), vLLM's presence (exit 3), the files chosen; then,
    where a file needs recomputing, the session, whose end prints the verdict and exits."""
    flags = list(args.engine_args)
    problem = selection.usage_problem(args) or session.usage_problem(args.model, flags)
    if problem:
        raise UsageError(problem)
    if args.report_dir:
        session.writable(args.report_dir)
    try:  # before DATA is read: its reader comes with vLLM, and no file is worth a line without it
        session.need_vllm("audit")
    except session.NoVllm as missing:
        return failed(args, str(missing), quiet=True)
    try:
        chosen = selection.choose(args)
    except UsageError:
        raise
    except Exception as error:  # the command's own failure: exit 3, with a document under --json
        if args.debug:
            traceback.print_exc()
        return failed(args, f"the audit failed while reading DATA: {one_line(error)}")
    audit = Audit(args, chosen)
    if not chosen.audited:  # every chosen file wrong as it stands, n/a, or in another shard
        said = audit.said(None, None, False)
        print(said.text, flush=True)
        return said.code
    engine = session.Engine(
        args.model,
        flags,
        ids=chosen.ids,  # in vLLM's order; the audit's note says so
        neighbours=True,
        prefix_caching=False,  # a cached prefix would leave a prompt's start out
        chunked_prefill=False,  # each prompt whole in one forward
    )
    with session.Session(
        "audit",
        engine,
        audit.said,
        report_dir=args.report_dir,
        timeout=args.timeout,
        debug=args.debug,
        remove_records=True,
    ) as engine_session:
        engine_session.open()
        audit.fit(engine_session.hidden_size)
        audit.begin(engine_session.run_dir)
        os.environ[worker.MANIFEST_VAR] = audit.manifest
        os.environ[settings.WORKER_VAR] = worker.__name__
        engine_session.start()
        audit.run_files(engine_session)
    raise AssertionError("not reached: the session's end exits")


def failed(args: argparse.Namespace, reason: str, quiet: bool = False) -> int:
    """The command failed before any engine (no vLLM, DATA unreadable): exit 3, its line on stderr
    (`quiet`: that line alone), the document under --json."""
    if args.json:
        found = output.document("audit", verdicts.ERROR, reason, data=args.data, model=args.model, files=[])
        print(json.dumps(found, indent=2), flush=True)
    if not (quiet and args.json):
        print(reason if quiet else f"vllm-hotfix audit: {reason}", file=sys.stderr, flush=True)
    return verdicts.ERROR


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
    """The audit's files on the session: their tokens as its prompts, their judgement as its
    verdict. Each generate call's results and the check's records are taken once the call returns
    (and removed), so neither memory nor the report directory grows with the number of files."""

    def __init__(self, args: argparse.Namespace, chosen: Chosen) -> None:
        self.args = args
        self.chosen = chosen
        self.out = ""
        self.results = Results(chosen.ids, bool(getattr(args, "list_every_file", False)))
        self.manifest = ""
        self._document: tuple[outcome_mod.Outcome | None, dict[str, Any]] | None = None

    def begin(self, run_dir: str) -> None:
        """The run's directory for the worker's results, and its manifest (before the engine)."""
        self.out = os.path.join(run_dir, "audit")
        os.makedirs(self.out, exist_ok=True)
        self.manifest = os.path.join(run_dir, "audit-manifest.json")
        self._write_manifest([])

    def fit(self, hidden: int | None) -> None:
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
            raise session.CommandError("no chosen file fits the model: " + str(self.chosen.na[0].na))

    def _write_manifest(self, entries: list[dict[str, Any]]) -> None:
        """The files of the next generate call, for the worker (worker.py reads it again when it
        changes); each file's states are judged at its stored dtype's precision too (compare.py)."""
        assert self.manifest, "begin names the manifest's path"
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

    def run_files(self, engine_session: session.Session, sampling: Any = None) -> None:
        """The chosen files' tokens as prompts, a generate call at a time, each call's results
        taken; `sampling`: vLLM's SamplingParams (a stand-in in tests)."""
        if sampling is None:
            from vllm import SamplingParams

            sampling = SamplingParams
        vocab, max_len = engine_session.vocab, engine_session.max_len
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
        for batch in batches(runnable, judged, settings.read_verify().tokens):
            engine_session.phase = f"auditing files {done + 1} to {done + len(batch)} of {len(runnable)}"
            prompts, entries = self._prompts(batch, vocab)
            self._write_manifest(entries)
            if prompts:
                engine_session.llm.generate(prompts, prefill, use_tqdm=False)
            for entry in entries:
                self.results.take(self.out, entry["index"], self.row(entry["index"]))
            engine_session.records().consume()  # the forwards of this call, every rank's record in
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
        proven = judged is not None and judged.verdict == PASS
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
                notes.append(f"{files_(unproven)} judged against the recomputed states n/a: {why}")
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
                notes.append(f"{files_(len(unreached))} n/a, {why}")
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
        error = judged.reason if judged.exit_code == verdicts.ERROR else None
        return verdict_mod.verdict(counts, rows, judged.verdict, error)

    def document(
        self, engine_session: session.Session | None, judged: outcome_mod.Outcome | None, timed_out: bool
    ) -> dict[str, Any]:
        """The document, built once per judgement; a failure to build it is exit 3 with a
        document still (never a traceback, never exit 1). No run: no engine was needed."""
        if self._document is None or self._document[0] is not judged:
            try:
                built = self._build(engine_session, judged, timed_out)
            except Exception as error:
                if getattr(self.args, "debug", False):
                    traceback.print_exc()
                reason = f"the audit failed while judging: {one_line(error)}"
                built = output.document(
                    "audit", verdicts.ERROR, reason, data=self.args.data, model=self.args.model, files=[]
                )
            self._document = (judged, built)
        return self._document[1]

    def _build(
        self, engine_session: session.Session | None, judged: outcome_mod.Outcome | None, timed_out: bool
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
        return output.document(
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
            if engine_session is None or judged is None
            else verify_command.document(
                self.args.model,
                list(self.args.engine_args),
                engine_session.facts,
                None,
                judged,
                timed_out,
                engine_session.seconds,
            ),
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
            f"{short['tokens']} judged tokens of {files_(short['files'])} lie beyond the first"
            f" {settings.read_verify().tokens} tokens of their forward, which the pre-flight check"
            f" compares ({settings.TOKENS_VAR}); see each file's not_preflighted_tokens"
            " (--list-every-file lists the ok ones too)"
        )

    def said(
        self, engine_session: session.Session | None, judged: outcome_mod.Outcome | None, timed_out: bool
    ) -> session.Said:
        """The audit's verdict: at the session's end, or without one where no file needed the engine."""
        found = self.document(engine_session, judged, timed_out)
        if self.args.json:
            return session.Said(found, json.dumps(found, indent=2), int(found["exit_code"]))
        lines = [] if judged is None else [f"pre-flight check: {judged.verdict} ({judged.reason})"]
        lines += verdict_mod.text_lines(found)
        return session.Said(found, "\n".join(lines), int(found["exit_code"]))


def moe_notes(per_id: list[dict[str, Any]]) -> list[str]:
    """Per id, the ok files with tokens over the tolerance, within a MoE model's allowance."""
    return [
        f"id {e['id']}: ok {files_(e['files_with_tokens_over'])} with tokens over the tolerance (at"
        f" most {e['most_tokens_over']['tokens']} of {e['most_tokens_over']['of']}), within what a"
        " MoE model's routing may move (judging/precision.py)"
        for e in per_id
        if e["files_with_tokens_over"]
    ]
