"""Datasets for the audit's tests (test_audit*.py): a four-id dataset cut to the ids 1, 2 and 4,
defects planted in some of its files, each with the id it hits and the cause the audit must name,
and a snapshot that shows the audit left a dataset as it was."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.testenv import TestEnv

IDS = "1,2,4"  # the cut files' ids; the 4-layer checkpoint's final layer is 4
Plant = Callable[[Any, Any], None]  # (the file's states, the four-id states) -> None, in place


def columns(made: Path, target: Path, plant: dict[str, Plant] | None = None) -> Path:
    """The files with ids 1, 2 and 4 (columns 0, 1, 3 of ids 1..4), `plant[name]` applied to one's
    states (given the four-id states it can take layer 3's, an id off by one, from)."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for path in sorted(made.glob("*.safetensors")):
        tensors = load_file(str(path))
        full = tensors["hidden_states"]
        states = full[:, [0, 1, 3]].clone()
        if plant and path.name in plant:
            plant[path.name](states, full)
        save_file(
            {"hidden_states": states.contiguous(), "token_ids": tensors["token_ids"]}, str(target / path.name)
        )
    return target


def _noise(states: Any, full: Any) -> None:
    import torch

    generator = torch.Generator().manual_seed(0)
    states[:, 0] += 0.3 * torch.randn(states[:, 0].shape, generator=generator) * states[:, 0].std()


# (the ids it hits, how, the cause the audit names for each: a regular expression, or None for no pattern)
DEFECTS: list[tuple[list[int], Plant, str | None]] = [
    ([2], lambda s, full: s[:, 1].mul_(1.5), r"scaled by 1\.5"),
    (
        [2],
        lambda s, full: s[:, 1].copy_(full[:, 2]),  # layer 3's state where id 2's belongs
        r"the state of layer 3, a neighbouring layer \(an id off by one\)",
    ),
    ([4], lambda s, full: s[:, 2].copy_(s[:, 1]), "an alias of id 2"),
    ([1], lambda s, full: s[10:, 0].zero_(), r"wrong on \d+ of \d+ tokens: zeros"),  # from token 10 on
    ([1], _noise, None),  # like a rank's partial sum: no pattern
    # the padding slot's overwrite (vLLM 0.24.0, CUDA graphs): the KV-cache write puts a padded row's
    # states, every id, into one token's stored slot; here the row of another token of the file
    ([1, 2, 4], lambda s, full: s[-1].copy_(s[0]), r"wrong on 1 of \d+ tokens"),
]
ZEROS_FROM = 10  # the first token the zeros defect clears


def planted(names: list[str]) -> dict[str, tuple[list[int], Plant, str | None]]:
    """The defects, one per file, in the order of `names` (as many as there are names)."""
    return dict(zip(names, DEFECTS, strict=False))


def audit(testenv: TestEnv, plugin: str, work: Path, *args: str) -> Any:
    """`vllm-hotfix audit` on vLLM 0.24.0 with the hotfix installed as a plugin."""
    return testenv.run(
        ["-m", "vllm_hotfix", "audit", *args],
        paths=(plugin,),
        timeout=900,
        VLLM_CACHE_ROOT=str(work / "vllm-cache"),
    )


def snapshot(data: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's contents and modification time."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(data.iterdir())}
