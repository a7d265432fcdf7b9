"""`vllm-hotfix verify MODEL [OPTIONS] [-- ENGINE ARGS]`: an engine of its own with the user's flags
(session.py: the installed vLLM's own parser, compiled, CUDA graphs off through its public config),
a bounded workload, and every forward of it judged from the ranks' records (check/outcome.py).
Exit codes: judging/verdicts.py. Only the verdict goes to stdout; vLLM's log goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from typing import Any

from vllm_hotfix.check import inductor_order
from vllm_hotfix.check import outcome as outcome_mod
from vllm_hotfix.commands import output, session
from vllm_hotfix.judging import verdicts
from vllm_hotfix.judging.verdicts import FAIL, UsageError
from vllm_hotfix.runtime import settings

DECODE = 2  # tokens generated per prompt of the workload: its prefill and a decode step are checked
DEFAULT_LENGTHS = (16, 64, 512, 2048)  # long prefills can take other kernel paths than short prompts
DEFAULT_BATCHES = (1, 4)
FACT_KEYS = ("run_id", "method", "ids", "model_class", "compilation", "load_format", "report_dir")  # document


@dataclasses.dataclass
class Workload:
    """verify's prompts: each length in each batch size; lengths over the engine's max_model_len
    left out and named."""

    lengths: list[int]
    batches: list[int]
    skipped: list[int] = dataclasses.field(default_factory=list)

    def fit(self, max_len: int) -> str | None:
        """Leave out the lengths the engine cannot run; the note that says so."""
        self.skipped = [n for n in self.lengths if n + DECODE > max_len]
        self.lengths = [n for n in self.lengths if n + DECODE <= max_len]
        if not self.skipped:
            return None
        return (
            f"prompt lengths {self.skipped} left out: with the {DECODE} tokens each generates, over"
            f" max_model_len {max_len}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_lengths": self.lengths,
            "skipped_lengths": self.skipped,
            "batch_sizes": self.batches,
            "decode_tokens": DECODE,
        }


def run(args: argparse.Namespace) -> int:
    """The check, start to end: usage (exit 4) and vLLM's presence (exit 3) before anything, then
    the session, whose end prints the verdict and exits."""
    flags = list(args.engine_args)
    problem = session.usage_problem(args.model, flags)
    if problem:
        raise UsageError(problem)
    if args.report_dir:
        session.writable(args.report_dir)
    try:
        session.need_vllm("verify")
    except session.NoVllm as missing:
        return no_vllm(args, str(missing))
    workload = Workload(
        sorted(set(args.prompt_lengths or DEFAULT_LENGTHS)), sorted(set(args.batch_sizes or DEFAULT_BATCHES))
    )
    engine = session.Engine(args.model, flags, ids=args.ids)
    render = functools.partial(said, args.model, flags, workload, args.json)
    with session.Session(
        "verify", engine, render, report_dir=args.report_dir, timeout=args.timeout, debug=args.debug
    ) as engine_session:
        engine_session.open()
        engine_session.start()
        note = workload.fit(engine_session.max_len)
        engine_session.facts.notes += [note] if note else []
        run_workload(engine_session.llm, workload, engine_session.vocab, engine_session)
    raise AssertionError("not reached: the session's end exits")


def no_vllm(args: argparse.Namespace, line: str) -> int:
    """This Python has no vLLM: the line on stderr, or under --json the document with it as reason."""
    if args.json:
        judged = outcome_mod.verdict_of_run([], "", outcome_mod.World(), line)
        print(output_json(document(args.model, list(args.engine_args), None, None, judged, False, 0.0)))
    else:
        print(line, file=sys.stderr, flush=True)
    return verdicts.ERROR


def output_json(found: dict[str, Any]) -> str:
    import json

    return json.dumps(found, indent=2)


def said(
    model: str,
    flags: list[str],
    workload: Workload,
    as_json: bool,
    engine_session: session.Session,
    judged: outcome_mod.Outcome,
    timed_out: bool,
) -> session.Said:
    """verify's verdict at the session's end."""
    facts = engine_session.facts
    found = document(model, flags, facts, workload, judged, timed_out, engine_session.seconds)
    return session.Said(found, output_json(found) if as_json else check_text(facts, judged), judged.exit_code)


def run_workload(llm: Any, workload: Workload, vocab: int, engine_session: Any = None) -> None:
    """Each prompt length in each batch size, greedy, DECODE tokens each: its prefill and decode
    forwards are all checked. Distinct prompts: no prefix-cache hit hides a prefill. The session,
    where there is one, says which call runs (benchmarks/verify_cost.py runs it without)."""
    from vllm import SamplingParams

    counter, span = 0, max(vocab - 1, 2)
    greedy = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    for batch in workload.batches:
        for length in workload.lengths:
            if engine_session is not None:
                engine_session.phase = f"generating {batch} prompt(s) of {length} tokens"
            # fixed token ids inside the vocabulary (no tokenizer needed), distinct per prompt
            ids = [
                [(37 * n + 101 * t + 7 * n * t + 5) % span + 1 for t in range(length)]
                for n in range(counter, counter + batch)
            ]
            counter += batch
            llm.generate([{"prompt_token_ids": p} for p in ids], greedy, use_tqdm=False)


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


def check_text(facts: session.Facts, judged: outcome_mod.Outcome) -> str:
    """The check's verdict as text: the ranks, the run's notes and caveats, the verdict line."""
    lines = [format_reports(judged.reports)]
    if judged.ignored:
        lines.append(f"ignored {judged.ignored} report(s) of other runs in {facts.report_dir}")
    lines += [f"note: {note}" for note in facts.notes]
    lines += [f"caveat: {caveat}" for caveat in facts.caveats]
    lines += [f"torch: {why}" for why in inductor_order.reported(judged.reports)]
    lines += [f"problem: {problem}" for problem in judged.problems if problem != judged.reason]
    if judged.error and judged.verdict == FAIL:
        lines.append(f"vLLM stopped with an error: {judged.error}")
    elif not judged.error and not judged.reports and not judged.ignored:
        lines.append(
            "no record came back: is vllm-hotfix armed in vLLM's workers (pip install; VLLM_PLUGINS)?"
        )
    lines.append(f"verdict: {judged.verdict} ({judged.reason}); exit {judged.exit_code}")
    return "\n".join(lines)


def document(
    model: str,
    flags: list[str],
    facts: session.Facts | None,
    workload: Workload | None,
    judged: outcome_mod.Outcome,
    timed_out: bool,
    seconds: float,
) -> dict[str, Any]:
    """The check's --json document (the audit's holds it as `check`, without a workload of its own)."""
    return output.document(
        "verify",
        judged.exit_code,
        judged.reason,
        verdict=judged.verdict,
        problems=judged.problems,
        error=judged.error,
        timed_out=timed_out,
        model=model,
        engine_args=flags,
        **{key: getattr(facts, key, None) for key in FACT_KEYS},
        world=facts and facts.world.as_dict(),
        workload=workload and workload.as_dict(),
        caveats=facts.caveats if facts else [],
        notes=facts.notes if facts else [],
        ignored_reports=judged.ignored,
        per_id=outcome_mod.per_id(judged.reports),
        coverage=outcome_mod.coverage(judged.reports),
        ranks=judged.reports,
        seconds=seconds,
    )
