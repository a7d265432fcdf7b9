"""The generated function: a plain function in the original's namespace, its source in a file
named by its content hash, safe when several processes write it, and still correct without any
writable directory."""

from __future__ import annotations

import inspect
import sys
import threading
import types
from pathlib import Path

from vllm_hotfix.runtime import codegen, store

SOURCE = "def scale(x, factor=2):\n    return x * factor + OFFSET\n"
FIXED = "def scale(x, factor=2):\n    return x * factor + OFFSET + 1\n"


def original_function() -> types.FunctionType:
    namespace = {"OFFSET": 10, "__name__": "example_module"}
    exec(compile(SOURCE, "example_module.py", "exec"), namespace)
    return namespace["scale"]


def build(directories: list[store.Place]) -> codegen.Generated:
    original = original_function()
    return codegen.build_function(
        fix_id="example-fix",
        original=original,
        namespace=original.__globals__,
        source=FIXED,
        qualname_base="scale",
        provenance="a test",
        directories=directories,
    )


def test_generated_function_lives_in_a_content_named_file(tmp_path: Path) -> None:
    generated = build([store.Place(str(tmp_path))])
    function = generated.function
    assert type(function) is types.FunctionType and function(1) == 13  # OFFSET from the namespace
    assert function.__globals__["OFFSET"] == 10
    path = Path(generated.filename)
    assert path.parent == tmp_path and path.name == f"example_fix_{generated.digest}.py"
    assert path.read_text().endswith(FIXED) and "vllm-hotfix" in path.read_text()
    assert function.__code__.co_filename == str(path)
    assert function.__qualname__ == f"scale__vllm_hotfix_example_fix_{generated.digest}"
    assert sys.modules[generated.module_name].__file__ == str(path)
    assert inspect.getsourcefile(sys.modules[generated.module_name]) == str(path)
    assert function.__wrapped__.__code__.co_filename == "example_module.py"


def test_concurrent_writers_leave_one_identical_file(tmp_path: Path) -> None:
    results: list[codegen.Generated] = []
    threads = [
        threading.Thread(target=lambda: results.append(build([store.Place(str(tmp_path))]))) for _ in range(8)
    ]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len({r.filename for r in results}) == 1
    assert [p.name for p in tmp_path.iterdir()] == [Path(results[0].filename).name]  # no temp files left


def test_no_writable_directory_still_gives_a_correct_function(tmp_path: Path) -> None:
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    generated = build([store.Place(str(blocked / "sub"))])
    assert generated.filename.startswith("<") and generated.function(1) == 13
    assert inspect.getsource(generated.function.__code__) == FIXED
