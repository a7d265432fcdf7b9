"""Test instrumentation for engine runs: record the aux hidden states where the consumer gets them.

Put this directory on PYTHONPATH and set VLLM_HOTFIX_CAPTURE_DIR: in every process (the launcher,
vLLM's engine core, each worker) the extract_hidden_states proposer's `propose` is wrapped to save
what it receives (`target_hidden_states`, one tensor per requested layer) and what it wrote into
its buffer, plus whether the hotfix had patched DeepseekV2Model in that process. It does not arm,
import or touch vllm_hotfix.
"""

import os

CAPTURE_DIR = os.environ.get("VLLM_HOTFIX_CAPTURE_DIR")

if CAPTURE_DIR:
    import wrapt

    def _instrument(module) -> None:
        import inspect
        import sys

        import torch

        cls = module.ExtractHiddenStatesProposer
        original = cls.propose
        signature = inspect.signature(original)
        calls = []

        def propose(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            states = bound.arguments["target_hidden_states"]
            record = {"received": [s.detach().clone().cpu() for s in states]}
            result = original(self, *args, **kwargs)
            tokens = states[0].shape[0]
            record["buffer"] = self.hidden_states[:tokens].detach().clone().cpu()
            deepseek = sys.modules.get("vllm.model_executor.models.deepseek_v2")
            forward = vars(deepseek.DeepseekV2Model).get("forward") if deepseek else None
            record["patched"] = hasattr(forward, "__vllm_hotfix__")
            record["pid"] = os.getpid()
            calls.append(record)
            torch.save(calls, os.path.join(CAPTURE_DIR, f"propose-{os.getpid()}.pt"))
            return result

        cls.propose = propose

    wrapt.register_post_import_hook(_instrument, "vllm.v1.spec_decode.extract_hidden_states")
