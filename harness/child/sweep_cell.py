"""One engine start of the sweep (harness/sweep.py): the workloads of several engine features, in sequence.

Starts vLLM's engine in this process (`LLM(...)`, compiled as vLLM decides; its workers, at TP > 1,
are processes of their own) with `extract_hidden_states` on the given ids and vLLM's
ExampleHiddenStatesConnector writing into a staging directory, as users make aux-state data, plus the
start's own LLM arguments (`--engine-kwargs`: chunked prefill with a small budget, a small KV cache,
TP=2, the in-place norm's IR op priority). Then it runs each workload named by `--workloads`:

- defaults: four prompts of 8 to 40 tokens, one `generate` call;
- mixed: prompts of 2, 9, 33, 90 and 170 tokens in one `generate` call (one batch);
- prefix: P (96 tokens), then in one call P again, S1 (P's first 64 tokens and 24 others), Q (40
  unrelated tokens) and S2 (P's first 64 and 8 others): a repeated prompt and shared prefixes in one step;
- chunked: prompts of 70, 100, 45 and 12 tokens, longer than the start's `max_num_batched_tokens`;
- abort: the engine's own step loop (harness/child/unfinished_prefill_files.py's): A (8 tokens), B (12)
  and L (100) added, one step, L aborted with `LLMEngine.abort_request` mid-prefill, steps until A and
  B are saved, then a few more;
- preempt: six prompts of 48 tokens with 24 tokens each to generate, more than the start's small KV
  cache holds at once (vLLM preempts and recomputes).

After each workload, its files are moved from the staging directory to OUT/<workload>/ (each once its
writer thread has released it). Prints `RESULT {json}`: per workload its requests (name, prompt,
whether it finished or was aborted, the file's name or None), the files left in staging that no
request of the workload owns, and how many times the scheduler preempted a request (its
`_preempt_request` calls, counted by a wrapper that changes nothing); whether the
hotfix was loaded and, if so, its decisions (its public `vllm_hotfix.status()`).

The connector's save path is CUDA-only: put harness/child/sites/cpu_connector on PYTHONPATH.

python harness/child/sweep_cell.py --checkpoint DIR --out DIR --ids 2,4 --workloads defaults,prefix
    [--engine-kwargs JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

BUDGET = 32  # the chunked start's max_num_batched_tokens (harness/sweep.py): L's first chunk is 12
EXTRA_STEPS = 4  # after the awaited files: time for any other write to land


def _tokens(generator: random.Random, n: int) -> list[int]:
    return [generator.randrange(1, 1000) for _ in range(n)]


def workload_prompts(name: str, seed: int = 0) -> list[list[tuple[str, list[int]]]]:
    """The workload's rounds, each one `generate` call of (request name, prompt)."""
    generator = random.Random(f"{name}-{seed}")
    if name == "defaults":
        return [[(f"d{i}", _tokens(generator, generator.randrange(8, 40))) for i in range(4)]]
    if name == "mixed":
        return [[(f"m{n}", _tokens(generator, n)) for n in (2, 9, 33, 90, 170)]]
    if name == "prefix":
        p = _tokens(generator, 96)
        s1, q, s2 = p[:64] + _tokens(generator, 24), _tokens(generator, 40), p[:64] + _tokens(generator, 8)
        return [[("P", p)], [("P-again", p), ("S1", s1), ("Q", q), ("S2", s2)]]
    if name == "chunked":
        return [[(f"c{n}", _tokens(generator, n)) for n in (70, 100, 45, 12)]]
    if name == "preempt":
        return [[(f"r{i}", _tokens(generator, 48)) for i in range(6)]]
    if name == "abort":
        return [[("A", _tokens(generator, 8)), ("B", _tokens(generator, 12)), ("L", _tokens(generator, 100))]]
    raise ValueError(f"no workload {name!r}")


MAX_TOKENS = {"preempt": 24}  # tokens generated per request; 3 elsewhere


def _wait(paths: list[str], step: object, rounds: int = 120) -> None:
    """Step the engine until every path exists (the connector saves a finished request at the next
    step), then wait on each file's lock, which its writer thread holds until saved."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    for _ in range(rounds):
        if all(os.path.exists(p) for p in paths):
            break
        step()  # type: ignore[operator]
        time.sleep(0.1)
    for path in paths:
        if os.path.exists(path):
            load_hidden_states(path)


def run_generate(llm: object, name: str, staging: str) -> list[dict]:
    """The workload's rounds through `LLM.generate`; per request its file (the connector's path)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS.get(name, 3), temperature=0.0)
    requests = []
    for batch in workload_prompts(name):
        prompts = [{"prompt_token_ids": prompt} for _, prompt in batch]
        outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
        paths = []
        for (request, prompt), output in zip(batch, outputs, strict=True):
            path = (output.kv_transfer_params or {}).get("hidden_states_path")
            paths.append(path) if path else None
            requests.append(
                {
                    "name": request,
                    "prompt": prompt,
                    "finished": bool(output.finished),
                    "aborted": False,
                    "cached": output.num_cached_tokens,
                    "staged": path,
                }
            )
        _wait(paths, llm.llm_engine.step)  # type: ignore[attr-defined]
    return requests


def run_abort(llm: object, staging: str) -> list[dict]:
    """A, B and L added, one step, L aborted mid-prefill, steps until A's and B's files are saved."""
    from vllm import SamplingParams

    engine = llm.llm_engine  # type: ignore[attr-defined]
    (batch,) = workload_prompts("abort")
    params = SamplingParams(max_tokens=3, temperature=0.0)
    ids = {name: engine.add_request(name, {"prompt_token_ids": prompt}, params) for name, prompt in batch}
    ids = {name: (rid if isinstance(rid, str) else name) for name, rid in ids.items()}
    finished = {o.request_id for o in engine.step() if o.finished}
    engine.abort_request(["L"])
    paths = {name: os.path.join(staging, f"{ids[name]}.safetensors") for name, _ in batch}
    for _ in range(200):
        finished |= {o.request_id for o in engine.step() if o.finished}
        done = all(name in finished or ids[name] in finished for name in ("A", "B"))
        if done and all(os.path.exists(paths[n]) for n in ("A", "B")):
            break
        time.sleep(0.1)
    for _ in range(EXTRA_STEPS):
        engine.step()
        time.sleep(0.25)
    _wait([p for p in paths.values() if os.path.exists(p)], engine.step, rounds=1)
    return [
        {
            "name": name,
            "prompt": prompt,
            "finished": name != "L",
            "aborted": name == "L",
            "cached": None,
            "staged": paths[name],
        }
        for name, prompt in batch
    ]


def count_preemptions(llm: object) -> list[int]:
    """A counter of the scheduler's preemptions (its `_preempt_request` calls; the engine core in this
    process), or an empty list where this release's scheduler has no such method."""
    counter: list[int] = []
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
        preempt = scheduler._preempt_request
    except AttributeError:
        return counter
    counter.append(0)

    def counting(*args: object, **kwargs: object) -> object:
        counter[0] += 1
        return preempt(*args, **kwargs)

    scheduler._preempt_request = counting  # an instance attribute: counts, changes nothing
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--workloads", required=True)
    parser.add_argument("--engine-kwargs", default="{}", help="a JSON object of LLM arguments to add")
    args = parser.parse_args()
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_MLA_DISABLE": "1"}.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    staging = os.path.join(args.out, "staging")
    os.makedirs(staging, exist_ok=True)
    ids = sorted(int(i) for i in args.ids.split(","))
    options = {
        "model": args.checkpoint,
        "dtype": "float32",
        "max_model_len": 256,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        },
        "kv_transfer_config": {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": staging},
        },
    }
    llm = LLM(**{**options, **json.loads(args.engine_kwargs)})
    workloads = {}
    counter = count_preemptions(llm)
    for name in args.workloads.split(","):
        before = set(os.listdir(staging))
        preempted = counter[0] if counter else None
        requests = run_abort(llm, staging) if name == "abort" else run_generate(llm, name, staging)
        target = os.path.join(args.out, name)
        os.makedirs(target, exist_ok=True)
        for request in requests:
            staged = request.pop("staged")
            request["file"] = None
            if staged and os.path.exists(staged):
                request["file"] = f"{request['name']}.safetensors"
                shutil.move(staged, os.path.join(target, request["file"]))
        # a file no request of this workload owns (the connector's `.lock` files aside): kept for the audit
        stray = sorted(n for n in set(os.listdir(staging)) - before if n.endswith(".safetensors"))
        for leftover in stray:
            shutil.move(os.path.join(staging, leftover), os.path.join(target, f"stray-{leftover}"))
        workloads[name] = {
            "requests": requests,
            "stray": stray,
            "preemptions": None if preempted is None else counter[0] - preempted,
        }
    result: dict = {"workloads": workloads, "hotfix": "vllm_hotfix" in sys.modules}
    if result["hotfix"]:
        import vllm_hotfix

        result["decisions"] = {f["fix"]: f["decision"] for f in vllm_hotfix.status()["fixes"]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
