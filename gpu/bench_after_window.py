"""What the check leaves in a GPU engine after its window, timed: decode under CUDA graphs in an
engine whose window ended against the same engine never checked (issue 35, item 1). Run by
`bash gpu/check.sh bench` (GPU_CHECK_LOGS: where its JSON goes).

Both engines are resident at once, each a process of its own (the hotfix installed from its wheel
as vLLM's plugin in both, so only the check differs), vllm 0.24.0 in its default mode (compiled,
CUDA graphs), the tiny DeepSeek-V3 checkpoint, extract_hidden_states with ids 1,2,4. The checked
engine runs with VLLMHOTFIX_VERIFY=2: its window (2 steps) ends in the warm-up call, and its report
must say PASS with the graphs captured with the taps paused; the plain engine must write no report.
Then the rounds alternate one generate call in each (the order flips every round), timed inside each
process; the figure is the median ratio checked / plain with its 95% CI (harness/bench_results).
Separate processes differ by their own noise, so `--control` also times two plain engines against
each other. On CPU (no CUDA graphs) it runs the same way, as a dry run of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MARK = "BENCH-AFTER-WINDOW "  # prefixes the child's own lines on stdout, among vLLM's


def child(checkpoint: str, reports: str, tokens: int, gpu: bool) -> None:
    """One engine: start, warm up (the checked one's window ends here), then time a generate call per
    line read from stdin."""
    from vllm import SamplingParams

    from harness.checked_llm import PROMPT, checked_llm

    llm = checked_llm(checkpoint, dtype="bfloat16" if gpu else "float32", gpu_memory_utilization=0.3)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for _ in range(3):
        llm.generate(PROMPT, params, use_tqdm=False)
    found = [json.loads(p.read_text()) for p in Path(reports).glob("verify-*.json")]
    said = [{"verdict": r["verdict"], "cuda_graphs": r.get("cuda_graphs")} for r in found]
    print(MARK + json.dumps({"ready": True, "reports": said}), flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        llm.generate(PROMPT, params, use_tqdm=False)
        print(MARK + json.dumps({"seconds": time.perf_counter() - start}), flush=True)


class Engine:
    """A child engine process, spoken to line by line."""

    def __init__(self, side: str, command: list[str], env: dict[str, str], log: Path) -> None:
        self.side, self.log = side, log
        self.process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),  # kept open for the child's life
            text=True,
            start_new_session=True,  # its engine core goes with it (killpg)
        )

    def read(self) -> dict[str, Any]:
        out: IO[str] = self.process.stdout  # type: ignore[assignment]
        for line in out:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise SystemExit(f"{self.side}: the engine ended early; its log: {self.log}")

    def time_one(self) -> float:
        self.process.stdin.write("go\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        return float(self.read()["seconds"])

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per generate call")
    parser.add_argument("--control", action="store_true", help="also two plain engines, against each other")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # CHECKPOINT REPORTS TOKENS GPU
    args = parser.parse_args(argv)
    if args.child:
        checkpoint, reports, tokens, gpu = args.child
        child(checkpoint, reports, int(tokens), gpu == "1")
        return 0

    import torch

    from gpu.check_v2 import GPU
    from harness.bench_results import ratio_text, summary
    from harness.child.tiny_checkpoint import build
    from harness.testenv import BUG, TestEnv
    from harness.ways_in import install_plugin

    gpu = torch.cuda.is_available()
    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-gpu-bench-"))
    out = Path(os.environ.get("GPU_CHECK_LOGS") or work)
    plugin = install_plugin(testenv, work / "plugin")
    checkpoint = build(str(work / "tiny"), gpu_mla=gpu)
    # as gpu/check_v2.py's runs, less its oracle and its check (only the checked side has that)
    platform = {k: v for k, v in GPU.items() if not k.startswith("VLLMHOTFIX_")}
    sides = ["checked", "plain"] + (["plain-2"] if args.control else [])
    engines: dict[str, Engine] = {}
    try:
        for side in sides:
            reports = work / f"reports-{side}"
            env = {"VLLM_CACHE_ROOT": str(work / f"cache-{side}"), "VLLMHOTFIX_VERIFY_REPORT": str(reports)}
            env |= {"VLLMHOTFIX_VERIFY": "2"} if side == "checked" else {}
            env |= platform if gpu else {}
            command = [testenv.python, __file__, "--child", checkpoint, str(reports), str(args.tokens)]
            command.append("1" if gpu else "0")
            full_env = testenv.environ(BUG, paths=(plugin,), **env)
            engines[side] = Engine(side, command, full_env, out / f"bench-{side}.log")
            ready = engines[side].read()  # one at a time: each start sees the other's memory taken
            expected = ["PASS"] if side == "checked" else []
            if [r["verdict"] for r in ready["reports"]] != expected:
                raise SystemExit(f"{side}: the check reported {ready['reports']}, not {expected}")
            print(f"{side}: ready; reports {ready['reports']}", flush=True)
        times: dict[str, list[float]] = {side: [] for side in sides}
        for n in range(args.rounds):
            for side in sides if n % 2 == 0 else sides[::-1]:
                times[side].append(engines[side].time_one())
    finally:
        for engine in engines.values():
            engine.stop()
    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "torch": torch.__version__,
        "vllm": BUG,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "times_s": times,
    }
    pairs = [("checked", "plain", "checked/plain")]
    pairs += [("plain", "plain-2", "plain/plain-2 (control)")] if args.control else []
    for a, b, name in pairs:
        result[name] = summary([x / y for x, y in zip(times[a], times[b], strict=True)])
        medians = f"{summary(times[a])['median'] * 1e3:.1f} and {summary(times[b])['median'] * 1e3:.1f} ms"
        print(f"{name}: {ratio_text(result[name])}; medians {medians} a call of {args.tokens} tokens")
    (out / "bench-after-window.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
