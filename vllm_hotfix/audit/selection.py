"""Which files an audit run judges: DATA listed (each file once), the sample and the shard chosen,
each chosen file's header read (files.py) and filed as audited, `n/a` with why, or `wrong` as it
stands, all before vLLM is imported. A path, an id list or a sample size that cannot work is a
usage error (exit 4) at once; one file that cannot be audited never costs another its judgement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_hotfix.audit import files as files_mod
from vllm_hotfix.judging.engine_facts import in_vllm_order
from vllm_hotfix.judging.verdicts import UsageError

DEFAULT_SAMPLE = 32


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


def usage_problem(args: argparse.Namespace) -> str | None:
    """What in the audit's own arguments cannot work (DATA, --report-dir, --rank), found without
    reading a file and before vLLM is looked for."""
    root = Path(args.data)
    if root.exists() and not root.is_dir():
        return f"DATA {args.data}: a file, not a directory (give the dataset's directory)"
    if not root.is_dir():
        return f"DATA {args.data}: no such directory"
    if args.report_dir and inside(args.report_dir, root):
        return f"--report-dir {args.report_dir} is inside DATA {args.data}: the audit never writes there"
    if not 0 <= args.rank < args.world_size:
        return f"--rank {args.rank}: must be 0 to {args.world_size - 1} for --world-size {args.world_size}"
    return None


def choose(args: argparse.Namespace) -> Chosen:
    """Read the chosen files' headers (their tokens are read once, when their batch runs);
    UsageError when the arguments cannot work (usage_problem) or no file of DATA can be audited."""
    problem = usage_problem(args)
    if problem:
        raise UsageError(problem)
    root = Path(args.data)
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
    every = sample is None or sample >= chosen.total  # a sample's files say nothing of the others
    if not chosen.audited and not chosen.wrong and chosen.na and args.world_size == 1 and every:
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
