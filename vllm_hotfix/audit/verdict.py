"""The audit's verdict and its estimate for the whole dataset, from its files' counts per status
and the rows it names, and a document as text: one rule for a run and for the merge of its shards'
documents (merge.py).

A file's status is `ok`, `wrong` or `n/a`. A file judged against a reference the pre-flight check
did not prove is `n/a` already (commands/audit.py); a file wrong as it stands (fewer state rows than
tokens) needs no reference and stays `wrong` whatever the check says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_hotfix.audit import bound
from vllm_hotfix.judging import verdicts
from vllm_hotfix.judging.verdicts import FAIL, PASS, STATUSES, UNKNOWN


def summary(counts: dict[str, int]) -> str:
    files = sum(counts.get(status, 0) for status in STATUSES)
    return f"{counts['ok']} ok, {counts['wrong']} wrong, {counts['n/a']} n/a of {files_(files)} audited"


def files_(count: int) -> str:
    """`1 file`, `2 files`."""
    return f"{count} file{'' if count == 1 else 's'}"


def verdict(
    counts: dict[str, int], rows: Sequence[dict[str, Any]], check: str | None, error: str | None = None
) -> tuple[str, int, str]:
    """(verdict, exit code, reason) from the files' `counts` per status and the rows named (a row
    marked `error`, a reference that is not finite say, is the run's own failure: exit 3).
    `check`: the pre-flight check's verdict, None where no file needed the engine; `error`: the
    run's own failure."""
    said = summary(counts)
    if error:
        return UNKNOWN, verdicts.ERROR, f"{error}; {said}"
    broken = next((row for row in rows if row.get("error")), None)  # the run's own fault in a file's row
    if broken is not None:
        return UNKNOWN, verdicts.ERROR, f"{broken.get('why')} ({broken.get('file')}); {said}"
    if counts["wrong"]:
        return FAIL, verdicts.WRONG, said
    if check is not None and check != PASS:
        return UNKNOWN, verdicts.INCOMPLETE, f"the pre-flight check says {check}; {said}"
    if counts["n/a"]:
        return UNKNOWN, verdicts.INCOMPLETE, said
    return PASS, verdicts.OK, said


def estimate(counts: dict[str, int], files_in_data: int, sample: int | None, seed: int) -> dict[str, Any]:
    """What the counts say of every file in DATA: the exact count where every file was chosen, else
    the largest wrong fraction the sample allows at bound.CONFIDENCE (n/a files are outside it)."""
    judged = counts["ok"] + counts["wrong"]
    sampled = sample is not None and sample < files_in_data
    at_most = bound.upper_bound(counts["wrong"], judged) if sampled and judged else None
    return {
        "files_in_data": files_in_data,
        "sampled": sampled,
        "sample_size": min(sample, files_in_data) if sample is not None else files_in_data,
        "seed": seed,
        "judged": judged,
        "wrong": counts["wrong"],
        "n/a": counts["n/a"],
        "confidence": bound.CONFIDENCE,
        "wrong_fraction_at_most": at_most,
    }


def estimate_line(found: dict[str, Any]) -> str:
    """The estimate in one line of text."""
    head = f"{found['wrong']} wrong of {found['judged']} judged"
    head += f" ({found['n/a']} n/a, outside the estimate)" if found["n/a"] else ""
    if not found["sampled"]:
        return f"every file: {head}, of {files_(found['files_in_data'])} in DATA"
    if found["wrong_fraction_at_most"] is None:
        return (
            f"sample: {head}: no file judged, nothing to say of the {files_(found['files_in_data'])} in DATA"
        )
    return (
        f"sample: {head} of {found['sample_size']} chosen at random (--seed {found['seed']}) from"
        f" {files_(found['files_in_data'])}; at {found['confidence']:.0%} confidence at most"
        f" {found['wrong_fraction_at_most']:.2%} of the files in DATA are wrong"
    )


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
        lines.append(estimate_line(document["estimate"]))
    lines.append(f"verdict: {document['verdict']} ({document['reason']}); exit {document['exit_code']}")
    return lines
