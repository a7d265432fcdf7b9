"""Run the upstream patches' own test files (upstream/*/*.patch adds them to vLLM's tests/) in this
interpreter, without pytest (the vLLM venvs have none): each module-level `test_*` function is called
once with no arguments, as those tests are written. Prints `RESULT {"tests": {file: {name: "pass" |
"fail: ..."}}, "vllm": ...}`: which vLLM ran (stock, or an upstream patch's overlay first on
PYTHONPATH)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback


def run_file(path: str) -> dict[str, str]:
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = {}
    for name in sorted(n for n in vars(module) if n.startswith("test_")):
        try:
            getattr(module, name)()
            results[name] = "pass"
        except Exception as error:  # a failing test: its kind and first line
            detail = (str(error).strip().splitlines() or [""])[0][:300]
            results[name] = f"fail: {type(error).__name__}: {detail}"
            traceback.print_exc()
    return results


def main() -> None:
    import vllm

    results = {os.path.basename(path): run_file(path) for path in sys.argv[1:]}
    print("RESULT " + json.dumps({"vllm": vllm.__file__, "tests": results}))


if __name__ == "__main__":
    main()
