"""In the engine's process that holds the aux states (tensor-parallel rank 0): each forward's
prompts are matched to the dataset's files by their tokens, and each file is judged (compare.py)
and its result written to the run's directory, where the command takes it (results.py) after its
generate call. One file is read at a time, so memory stays bounded whatever the dataset's size;
the dataset is only read.

A prompt is whole in one forward, from position 0: the audit's engine runs without prefix caching
and with every prompt in one step (job.py); a prompt that arrives otherwise is `n/a`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from vllm_hotfix.audit import compare, files, results
from vllm_hotfix.judging import precision

MANIFEST_VAR = "VLLMHOTFIX_AUDIT_MANIFEST"  # set by `vllm-hotfix audit` for its engine's processes
_MOE_LAYERS = ("RoutedExperts", "FusedMoE")  # vLLM's expert layer, by release


def attach(model: Any, ids: Sequence[int]) -> None:
    """In a process of the audit's engine, on tensor-parallel rank 0: a forward hook on the target
    model (the one the check hooks too) that judges the files each forward's prompts belong to."""
    path = os.environ.get(MANIFEST_VAR)
    if not path:
        return
    from vllm_hotfix.judging import engine_facts as runtime
    from vllm_hotfix.runtime import containment

    if runtime.ranks()["tp"] != 0:
        return
    auditor = Auditor(path, ids, moe=has_routed_experts(model))

    def after_forward(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], (list, tuple))):
            return  # an earlier pipeline stage
        if runtime.dummy_forward():
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if input_ids is None or positions is None or positions.dim() != 1:
            return  # embeddings given instead of tokens, or multi-dimensional positions
        try:
            auditor.forward(input_ids, positions, output[1])
        except Exception as error:  # never break the host: the file stays `n/a`
            containment.report_error("audit: a forward not judged", error)

    model.register_forward_hook(after_forward, with_kwargs=True)


def has_routed_experts(model: Any) -> bool:
    """Whether the model routes tokens to experts: a vLLM MoE layer in it (`RoutedExperts`, named
    `FusedMoE` in older releases, or a subclass). Its tokens may differ for numeric reasons."""
    return any(any(cls.__name__ in _MOE_LAYERS for cls in type(module).__mro__) for module in model.modules())


def segments(positions: Any) -> list[tuple[int, int]]:
    """(start, end) of each prompt of a forward: a prompt starts where its position is 0."""
    starts = [int(i) for i in (positions == 0).nonzero().flatten()]
    ends = [*starts[1:], int(positions.shape[0])]
    return list(zip(starts, ends, strict=True))


class Auditor:
    """Judges the files whose tokens a forward carried; writes `<out>/<index>.json` per file. A
    file that cannot be judged (unreadable since its header was read, a shape the engine's states
    do not match) is `n/a` with why, and costs no other file of the forward its judgement.

    The manifest names the files of the command's current generate call only: the command rewrites
    it (aside, then renamed) before each call, and the auditor reads it again when it has changed,
    so neither side holds more than one call's files."""

    def __init__(self, manifest_path: str, engine_ids: Sequence[int], moe: bool = False) -> None:
        from vllm_hotfix.runtime import settings

        self.manifest_path = manifest_path
        self.moe = moe
        self.engine_ids = list(engine_ids)
        self.checked_tokens = settings.read_verify().tokens  # what the pre-flight compares per forward
        self.read_as: tuple[int, int] | None = None  # (inode, mtime) of the manifest as last read
        self.ids: list[int] = []
        self.tolerance: float | None = None  # --tolerance: replaces the rule
        self.out = ""
        # index -> the file's entry: path, the rows judged (its first --max-tokens), stored dtype
        self.entries: dict[int, dict[str, Any]] = {}
        self.by_tokens: dict[str, list[int]] = {}
        self._refresh()

    def _refresh(self) -> None:
        """Read the manifest again where the command has replaced it (a new generate call)."""
        stat = os.stat(self.manifest_path)
        if (stat.st_ino, stat.st_mtime_ns) == self.read_as:
            return
        with open(self.manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
        self.read_as = (stat.st_ino, stat.st_mtime_ns)
        self.ids, self.tolerance, self.out = manifest["ids"], manifest.get("tolerance"), manifest["out"]
        # a file's number: its result's name (results.py); by default its place in the manifest
        self.entries = {int(entry.get("index", n)): entry for n, entry in enumerate(manifest["files"])}
        self.by_tokens = {}
        for index, entry in self.entries.items():
            self.by_tokens.setdefault(entry["tokens_key"], []).append(index)

    def forward(self, input_ids: Any, positions: Any, aux: Sequence[Any]) -> None:
        """One forward of the engine: its flattened tokens, positions and aux states (one
        [tokens, hidden] tensor per engine id)."""
        self._refresh()
        engine_dtype = aux[0].dtype
        for start, end in segments(positions):
            matches = self.by_tokens.pop(files.tokens_key(input_ids[start:end].tolist()), [])
            if not matches:
                continue
            references = {
                i: state[start:end].float().cpu() for i, state in zip(self.engine_ids, aux, strict=True)
            }
            unchecked = max(0, end - max(start, self.checked_tokens))
            for index in matches:
                entry = self.entries[index]
                try:
                    result = self._judge(entry, references, engine_dtype)
                except Exception as error:  # this file alone: the others of the forward are judged
                    result = {"status": "n/a", "why": f"not judged: {type(error).__name__}: {error}"}
                result["not_preflighted_tokens"] = unchecked
                self._write(index, entry["path"], result)

    def _judge(self, entry: dict[str, Any], references: dict[int, Any], engine_dtype: Any) -> dict[str, Any]:
        from safetensors import safe_open

        try:
            with safe_open(entry["path"], framework="pt") as handle:
                stored = handle.get_slice(files.STATES)[: int(entry["rows"])]
        except Exception as error:  # the file changed or broke since its header was read
            return {"status": "n/a", "why": f"unreadable: {type(error).__name__}: {error}"}
        try:
            rule = precision.rule(
                compare.stored_precision(stored), engine_dtype, int(stored.shape[0]), self.moe, self.tolerance
            )
        except ValueError as error:
            return {"status": "n/a", "why": str(error)}
        per_id = compare.judge_file(stored, self.ids, references, rule)
        result: dict[str, Any] = {"status": _status(per_id), "precision": rule.as_dict(), "per_id": per_id}
        errors = [e["why"] for e in per_id if e.get("error")]
        if errors:
            result["why"] = f"id {next(e['id'] for e in per_id if e.get('error'))}: {errors[0]}"
            result["error"] = True
        return result

    def _write(self, index: int, path: str, result: dict[str, Any]) -> None:
        final = results.result_path(self.out, index)
        with open(final + ".tmp", "w", encoding="utf-8") as handle:
            json.dump({"file": path, **result}, handle)
        os.replace(final + ".tmp", final)


def _status(per_id: list[dict[str, Any]]) -> str:
    """A file's status from its ids': wrong if one is; else n/a if one could not be judged."""
    statuses = {entry["status"] for entry in per_id}
    return "wrong" if "wrong" in statuses else "n/a" if "n/a" in statuses else "ok"
