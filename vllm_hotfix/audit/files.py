"""The dataset's files, read from their safetensors headers before any engine starts.

A header is 8 bytes (its length, little-endian) and a JSON table of tensors (dtype, shape, byte
offsets): enough to refuse a file that is truncated, lacks a tensor or has the wrong shapes without
reading its states, and without torch. Nothing here writes anything.
"""

from __future__ import annotations

import array
import hashlib
import json
import random
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

STATES, TOKENS = "hidden_states", "token_ids"
SUFFIX = ".safetensors"
# bytes per element of the safetensors dtypes a producer may use
_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "U8": 1,
    "I8": 1,
}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


@dataclass(frozen=True)
class DataFile:
    """One file of the dataset: its shapes, or why it cannot be audited (`na`)."""

    path: Path
    tokens: int = 0
    ids: int = 0
    hidden: int = 0
    dtype: str = ""
    na: str | None = None
    tokens_at: tuple[int, int, str] = (0, 0, "I64")  # the token ids' byte range and dtype


def discover(data: Path) -> list[Path]:
    """Every safetensors file under DATA, in a stable order (relative path)."""
    return sorted(p for p in data.rglob(f"*{SUFFIX}") if p.is_file())


def choose(paths: list[Path], sample: int | None, seed: int) -> list[Path]:
    """All the files, or `sample` of them chosen by `seed` (the same files for the same dataset,
    seed and count, whatever the machine), kept in the dataset's order."""
    if sample is None or sample >= len(paths):
        return list(paths)
    picked = set(random.Random(seed).sample(range(len(paths)), sample))
    return [path for i, path in enumerate(paths) if i in picked]


def read_header(path: Path) -> DataFile:
    """The file's shapes from its header; `na` says why it cannot be audited."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return DataFile(path, na="truncated: no safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                return DataFile(path, na="truncated or not a safetensors file: its header runs past its end")
            table = json.loads(handle.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as error:
        return DataFile(path, na=f"unreadable: {type(error).__name__}: {error}")
    if not isinstance(table, dict):
        return DataFile(path, na="not a safetensors file: its header is not a table")
    missing = [name for name in (STATES, TOKENS) if name not in table]
    if missing:
        return DataFile(path, na=f"no {' or '.join(missing)} tensor (found: {', '.join(sorted(table))})")
    states, tokens = table[STATES], table[TOKENS]
    shape, token_shape = states.get("shape", []), tokens.get("shape", [])
    if len(shape) != 3 or len(token_shape) != 1 or shape[0] != token_shape[0]:
        return DataFile(
            path,
            na=f"shapes {STATES} {shape} and {TOKENS} {token_shape}: not [tokens, ids, hidden] and [tokens]",
        )
    for name, entry in ((STATES, states), (TOKENS, tokens)):
        begin, end = entry.get("data_offsets", [0, -1])
        count = 1
        for dim in entry["shape"]:
            count *= dim
        if entry.get("dtype") not in _SIZES or end - begin != count * _SIZES[entry["dtype"]]:
            return DataFile(path, na=f"{name}: dtype {entry.get('dtype')} and offsets do not match its shape")
        if 8 + length + end > size:
            return DataFile(path, na=f"truncated: {name} runs past the end of the file")
    if tokens["dtype"] not in ("I64", "I32"):
        return DataFile(path, na=f"{TOKENS} has dtype {tokens['dtype']}, not an integer type")
    begin, end = tokens["data_offsets"]
    return DataFile(
        path,
        shape[0],
        shape[1],
        shape[2],
        states["dtype"],
        None,
        (8 + length + begin, 8 + length + end, tokens["dtype"]),
    )


def token_ids(found: DataFile) -> list[int]:
    """The file's token ids (little-endian int64 or int32, as safetensors stores them)."""
    begin, end, dtype = found.tokens_at
    with found.path.open("rb") as handle:
        handle.seek(begin)
        raw = handle.read(end - begin)
    values = array.array("q" if dtype == "I64" else "i", raw)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def tokens_key(ids: list[int]) -> str:
    """The key of a prompt's tokens, the same for a file and a forward (worker.py): sha256 of
    their little-endian int64 bytes."""
    values = array.array("q", ids)
    if sys.byteorder != "little":
        values.byteswap()
    return hashlib.sha256(values.tobytes()).hexdigest()
