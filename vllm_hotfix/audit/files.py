"""The dataset's files, read from their safetensors headers before any engine starts.

safetensors' own reader (`safe_open`, installed wherever vLLM is; imported here only when the audit
runs, so the package keeps wrapt as its only dependency) validates a header (its JSON, dtypes,
shapes against byte offsets, the file's length) without reading the states and without torch. A
file that fails is `n/a` with the reader's reason; a file with fewer state rows than tokens is
`wrong` as it stands. Which files a run audits is decided by their paths relative to DATA alone
(a seeded sample, a shard of a partition), so every machine chooses the same. Nothing here writes.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATES, TOKENS = "hidden_states", "token_ids"
SUFFIX = ".safetensors"
# the stored precisions the audit reads (safetensors' names); the states' dtype is passed to judging
STATE_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
TOKEN_DTYPES = ("I64", "I32", "U32", "I16", "U16", "U8")
# Fewer rows than tokens: the two known ways vLLM's ExampleHiddenStatesConnector writes such a file
MISSING_ROWS = (
    "rows are missing: the likely cause a cached prefix left out of the file (prefix caching under"
    " vLLM 0.22-0.23's ExampleHiddenStatesConnector, vLLM #44485), or a request that ended before"
    " its prefill completed (aborted or timed out under vLLM 0.24-0.34's connector: the fix"
    " hidden-states-unfinished-prefill)"
)


@dataclass(frozen=True)
class DataFile:
    """One file of the dataset: its shapes, or why it cannot be audited (`na`), or why it is wrong
    as it stands (`wrong`, no recomputation needed)."""

    path: Path
    name: str = ""  # relative to DATA, with "/": what the sample and the partition are keyed on
    tokens: int = 0
    ids: int = 0
    hidden: int = 0
    dtype: str = ""  # the stored states' safetensors dtype: judged at its precision (compare.py)
    na: str | None = None
    wrong: str | None = None
    rows: int = 0  # state rows stored


class ReaderMissing(Exception):
    """safetensors (or numpy, its reader's arrays) is not installed: the audit cannot read a file."""


def reader() -> Any:
    """safetensors' `safe_open`, imported lazily: the audit runs where vLLM is, which has it."""
    try:
        import numpy  # noqa: F401  (safe_open's framework="numpy" reads the token ids as arrays)
        from safetensors import safe_open
    except ImportError as error:
        raise ReaderMissing(
            f"the audit reads the files with safetensors and numpy, installed with vLLM ({error});"
            " run it in vLLM's environment"
        ) from None
    return safe_open


@dataclass(frozen=True)
class Listing:
    """Every safetensors file under DATA once, by relative path; links to a file already listed
    are left out (counted in `links`)."""

    files: list[tuple[str, Path]]
    links: int = 0

    @property
    def digest(self) -> str:
        """The dataset's identity for merging shards: sha256 of the sorted relative paths."""
        return hashlib.sha256("\n".join(name for name, _ in self.files).encode()).hexdigest()


def listing(data: Path) -> Listing:
    """The files in a stable order (relative path); a file reached by several paths (links) counts
    once, under its own path where that is in DATA, else under its first link by relative path."""
    found = sorted((p.relative_to(data).as_posix(), p) for p in data.rglob(f"*{SUFFIX}") if p.is_file())
    seen: set[str] = set()
    kept, links = [], 0
    for name, path in sorted(found, key=lambda item: (item[1].is_symlink(), item[0])):
        real = os.path.realpath(path)
        if real in seen:
            links += 1
            continue
        seen.add(real)
        kept.append((name, path))
    return Listing(sorted(kept), links)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def choose(names: list[str], sample: int | None, seed: int) -> list[str]:
    """All the names, or `sample` of them: those whose hash with `seed` is smallest, a uniform
    random choice that depends on the names and seed alone (not on the machine, nor on the order
    or the other files listed), kept in the given order."""
    if sample is None or sample >= len(names):
        return list(names)
    picked = set(sorted(names, key=lambda name: (_hash(f"{seed}\0{name}"), name))[:sample])
    return [name for name in names if name in picked]


def shard(name: str, world_size: int) -> int:
    """The rank that audits file `name` of `world_size`: a hash of its relative path, the same on
    every machine and for every Python."""
    return _hash(name) % world_size


def read_header(path: Path, name: str = "") -> DataFile:
    """The file's shapes from its header, checked by safetensors; `na` says why it cannot be
    audited, `wrong` why it is wrong without recomputing it."""
    safe_open = reader()
    blank = DataFile(path, name or path.name)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            keys = set(handle.keys())
            missing = [key for key in (STATES, TOKENS) if key not in keys]
            if missing:
                listed = ", ".join(sorted(keys)) or "none"
                return dataclasses.replace(blank, na=f"no {' or '.join(missing)} tensor (found: {listed})")
            states, tokens = handle.get_slice(STATES), handle.get_slice(TOKENS)
            shape, dtype = list(states.get_shape()), str(states.get_dtype())
            token_shape, token_dtype = list(tokens.get_shape()), str(tokens.get_dtype())
    except Exception as error:  # SafetensorError (header, offsets, length), OSError, ...
        return dataclasses.replace(blank, na=f"unreadable header: {type(error).__name__}: {error}")
    if len(shape) != 3 or len(token_shape) != 1:
        return dataclasses.replace(
            blank,
            na=f"shapes {STATES} {shape} and {TOKENS} {token_shape}: not [tokens, ids, hidden] and [tokens]",
        )
    if token_dtype not in TOKEN_DTYPES:
        return dataclasses.replace(blank, na=f"{TOKENS} has dtype {token_dtype}, not an integer type")
    if dtype not in STATE_DTYPES:
        return dataclasses.replace(
            blank,
            na=f"{STATES} stored as {dtype}: not a precision the audit reads ({', '.join(STATE_DTYPES)})",
        )
    rows, count = shape[0], token_shape[0]
    found = dataclasses.replace(blank, tokens=count, ids=shape[1], hidden=shape[2], dtype=dtype, rows=rows)
    if count == 0:
        return dataclasses.replace(found, na=f"no tokens: {TOKENS} is empty")
    if rows > count:
        return dataclasses.replace(found, na=f"{rows} state rows for {count} tokens: more rows than tokens")
    if rows < count:
        return dataclasses.replace(found, wrong=f"{rows} state rows for {count} tokens: {MISSING_ROWS}")
    return found


def token_ids(found: DataFile) -> list[int]:
    """The file's token ids, read by safetensors (which checks their bytes are all there)."""
    with reader()(str(found.path), framework="numpy") as handle:
        values: list[int] = handle.get_tensor(TOKENS).tolist()
    return values


def tokens_key(ids: list[int]) -> str:
    """The key of a prompt's tokens, the same for a file and a forward (worker.py): sha256 of
    their little-endian int64 bytes."""
    values = array.array("q", ids)
    if sys.byteorder != "little":
        values.byteswap()
    return hashlib.sha256(values.tobytes()).hexdigest()
