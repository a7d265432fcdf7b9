"""Test instrumentation for engine runs: record the aux hidden states where the consumer gets them.

Put this directory on PYTHONPATH and set VLLMHOTFIX_CAPTURE_DIR: in every process (the launcher,
vLLM's engine core, each worker) the extract_hidden_states proposer's `propose` is wrapped to save
what it receives (`target_hidden_states`, one tensor per requested layer) and what it wrote into
its buffer, plus whether the hotfix had patched DeepseekV2Model in that process. It does not arm,
import or touch vllm_hotfix.

With VLLMHOTFIX_ORACLE=1 it also records, in the same process and step, an oracle that does not
depend on the fix: the input and the output of the backbone's final norm (`model.norm`), taken by
a forward pre-hook and a forward hook registered on that module when the model is built
(DeepseekV2Model, DeepseekV32Model). The pre-hook writes `hidden_states + residual`, the pre-norm
sum the final aux state must equal, the hook the norm's output, the model's output. Both hooks
write into buffers registered on the norm through one custom op that mutates its buffer argument,
so the writes are traced into vLLM's compiled graph and captured in its CUDA graphs like any other
kernel, with no Python side effect at run time; the proposer's wrapper reads the first rows (this
step's tokens) right when it is called, after this step's forward, and names the backbone class the
process built (`backbone`: which model file vLLM chose). The record of a call is saved
before vLLM's own `propose` runs, so a run that then crashes (the bug) still leaves its states.
"""

import os

CAPTURE_DIR = os.environ.get("VLLMHOTFIX_CAPTURE_DIR")
ORACLE = os.environ.get("VLLMHOTFIX_ORACLE") == "1"
_ORACLES = []  # (pre-norm sum buffer, norm output buffer) of each backbone built in this process
_BACKBONES = []  # "module.Class" of each instrumented backbone built in this process

if CAPTURE_DIR:
    import sys

    import wrapt

    # harness/child, last on sys.path: the op helper shared with the oracle site.
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from custom_ops import custom_op

    def _oracle_op():
        import torch

        def record(x: torch.Tensor, out: torch.Tensor) -> None:
            out[: x.shape[0]].copy_(x)

        return custom_op("vllm_hotfix_oracle::record", record, lambda x, out: None, mutates_args=("out",))

    def _instrument_backbone(module, class_name):
        import torch
        from vllm.config import get_current_vllm_config

        record = _oracle_op()
        cls = getattr(module, class_name)
        original_init = cls.__init__

        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            _BACKBONES.append(f"{cls.__module__}.{class_name}")
            norm = getattr(self, "norm", None)
            weight = getattr(norm, "weight", None)
            if weight is None:  # not the last pipeline rank
                return
            rows = get_current_vllm_config().scheduler_config.max_num_batched_tokens
            shape = (rows, weight.shape[0])
            norm.register_buffer(
                "_oracle_pre", torch.zeros(shape, dtype=weight.dtype, device=weight.device), False
            )
            norm.register_buffer(
                "_oracle_out", torch.zeros(shape, dtype=weight.dtype, device=weight.device), False
            )

            def pre_hook(mod, args):
                hidden_states, residual = args[0], args[1] if len(args) > 1 else None
                total = hidden_states if residual is None else hidden_states + residual
                record(total, mod._oracle_pre)

            def hook(mod, args, output):
                record(output[0] if isinstance(output, tuple) else output, mod._oracle_out)

            norm.register_forward_pre_hook(pre_hook)
            norm.register_forward_hook(hook)
            _ORACLES.append((norm._oracle_pre, norm._oracle_out))

        cls.__init__ = __init__

    def _instrument(module) -> None:
        import inspect
        import sys

        import torch

        cls = module.ExtractHiddenStatesProposer
        original = cls.propose
        signature = inspect.signature(original)
        calls = []
        path = os.path.join(CAPTURE_DIR, f"propose-{os.getpid()}.pt")

        def propose(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            states = bound.arguments["target_hidden_states"]
            record = {"received": [s.detach().clone().cpu() for s in states]}
            sampled = bound.arguments.get("sampled_token_ids")
            if isinstance(sampled, torch.Tensor):  # rows of 2 valid tokens: an accepted proposal
                record["sampled"] = sampled.detach().cpu().tolist()
            tokens = states[0].shape[0]
            if ORACLE and _ORACLES:
                pre, out = _ORACLES[-1]
                record["oracle_pre_norm_sum"] = pre[:tokens].clone().cpu()
                record["oracle_norm_output"] = out[:tokens].clone().cpu()
                record["oracle_backbones"] = len(_ORACLES)
                record["backbone"] = _BACKBONES[-1] if _BACKBONES else None
            calls.append(record)
            if ORACLE:
                torch.save(calls, path)  # kept if vLLM's propose raises (the bug)
            result = original(self, *args, **kwargs)
            record["buffer"] = self.hidden_states[:tokens].detach().clone().cpu()
            deepseek = sys.modules.get("vllm.model_executor.models.deepseek_v2")
            forward = vars(deepseek.DeepseekV2Model).get("forward") if deepseek else None
            record["patched"] = hasattr(forward, "__vllm_hotfix__")
            v32 = sys.modules.get("vllm.models.deepseek_v32.nvidia.model")
            forward = vars(v32.DeepseekV32Model).get("forward") if v32 else None
            record["patched_v32"] = hasattr(forward, "__vllm_hotfix__")
            prepare = vars(cls).get("prepare_next_token_ids_padded")
            record["patched_next_token"] = hasattr(prepare, "__vllm_hotfix__")
            record["pid"] = os.getpid()
            torch.save(calls, path)
            return result

        cls.propose = propose

    wrapt.register_post_import_hook(_instrument, "vllm.v1.spec_decode.extract_hidden_states")
    if ORACLE:
        wrapt.register_post_import_hook(
            lambda m: _instrument_backbone(m, "DeepseekV2Model"), "vllm.model_executor.models.deepseek_v2"
        )
        wrapt.register_post_import_hook(
            lambda m: _instrument_backbone(m, "DeepseekV32Model"), "vllm.models.deepseek_v32.nvidia.model"
        )
