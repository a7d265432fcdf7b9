"""The check's one contact with vLLM: module hooks on the model its engine asked for aux states.

In each process of the command's engine, the model class the command named gets a
`set_aux_hidden_state_layers` that calls the inherited one, then attaches the taps and a forward
hook that records every forward to the report directory. vLLM's runner calls it on the target model
only, before any forward, compile or capture. Never raises into vLLM.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import threading
import types
from typing import Any

from vllm_hotfix.judging import engine_facts as runtime
from vllm_hotfix.runtime import containment, settings

SETTER = "set_aux_hidden_state_layers"
_lock = threading.Lock()
_armed = {"done": False}


def arm() -> None:
    """In a process of the command's engine: a post-import hook on the named class's module."""
    found = settings.read_verify()
    with _lock:
        if not found.armed or _armed["done"]:
            return
        _armed["done"] = True
    import wrapt

    from vllm_hotfix.check import inductor_order

    module_name, _, class_name = str(found.model).partition(":")
    wrapt.register_post_import_hook(lambda module: _on_import(module, class_name), module_name)
    wrapt.register_post_import_hook(inductor_order.on_import, inductor_order.MODULE)


def _on_import(module: types.ModuleType, class_name: str) -> None:
    try:
        cls = getattr(module, class_name, None)
        inherited = getattr(cls, SETTER, None)
        if not isinstance(cls, type) or not callable(inherited) or getattr(inherited, "_vllm_hotfix", False):
            return

        def set_aux_hidden_state_layers(self: Any, layers: Any) -> Any:
            result = inherited(self, layers)
            try:
                Recorder(self, [int(i) for i in layers])
                attach_worker(self, [int(i) for i in layers])
            except Exception as error:
                containment.report_error("verify: the model not hooked", error)
            return result

        set_aux_hidden_state_layers._vllm_hotfix = True  # type: ignore[attr-defined]
        set_aux_hidden_state_layers.__qualname__ = f"{class_name}.{SETTER}"
        setattr(cls, SETTER, set_aux_hidden_state_layers)
    except Exception as error:
        containment.report_error("verify: not armed", error)


def attach_worker(model: Any, ids: list[int]) -> None:
    """The module the command named in WORKER_VAR (`vllm-hotfix audit` names its worker) attaches
    to the model too; by name, so that the check imports nothing of the commands that use it."""
    name = os.environ.get(settings.WORKER_VAR, "")
    if not name:
        return
    if not name.startswith("vllm_hotfix."):
        raise ValueError(f"{settings.WORKER_VAR}={name!r}: not a module of vllm_hotfix")
    importlib.import_module(name).attach(model, ids)


class Recorder:
    """The hooks on one target model and what they write: facts once, a record per forward."""

    def __init__(self, model: Any, ids: list[int]) -> None:
        from vllm_hotfix.check import taps as taps_mod

        found = settings.read_verify()
        self.ids = ids
        self.max_tokens = found.tokens
        self.holder = next((sub for sub in model.modules() if taps_mod.aux_ids(sub)), None)
        self.hidden_size = taps_mod.hidden_size(model)
        config = getattr(model, "config", None)
        layers = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers", None)
        self.taps = None
        if self.holder is not None and self.hidden_size is not None:
            self.taps = taps_mod.attach(model, self.hidden_size, self.max_tokens, ids)
        ranks = runtime.ranks()
        self.steps = 0
        name = f"dp{ranks['dp']}-pp{ranks['pp']}-tp{ranks['tp']}-{socket.gethostname()}-{os.getpid()}"
        self.directory = os.path.join(str(found.report_dir), str(found.run_id), name)
        os.makedirs(self.directory, exist_ok=True)
        holder = self.holder if self.holder is not None else model
        vllm = sys.modules.get("vllm")
        self.facts: dict[str, Any] = {
            "run_id": found.run_id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            **ranks,
            "model": type(model).__name__,
            "model_class": f"{type(holder).__module__}.{type(holder).__qualname__}",
            "ids": ids,
            "final_id": int(layers) if isinstance(layers, int) else None,
            "vllm_version": getattr(vllm, "__version__", None),
            "compilation": runtime.compilation(),
            "hint": None,
        }
        self._write_facts()
        model.register_forward_hook(self.after_forward)

    def _write_facts(self) -> None:
        path = os.path.join(self.directory, "facts.json")
        with open(f"{path}.tmp", "w", encoding="utf-8") as out:
            json.dump(self.facts, out, indent=2)
        os.replace(f"{path}.tmp", path)

    def after_forward(self, module: Any, args: Any, output: Any) -> None:
        """Every forward that returns aux states: its record. vLLM's dummy forwards (memory profile,
        warm-ups, an idle data-parallel rank) run on inputs that are no one's (states up to 1e28 on
        the tests' tiny model): not checked."""
        if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], (list, tuple))):
            return None  # an earlier pipeline stage's intermediate tensors
        if runtime.dummy_forward():
            return None
        try:
            self.write(output[0], output[1])
        except Exception as error:  # never break the host: the command sees the error, not a PASS
            containment.report_error("verify: a forward not recorded", error)

    def write(self, hidden_states: Any, aux: Any) -> None:
        import torch

        from vllm_hotfix.check import checks

        if self.hidden_size is None:
            unreadable = {"stage": "step", "message": "the model's hidden size is not readable"}
            found: dict[str, Any] = {"error": unreadable}
        else:
            found = checks.record(aux, hidden_states, self.ids, self.hidden_size, self.max_tokens, self.taps)
        self.steps += 1
        path = os.path.join(self.directory, f"step-{self.steps:06d}.pt")
        torch.save(found, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
        if self.steps == 1:  # the fixes have decided by now, and inductor has scheduled
            from vllm_hotfix.check import inductor_order

            said = None if self.holder is None else hint(type(self.holder))
            self.facts.update(hint=said, inductor_order=dict(inductor_order.outcome) or None)
            self._write_facts()


def hint(model_class: type) -> str:
    """What to do after a FAIL: the fix that covers the module of `model_class` (the one holding
    the aux ids), or one whose owner it inherits the method from (vLLM's shared capture helper in
    Llama's, Qwen's, gpt-oss's backbone), with its decision in this process; or how to report it."""
    from vllm_hotfix.fixes import ALL_FIXES
    from vllm_hotfix.runtime import arming

    report = "please report it to vllm-hotfix's maintainers with this output and `vllm-hotfix status --json`"
    for fix in ALL_FIXES:
        owner = next((k for k in model_class.__mro__ if fix.attribute in vars(k)), object)
        inherits = (owner.__module__, owner.__name__) == (fix.module, getattr(fix, "owner", None))
        if fix.module != model_class.__module__ and not inherits:
            continue
        decision = getattr(getattr(arming.records().get(fix.fix_id), "decision", None), "value", "pending")
        if decision == "patched":
            return f"fix {fix.fix_id} is applied here and the states are still wrong: not covered; {report}"
        return (
            f"fix {fix.fix_id} covers {model_class.__module__} and its decision here is {decision!r}: see"
            f" `vllm-hotfix status` (VLLMHOTFIX_DISABLE, VLLMHOTFIX_FORCE); otherwise {report}"
        )
    return f"not covered by any vllm-hotfix fix: {report}"
