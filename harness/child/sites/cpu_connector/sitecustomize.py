"""Test instrumentation: ExampleHiddenStatesConnector's save path on CPU, in every process.

Put this directory on PYTHONPATH of a `vllm serve` (or any engine) that writes hidden states with
ExampleHiddenStatesConnector: when the connector's module is imported (in the engine core, which
the CPU platform starts by spawn, so a patch in the launcher would not reach it), its CUDA
stream/event copies are replaced for good by harness/child/cuda_copies_on_cpu.py's synchronous
stand-in, which keeps their contract. Nothing else of vLLM is touched; vllm_hotfix is never imported.
"""

import os
import sys

import wrapt

# harness/child, last on sys.path: the stand-in, shared with tests that drive the connector in-process.
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


_HELD = []  # the entered contexts: one collected by the garbage collector would put the real torch back


def _on_cpu(module) -> None:
    from cuda_copies_on_cpu import cuda_copies_on_cpu

    context = cuda_copies_on_cpu(module)
    context.__enter__()  # for the life of the process: never exited
    _HELD.append(context)


wrapt.register_post_import_hook(
    _on_cpu, "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
)
