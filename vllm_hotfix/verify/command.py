"""`vllm-hotfix verify MODEL`: start vLLM with extract_hidden_states and the check on, run a few
prompts, print the verdict per check and per rank; exit 0 on PASS, 1 on FAIL, 2 when nothing could
be checked.

The check itself runs in vLLM's workers (seam.py), armed there by the `vllm.general_plugins` entry
point that a pip install of vllm-hotfix registers (or its site hook): this command only sets the
switches, drives the engine and reads the workers' JSON reports.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import tempfile
import time
from typing import Any

from vllm_hotfix.verify import settings as verify_settings

EXIT_PASS, EXIT_FAIL, EXIT_UNKNOWN = 0, 1, 2


def default_ids(layers: int) -> list[int]:
    """The EAGLE3 convention (vLLM's default aux layers: 2, L // 2, L - 3) plus the final layer L.
    Id 0 is left out: vLLM's forwards have no residual before layer 0."""
    eagle3 = {i for i in (2, layers // 2, layers - 3) if 1 <= i < layers}
    return [*sorted(eagle3), layers]


def _layers(model: str, trust_remote_code: bool) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers)


def _plugin_reachable() -> bool:
    from importlib.metadata import entry_points

    from vllm_hotfix import site_hook

    names = {entry.value for entry in entry_points(group="vllm.general_plugins")}
    allowed = os.environ.get("VLLM_PLUGINS")
    plugin = "vllm_hotfix.plugin:register" in names and (
        allowed is None or "vllm_hotfix" in allowed.split(",")
    )
    return plugin or site_hook.installed_path() is not None


def _say(text: str) -> None:
    print(f"vllm-hotfix verify: {text}", file=sys.stderr, flush=True)


def _prompts(count: int, vocab: int) -> list[list[int]]:
    """Fixed token-id prompts (no tokenizer needed), 12 to 40 tokens, inside the vocabulary."""
    prompts = []
    for p in range(count):
        length = 12 + (7 * p) % 29
        prompts.append([(37 * p + 101 * t + 5) % max(vocab - 1, 2) + 1 for t in range(length)])
    return prompts


def read_reports(directory: str) -> list[dict[str, Any]]:
    reports = []
    for path in sorted(glob.glob(os.path.join(directory, "verify-*.json"))):
        with open(path, encoding="utf-8") as handle:
            reports.append(json.load(handle))
    return sorted(reports, key=lambda r: (r.get("rank") is None, r.get("rank") or 0, r["pid"]))


def format_reports(reports: list[dict[str, Any]]) -> str:
    lines = []
    for r in reports:
        agree, final = r["ranks_agree"], r["final"]
        lines.append(f"rank {r['rank']}/{r['world']} (pid {r['pid']}): {r['verdict']}")
        if r["model"] is not None:
            lines.append(
                f"  model {r['model']} ({r['model_class']}), ids {r['ids']}, vLLM {r['vllm_version']}"
            )
            lines.append(f"  steps checked: {r['steps']} of {r['steps_wanted']} (tokens {r['tokens']})")
        if r["steps"]:
            lines.append(
                f"  count and shape: {'ok' if r['count']['ok'] else 'FAIL: ' + r['count']['detail']}"
            )
            lines.append(
                f"  ranks agree: {'ok' if agree['ok'] else 'FAIL'} (max rel diff {agree['max_rel_diff']:.3g},"
                f" tolerance {agree['tolerance']:.0e}"
                + (f", worst at id {agree['worst_id']}" if agree["worst_id"] is not None else "")
                + ")"
            )
            lines.append(f"  finite: {'ok' if r['finite']['ok'] else 'FAIL'}")
            if final["ok"] is None:
                lines.append(f"  final id: not checked ({final['note']})")
            else:
                word = "ok" if final["ok"] else "FAIL"
                lines.append(f"  final id: {word} (max rel diff {final['max_rel_diff']:.3g})")
        if r["failed_ranks"]:
            lines.append(f"  failed on ranks: {r['failed_ranks']}")
        for key in ("note", "hint"):
            if r.get(key):
                lines.append(f"  {key}: {r[key]}")
    return "\n".join(lines)


def verdict(reports: list[dict[str, Any]], world: int) -> tuple[str, int]:
    verdicts = [r["verdict"] for r in reports]
    if "FAIL" in verdicts:
        return "FAIL", EXIT_FAIL
    if len(reports) >= world and verdicts and all(v == "PASS" for v in verdicts):
        return "PASS", EXIT_PASS
    return "UNKNOWN", EXIT_UNKNOWN


def run(args: argparse.Namespace) -> int:
    ids = [int(x) for x in args.ids.split(",")] if args.ids else None
    report_dir = args.report_dir or tempfile.mkdtemp(prefix="vllm-hotfix-verify-")
    os.environ[verify_settings.VERIFY_VAR] = str(args.steps)
    os.environ[verify_settings.REPORT_VAR] = report_dir
    if not _plugin_reachable():
        _say(
            "WARNING: vLLM's worker processes will not load vllm-hotfix (no `vllm.general_plugins`"
            " entry point of vllm_hotfix, or VLLM_PLUGINS filters it out, and no site hook): the"
            " check cannot run in them. Install vllm-hotfix with pip in vLLM's environment."
        )
    import vllm_hotfix  # noqa: F401  (arms this process: the engine core may run the model here)

    if ids is None:
        ids = default_ids(_layers(args.model, args.trust_remote_code))
    _say(
        f"starting vLLM with {args.model} (tensor parallel {args.tensor_parallel_size}, aux ids {ids},"
        f" {args.steps} checked steps); vLLM's own log follows. Reports: {report_dir}"
    )
    started = time.monotonic()
    error = None
    llm = None
    try:
        from vllm import LLM, SamplingParams

        options: dict[str, Any] = {}
        if args.max_model_len:
            options["max_model_len"] = args.max_model_len
        if args.dtype:
            options["dtype"] = args.dtype
        llm = LLM(
            model=args.model,
            tensor_parallel_size=args.tensor_parallel_size,
            enforce_eager=args.enforce_eager,
            trust_remote_code=args.trust_remote_code,
            seed=0,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
            },
            **options,
        )
        _say(f"vLLM started in {time.monotonic() - started:.0f} s; generating {args.prompts} prompt(s)")
        vocab = llm.llm_engine.model_config.get_vocab_size()
        llm.generate(
            [{"prompt_token_ids": p} for p in _prompts(args.prompts, vocab)],
            SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
    except Exception as caught:  # vLLM's own error: reported as such, with whatever the check saw
        error = f"{type(caught).__name__}: {caught}"
    reports = read_reports(report_dir)
    print(format_reports(reports) or "no worker reported a check")
    if error is not None:
        print(f"vLLM stopped with an error: {error}")
    name, code = verdict(reports, args.tensor_parallel_size)
    if name == "UNKNOWN" and error is None and not reports:
        print("no report came back: is vllm-hotfix armed in vLLM's workers (pip install; VLLM_PLUGINS)?")
    print(f"verdict: {name}" + (" (vLLM stopped with an error)" if error and name != "FAIL" else ""))
    sys.stdout.flush()
    sys.stderr.flush()
    if llm is not None:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
    os._exit(code)  # vLLM's engine processes may hold the interpreter's exit; the verdict is out


def _steps(text: str) -> int:
    value = int(text)
    if value < 2:  # VLLM_HOTFIX_VERIFY=1 means the default window, not one step
        raise argparse.ArgumentTypeError(f"{text!r}: check at least 2 steps")
    return value


def add_parser(commands: Any) -> None:
    verify = commands.add_parser(
        "verify",
        help="start vLLM on MODEL with the aux-state check on and say whether the states are right",
        description="Starts vLLM with the extract_hidden_states method and VLLM_HOTFIX_VERIFY on, runs a"
        " few prompts, prints per rank and per check (count and shape, ranks agree, finite, final id)"
        " the verdict of vLLM's own workers, and exits 0 on PASS, 1 on FAIL, 2 when nothing could be"
        " checked. VLLM_HOTFIX_STRICT=1 stops the engine at the first failed check.",
    )
    verify.add_argument("model", help="a checkpoint directory or a Hugging Face model id")
    verify.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    verify.add_argument(
        "--ids", help="aux layer ids, e.g. 2,30,58 (default: the EAGLE3 convention plus the final layer)"
    )
    verify.add_argument("--prompts", type=int, default=4, help="prompts to run (default 4)")
    verify.add_argument(
        "--steps", type=_steps, default=verify_settings.DEFAULT_STEPS, help="steps to check, >= 2 (default 8)"
    )
    verify.add_argument("--max-model-len", type=int, default=None)
    verify.add_argument("--dtype", default=None)
    verify.add_argument("--enforce-eager", action="store_true", help="no torch.compile, no CUDA graphs")
    verify.add_argument("--trust-remote-code", action="store_true")
    verify.add_argument(
        "--report-dir", help="where the workers write their JSON reports (default: a new temporary directory)"
    )
    verify.set_defaults(run=run)
