"""`vllm-hotfix status` tells the truth about its environment, as a newcomer meets it: installed into
a Python without vLLM (the likeliest mistake), one line that names that Python and exit 2; a vLLM
that cannot be imported, one line and exit 3; a fix turned off, `disabled` before its module is
imported; the cache directory, and whether generated sources can be written there.

"Without vLLM" is a venv of the test interpreter with nothing installed: the checkout and wrapt on
PYTHONPATH (the one run-time dependency), as `pip install` into the wrong venv leaves it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.testenv import REPO, outside_checkout
from vllm_hotfix.fixes import FIX_IDS
from vllm_hotfix.judging import verdicts


def status_in(
    bare: tuple[str, str], *argv: str, path: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    python, only_wrapt = bare
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLLMHOTFIX_", "PYTHON"))}
    return subprocess.run(
        [python, "-m", "vllm_hotfix", "status", *argv],
        capture_output=True,
        text=True,
        env={**base, "PYTHONPATH": os.pathsep.join([*path, str(REPO), only_wrapt]), **env},
        cwd=outside_checkout(),
    )


def test_without_vllm_status_is_one_line_naming_the_python_and_exit_2(bare_python: tuple[str, str]) -> None:
    done = status_in(bare_python)
    assert done.returncode == verdicts.INCOMPLETE, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()  # a message: stderr
    assert line.startswith(f"vllm-hotfix status: no vLLM importable by {bare_python[0]}:")
    assert "install vllm-hotfix into the environment that runs vLLM" in line
    assert "python -m pip install" in line and done.stdout == ""

    done = status_in(bare_python, "--json")
    document = json.loads(done.stdout)
    assert done.returncode == document["exit_code"] == verdicts.INCOMPLETE
    assert document["reason"] == line and document["python_executable"] == bare_python[0]
    assert document["vllm_installed"] is None


def test_a_vllm_that_cannot_be_imported_is_one_line_and_exit_3(
    bare_python: tuple[str, str], tmp_path: Path
) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("import torch_not_installed_here\n")
    done = status_in(bare_python, path=(str(tmp_path),))
    assert done.returncode == verdicts.ERROR, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()  # a message: stderr
    said = f"vllm-hotfix status: vLLM is installed for {bare_python[0]} but cannot be imported"
    assert line.startswith(said)
    assert "No module named 'torch_not_installed_here'" in line
    # --no-probe imports nothing: it reports what this process knows
    assert status_in(bare_python, "--no-probe", path=(str(tmp_path),)).returncode == verdicts.OK


def test_a_disabled_fix_is_disabled_before_its_module_is_imported(bare_python: tuple[str, str]) -> None:
    every = json.loads(status_in(bare_python, "--json", VLLMHOTFIX_DISABLE="1").stdout)
    assert {fix["fix"]: fix["decision"] for fix in every["fixes"]} == dict.fromkeys(FIX_IDS, "disabled")
    assert {fix["reason"] for fix in every["fixes"]} == {"VLLMHOTFIX_DISABLE=1"}

    one = json.loads(status_in(bare_python, "--json", VLLMHOTFIX_DISABLE=FIX_IDS[0]).stdout)
    decided = {fix["fix"]: fix["decision"] for fix in one["fixes"]}
    assert decided[FIX_IDS[0]] == "disabled"
    assert set(decided.values()) - {"disabled"} == {"pending"}  # no vLLM: nothing else decided


def test_the_cache_directory_and_whether_it_is_usable(bare_python: tuple[str, str], tmp_path: Path) -> None:
    usable = json.loads(status_in(bare_python, "--json", VLLMHOTFIX_CACHE_DIR=str(tmp_path)).stdout)
    assert usable["cache_dir"] == {
        "path": str(tmp_path / "generated"),
        "usable": True,
        "problem": None,
        "used": str(tmp_path / "generated"),
    }
    assert list(tmp_path.iterdir()) == []  # checked by trying, nothing left behind

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cache = json.loads(status_in(bare_python, "--json", VLLMHOTFIX_CACHE_DIR=str(a_file)).stdout)["cache_dir"]
    assert cache["usable"] is False and cache["path"] == str(a_file / "generated")
    generated = a_file / "generated"
    assert cache["problem"] == f"{a_file} is a file, not a directory: {generated} cannot be created"
    assert cache["used"] is not None and cache["used"] != cache["path"]  # the fallback in the temp dir


def test_the_text_names_the_python_and_the_cache_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the report says where vLLM is found (the full text), in this process: nothing imported."""
    from vllm_hotfix.commands.status import format_text
    from vllm_hotfix.runtime import status as report

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("VLLMHOTFIX_CACHE_DIR", str(a_file))
    monkeypatch.setenv("VLLMHOTFIX_DISABLE", "1")
    lines = format_text(report.process_status()).splitlines()
    assert lines[0].endswith(f": {sys.executable})")
    assert "armed: " in lines[2] and lines[2].endswith("; every fix is disabled (VLLMHOTFIX_DISABLE)")
    (cache,) = [line for line in lines if line.startswith("cache directory:")]
    assert cache.startswith(f"cache directory: {a_file / 'generated'} NOT usable ({a_file} is a file")
    assert "set VLLMHOTFIX_CACHE_DIR to a directory of yours" in cache

    monkeypatch.setenv("VLLMHOTFIX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VLLMHOTFIX_DISABLE")
    lines = format_text(report.process_status()).splitlines()
    assert f"cache directory: {tmp_path / 'generated'} (usable)" in lines
    assert "every fix is disabled" not in lines[2]
