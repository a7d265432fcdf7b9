"""The audit's verdict and its estimate for the whole dataset, from the rows of its files: one rule
for a run and for the merge of its shards' documents (merge.py).

A row's status is `ok`, `wrong` or `n/a`. A row judged against a reference the pre-flight check did
not prove is `n/a` already (command.py); a file wrong as it stands (fewer state rows than tokens)
needs no reference and stays `wrong` whatever the check says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_hotfix import exit_codes
from vllm_hotfix.audit import bound

PASS, FAIL, UNKNOWN = "PASS", "FAIL", "UNKNOWN"
STATUSES = ("ok", "wrong", "n/a")


def counts(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    return {status: sum(row.get("status") == status for row in rows) for status in STATUSES}


def summary(rows: Sequence[dict[str, Any]]) -> str:
    count = counts(rows)
    return f"{count['ok']} ok, {count['wrong']} wrong, {count['n/a']} n/a of {len(rows)} files audited"


def verdict(
    rows: Sequence[dict[str, Any]], check: str | None, error: str | None = None
) -> tuple[str, int, str]:
    """(verdict, exit code, reason). `check`: the pre-flight check's verdict, None where no file
    needed the engine; `error`: the run's own failure (exit 3), as is a row marked `error` (a
    reference that is not finite, say)."""
    count, said = counts(rows), summary(rows)
    if error:
        return UNKNOWN, exit_codes.ERROR, f"{error}; {said}"
    broken = next((row for row in rows if row.get("error")), None)  # the run's own fault in a file's row
    if broken is not None:
        return UNKNOWN, exit_codes.ERROR, f"{broken.get('why')} ({broken.get('file')}); {said}"
    if count["wrong"]:
        return FAIL, exit_codes.WRONG, said
    if check is not None and check != PASS:
        return UNKNOWN, exit_codes.INCOMPLETE, f"the pre-flight check says {check}; {said}"
    if count["n/a"]:
        return UNKNOWN, exit_codes.INCOMPLETE, said
    return PASS, exit_codes.OK, said


def estimate(
    rows: Sequence[dict[str, Any]], files_in_data: int, sample: int | None, seed: int
) -> dict[str, Any]:
    """What the rows say of every file in DATA: the exact count where every file was chosen, else
    the largest wrong fraction the sample allows at bound.CONFIDENCE (n/a files are outside it)."""
    count = counts(rows)
    judged = count["ok"] + count["wrong"]
    sampled = sample is not None and sample < files_in_data
    at_most = bound.upper_bound(count["wrong"], judged) if sampled and judged else None
    return {
        "files_in_data": files_in_data,
        "sampled": sampled,
        "sample_size": min(sample, files_in_data) if sample is not None else files_in_data,
        "seed": seed,
        "judged": judged,
        "wrong": count["wrong"],
        "n/a": count["n/a"],
        "confidence": bound.CONFIDENCE,
        "wrong_fraction_at_most": at_most,
    }


def estimate_line(found: dict[str, Any]) -> str:
    """The estimate in one line of text."""
    head = f"{found['wrong']} wrong of {found['judged']} judged"
    head += f" ({found['n/a']} n/a, outside the estimate)" if found["n/a"] else ""
    if not found["sampled"]:
        return f"every file: {head}, of {found['files_in_data']} files in DATA"
    if found["wrong_fraction_at_most"] is None:
        return f"sample: {head}: no file judged, nothing to say of the {found['files_in_data']} files in DATA"
    return (
        f"sample: {head} of {found['sample_size']} chosen at random (--seed {found['seed']}) from"
        f" {found['files_in_data']} files; at {found['confidence']:.0%} confidence at most"
        f" {found['wrong_fraction_at_most']:.2%} of the files in DATA are wrong"
    )
