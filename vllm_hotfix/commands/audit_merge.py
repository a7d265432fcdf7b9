"""`vllm-hotfix audit-merge REPORT...`: the `--json` documents of one audit's shards as one verdict
and one estimate (audit/merge.py), printed as the audit prints its own."""

from __future__ import annotations

import argparse
import json
import sys

from vllm_hotfix.audit import merge
from vllm_hotfix.audit import verdict as verdict_mod
from vllm_hotfix.commands import output
from vllm_hotfix.judging import verdicts
from vllm_hotfix.judging.verdicts import UsageError
from vllm_hotfix.runtime.errors import one_line

SCHEMA = output.SCHEMAS["audit"]  # 3: counts and per_id over the files; the files worth naming


def read(path: str) -> dict[str, object]:
    """REPORT `path`, an audit shard's document of this version's schema; else UsageError."""
    try:
        with open(path, encoding="utf-8") as handle:
            found = json.load(handle)
    except (OSError, ValueError) as error:
        raise UsageError(f"REPORT {path}: not readable as JSON ({error})") from None
    return merge.check(path, found, SCHEMA)


def run(args: argparse.Namespace) -> int:
    try:
        fields = merge.merge([(path, read(path)) for path in args.reports])
    except UsageError:
        raise
    except Exception as error:  # a document of another form: the command's own failure, exit 3
        reason = f"the merge failed: {one_line(error)}"
        print(f"vllm-hotfix audit-merge: {reason}", file=sys.stderr)
        if args.json:
            found = output.document("audit-merge", verdicts.ERROR, reason, data=None, model=None, files=[])
            print(json.dumps(found, indent=2), flush=True)
        return verdicts.ERROR
    code, reason = int(fields.pop("exit_code")), str(fields.pop("reason"))
    merged = output.document("audit-merge", code, reason, **fields)
    print(
        json.dumps(merged, indent=2) if args.json else "\n".join(verdict_mod.text_lines(merged)), flush=True
    )
    return code
