"""The GPU checks' offline bundle: what an air-gapped CUDA machine (no network; files brought in by
hand, in parts under 60 MiB for channels that limit file sizes) must receive to run
gpu/check_v2.py and gpu/check_v32.py, and how it is unpacked and installed.

Subcommands (docs/gpu-runbook.md says when each runs):

- `prepare` (here, with PyPI): downloads the vllm CUDA wheels of VLLM_VERSIONS, writes a slim copy of
  each (every Python file, only the compiled extensions in KEEP_BINARIES, uncompressed so that the
  three releases' near-identical kernels compress together), downloads the dependency wheels pinned
  in gpu/requirements.txt, packs everything into one tar compressed with zstd (long
  window), and splits it into parts under 60 MiB in gpu-bundle/ with gpu-bundle/manifest.json
  (sha256 and size of every part, of the archive and of every file in it);
- `assemble` (there; standard library plus zstd or the carried `zstandard` wheel): checks every
  part's sha256, joins them, checks the archive's sha256, unpacks it, checks every file's sha256;
- `install` (there): a venv whose only preinstalled packages are the base Python's (its torch), with
  vllm 0.24.0 and the dependency wheels installed by `pip install --no-index --find-links`, and
  0.25.0 and 0.26.0 as PYTHONPATH overlays (`--target`): the layout harness/testenv.py expects;
- `stage` (there): checks the parts that arrived and moves them out of the working tree (to
  GPU_BUNDLE_STAGE, default ~/hotfix-bundle), once per part as they arrive or once for all.

Only the standard library is imported at module level: `stage`, `assemble` and `install` run with
the GPU machine's bare python3 before anything is installed.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLE_DIR = REPO / "gpu-bundle"
LOCK = Path(__file__).resolve().parent / "requirements.txt"
CACHE = Path(os.environ.get("VLLMHOTFIX_GPU_CACHE", Path.home() / ".cache" / "vllm-hotfix" / "gpu-prepare"))
# On the GPU machine, outside the working tree.
STAGE = os.environ.get("GPU_BUNDLE_STAGE") or str(Path.home() / "hotfix-bundle")

# 0.24.0: the DeepseekV2Model bug; 0.25.0: the upstream fix (reference); 0.26.0: the newest vllm whose
# torch pin is torch==2.11.0 (the GPU machine's torch), for the DeepseekV32Model check.
BUG, FIXED, V32 = "0.24.0", "0.25.0", "0.26.0"
VLLM_VERSIONS = (BUG, FIXED, V32)
PYTHON = "3.12"  # the air-gapped machine's python3 must be 3.12: the bundle holds cp312 wheels
# glibc 2.36 at most: the dry run installs the same wheels here (Debian 12); the GPU machine has 2.39.
PLATFORMS = (
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
PART_BYTES = 57 * 2**20  # + the working tree (~0.5 MiB) + manifest + tools stays under 64 MiB a call
ZSTD_LEVEL = 12  # measured: 187 MiB, 4 parts, ~8 min on 2 shared cores; the window does the work
ZSTD_WINDOW_LOG = 30  # 1 GiB: the three releases' extensions (~0.8 GiB raw) fall in one window
TOOLS = ("zstandard==0.25.0",)  # unpacks the archive where no zstd program is installed

# The compiled extensions the checks load (vllm/platforms/cuda.py, vllm_flash_attn, the MLA
# backends); every other extension is left out (their imports are optional: a logged warning).
# - _C_stable_libtorch: vLLM's ops; _flashmla_C (+ extension): FlashMLA, dense and sparse (the only
#   DSA backend on SM90); vllm_flash_attn/_vllm_fa3_C: FlashAttention 3, which on SM90 is the only
#   MLA prefill backend (v1/attention/backends/mla/prefill/selector.py) and the first MLA decode
#   backend (FLASH_ATTN_MLA); cumem_allocator, spinloop, fs_io_C: tiny, imported when present.
# Left out: _vllm_fa2_C (FA2, not chosen on SM90), _moe_C_stable_libtorch (the checkpoints are
# dense), _qutlass_C, _rust_tool_parser, the vllm-rs binary, third_party/fmha_sm100 (SM100).
KEEP_BINARIES = frozenset(
    {
        "vllm/_C_stable_libtorch.abi3.so",
        "vllm/_flashmla_C.abi3.so",
        "vllm/_flashmla_extension_C.abi3.so",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
        "vllm/cumem_allocator.abi3.so",
        "vllm/spinloop.abi3.so",
        "vllm/fs_io_C.abi3.so",
    }
)
# The V3.2 indexer runs DeepGEMM (vendored, JIT-compiled with the machine's nvcc at run time).
V32_EXTRA = ("vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",)
DROP_PREFIXES = ("vllm/vllm-rs", "vllm/third_party/fmha_sm100/")
DEEP_GEMM_HEAVY = ("vllm/third_party/deep_gemm/include/",)


def say(message: str) -> None:
    print(f"[gpu-bundle] {message}", file=sys.stderr, flush=True)


def sha256_file(path: Path, chunk: int = 8 * 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# -- prepare (here) ---------------------------------------------------------------------------------


def keep_member(version: str, name: str) -> bool:
    """Whether the slim wheel of `version` keeps the member `name` of the original wheel."""
    if name.endswith(".dist-info/RECORD"):
        return False  # rewritten
    if name.startswith(DROP_PREFIXES):
        return False
    if name.startswith(DEEP_GEMM_HEAVY) and version != V32:
        return False
    if ".so" in Path(name).name:
        return name in KEEP_BINARIES or (version == V32 and name in V32_EXTRA)
    return True


def _record_line(name: str, data: bytes) -> str:
    """One RECORD row (a CSV row: vLLM has file names with commas, which must be quoted)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    row = io.StringIO()
    csv.writer(row, lineterminator="").writerow([name, f"sha256={digest}", len(data)])
    return row.getvalue()


def slim_wheel(source: Path, out_dir: Path, version: str) -> Path:
    """Write the slim copy of a vllm wheel (same name), members stored uncompressed, RECORD rewritten."""
    out = out_dir / source.name
    records = []
    kept = dropped = 0
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for info in sorted(src.infolist(), key=lambda i: i.filename):
            if info.is_dir():
                continue
            if not keep_member(version, info.filename):
                dropped += info.file_size
                continue
            data = src.read(info)
            member = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            member.external_attr = info.external_attr
            dst.writestr(member, data)
            records.append(_record_line(info.filename, data))
            kept += len(data)
        records.append(f"{record_name},,")  # a plain name: no comma in it
        member = zipfile.ZipInfo(record_name, date_time=(1980, 1, 1, 0, 0, 0))
        dst.writestr(member, "\n".join(records) + "\n")
    say(f"{source.name}: kept {kept / 2**20:.0f} MiB, left out {dropped / 2**20:.0f} MiB")
    return out


def _pip_download(dest: Path, requirements: Iterable[str], python_version: str = PYTHON) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    command += ["--no-deps", "--only-binary=:all:", "--implementation", "cp"]
    command += ["--python-version", python_version, *platforms, "-d", str(dest), *requirements]
    subprocess.run(command, check=True)


def lock_requirements(lock: Path = LOCK) -> list[str]:
    """The pinned dependency wheels (name==version), comments and blank lines left out."""
    lines = [line.split("#", 1)[0].strip() for line in lock.read_text().splitlines()]
    return [line for line in lines if line]


def _deterministic_tar(files: list[tuple[str, Path]], out: Path) -> None:
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for arcname, path in sorted(files):
            info = tar.gettarinfo(str(path), arcname)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o644
            with open(path, "rb") as handle:
                tar.addfile(info, handle)


def is_current(out_dir: Path = BUNDLE_DIR) -> bool:
    """Whether out_dir holds a complete bundle made from this recipe (lock, releases, part size)."""
    try:
        manifest = json.loads((out_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    recipe = (
        manifest.get("lock"),
        manifest.get("vllm"),
        manifest.get("keep_binaries"),
        manifest.get("part_bytes"),
    )
    if recipe != (lock_requirements(), list(VLLM_VERSIONS), sorted(KEEP_BINARIES), PART_BYTES):
        return False
    files = [*manifest["parts"], *manifest["tools"]]
    return all((out_dir / f["name"]).is_file() for f in files) and all(
        (out_dir / p["name"]).stat().st_size == p["size"] for p in manifest["parts"]
    )


def prepare(out_dir: Path = BUNDLE_DIR, cache: Path = CACHE, level: int = ZSTD_LEVEL) -> dict:
    """Download, slim, pack, split; return the manifest (also written to out_dir/manifest.json)."""
    if shutil.which("zstd") is None:
        raise SystemExit("prepare needs the zstd program (Debian/Ubuntu: apt-get install zstd)")
    downloads = cache / "vllm"
    staging = cache / "staging"
    downloads.mkdir(parents=True, exist_ok=True)
    for version in VLLM_VERSIONS:
        if not list(downloads.glob(f"vllm-{version}-*.whl")):
            say(f"downloading vllm=={version} (CUDA wheel, ~270 MiB)")
            _pip_download(downloads, [f"vllm=={version}"])
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "wheels" / "deps").mkdir(parents=True)
    for version in VLLM_VERSIONS:
        (wheel,) = downloads.glob(f"vllm-{version}-*.whl")
        slim_wheel(wheel, staging / "wheels", version)
    deps = cache / f"deps-cp{PYTHON.replace('.', '')}"
    deps.mkdir(parents=True, exist_ok=True)
    say(f"downloading {len(lock_requirements())} dependency wheels for Python {PYTHON}")
    _pip_download(deps, lock_requirements())
    wanted = {_norm(r.split("==")[0]): r.split("==")[1] for r in lock_requirements()}
    for wheel in sorted(deps.glob("*.whl")):
        name, version = _wheel_name_version(wheel.name)
        if wanted.get(name) == version:
            shutil.copy2(wheel, staging / "wheels" / "deps" / wheel.name)
    got = {_wheel_name_version(w.name)[0] for w in (staging / "wheels" / "deps").glob("*.whl")}
    missing = sorted(set(wanted) - got)
    if missing:
        raise SystemExit(f"no wheel downloaded for {missing}")
    tools = cache / "tools"
    tools.mkdir(parents=True, exist_ok=True)
    _pip_download(tools, list(TOOLS))

    recipe = {
        "python": PYTHON,
        "vllm": list(VLLM_VERSIONS),
        "keep_binaries": sorted(KEEP_BINARIES),
        "part_bytes": PART_BYTES,
        "lock": lock_requirements(),
    }
    return pack(staging, sorted(tools.glob("*cp312*.whl")), out_dir, cache, recipe, level)


def pack(
    staging: Path,
    tools: list[Path],
    out_dir: Path,
    work: Path,
    recipe: dict,
    level: int = ZSTD_LEVEL,
    part_bytes: int = PART_BYTES,
) -> dict:
    """Tar every file under `staging` (deterministically), compress it with zstd (long window), split
    it into parts of `part_bytes` in `out_dir`, copy `tools` to out_dir/tools; write and return the
    manifest (the recipe, then sha256 and size of every part, of the archive and of every file)."""
    files = [(str(p.relative_to(staging)), p) for p in sorted(staging.rglob("*")) if p.is_file()]
    tar_path = work / "bundle.tar"
    archive = work / "bundle.tar.zst"
    say(f"packing {len(files)} files ({sum(p.stat().st_size for _, p in files) / 2**20:.0f} MiB)")
    _deterministic_tar(files, tar_path)
    say(f"compressing with zstd -{level} --long={ZSTD_WINDOW_LOG} (minutes)")
    subprocess.run(
        ["nice", "-n", "10", "zstd", "-q", "-f", f"-{level}", f"--long={ZSTD_WINDOW_LOG}", "-T2"]
        + (["--ultra"] if level > 19 else [])
        + [str(tar_path), "-o", str(archive)],
        check=True,
    )
    tar_path.unlink()

    shutil.rmtree(out_dir, ignore_errors=True)
    (out_dir / "tools").mkdir(parents=True)
    parts = []
    with open(archive, "rb") as handle:
        index = 0
        while block := handle.read(part_bytes):
            part = out_dir / f"part-{index:02d}"
            part.write_bytes(block)
            parts.append({"name": part.name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
            index += 1
    tool_files = []
    for wheel in tools:
        shutil.copy2(wheel, out_dir / "tools" / wheel.name)
        tool_files.append({"name": f"tools/{wheel.name}", "sha256": sha256_file(wheel)})
    manifest = {
        "format": 1,
        **recipe,
        "archive": {
            "name": archive.name,
            "size": archive.stat().st_size,
            "sha256": sha256_file(archive),
            "zstd_window_log": ZSTD_WINDOW_LOG,
        },
        "parts": parts,
        "tools": tool_files,
        "contents": [
            {"name": name, "size": path.stat().st_size, "sha256": sha256_file(path)} for name, path in files
        ],
    }
    archive.unlink()
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    say(
        f"{len(parts)} parts in {out_dir}: "
        + ", ".join(f"{p['name']} {p['size'] / 2**20:.1f} MiB" for p in parts)
        + f"; archive {manifest['archive']['size'] / 2**20:.1f} MiB, sha256 {manifest['archive']['sha256']}"
    )
    return manifest


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _wheel_name_version(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return _norm(name), version


# -- on the GPU machine (and in the dry run) ----------------------------------------------------------


def stage(incoming: Path, manifest: dict, stage_dir: Path) -> None:
    """Check the parts (and tools) that arrived in `incoming` against the manifest and move them to
    `stage_dir`, outside the working tree; print what is there and what is still to send."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    expected = {p["name"]: p for p in manifest["parts"]}
    for part in sorted(incoming.glob("part-*")):
        entry = expected.get(part.name)
        digest = sha256_file(part)
        if entry is None or digest != entry["sha256"] or part.stat().st_size != entry["size"]:
            raise SystemExit(f"{part.name}: sha256 {digest}, size {part.stat().st_size}; expected {entry}")
        shutil.move(str(part), stage_dir / part.name)
        print(f"staged {part.name}: sha256 ok")
    for tool in manifest["tools"]:
        arrived = incoming / tool["name"]
        if arrived.exists():
            if sha256_file(arrived) != tool["sha256"]:
                raise SystemExit(f"{tool['name']}: sha256 mismatch")
            (stage_dir / "tools").mkdir(exist_ok=True)
            shutil.move(str(arrived), stage_dir / tool["name"])
            print(f"staged {tool['name']}: sha256 ok")
    have = sorted(p.name for p in stage_dir.glob("part-*"))
    missing = [name for name in expected if name not in have]
    tools = [t["name"] for t in manifest["tools"] if not (stage_dir / t["name"]).exists()]
    print(f"{len(have)}/{len(expected)} parts staged in {stage_dir}: {' '.join(have) or 'none'}")
    print(f"STILL TO SEND: {' '.join(missing + tools) or 'nothing'}")


def _open_zstd_reader(archive: Path, tools: list[Path]):
    """A readable stream of the decompressed archive: the zstd program, else the zstandard wheel."""
    window = "--long=31"  # lets zstd use a window up to 2 GiB (the archive's is 1 GiB)
    if shutil.which("zstd") and os.environ.get("VLLMHOTFIX_NO_ZSTD_PROGRAM") != "1":
        process = subprocess.Popen(["zstd", "-d", "-q", "-c", window, str(archive)], stdout=subprocess.PIPE)
        return process.stdout, process
    unpacked = Path(tempfile.mkdtemp(prefix="zstandard-"))
    for wheel in tools:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(unpacked)
    sys.path.insert(0, str(unpacked))
    import zstandard

    return zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(open(archive, "rb")), None


def assemble(parts_dir: Path, manifest: dict, out_dir: Path, tools_dir: Path) -> None:
    """Check every part, join them, check the archive, unpack it into out_dir, check every file."""
    parts = [parts_dir / p["name"] for p in manifest["parts"]]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise SystemExit(f"parts missing in {parts_dir}: {' '.join(missing)}")
    for part, entry in zip(parts, manifest["parts"], strict=True):
        if sha256_file(part) != entry["sha256"]:
            raise SystemExit(f"{part.name}: sha256 mismatch")
    archive = parts_dir / manifest["archive"]["name"]
    digest = hashlib.sha256()
    with open(archive, "wb") as out:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != manifest["archive"]["sha256"]:
        raise SystemExit(
            f"{archive.name}: sha256 {digest.hexdigest()}, expected {manifest['archive']['sha256']}"
        )
    print(f"archive {archive.name}: {len(parts)} parts joined, sha256 {digest.hexdigest()} ok")
    for part in parts:
        part.unlink()  # the archive holds the same bytes
    tools = [tools_dir / Path(t["name"]).name for t in manifest["tools"]]
    stream, process = _open_zstd_reader(archive, tools)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            if not member.isfile() or member.name.startswith(("/", "..")) or "/../" in member.name:
                raise SystemExit(f"unexpected member {member.name!r}")
            tar.extract(member, out_dir, set_attrs=False)
    if process is not None and process.wait() != 0:
        raise SystemExit("zstd failed")
    for entry in manifest["contents"]:
        path = out_dir / entry["name"]
        if sha256_file(path) != entry["sha256"]:
            raise SystemExit(f"{entry['name']}: sha256 mismatch after unpacking")
    archive.unlink()
    print(f"unpacked {len(manifest['contents'])} wheels into {out_dir}, each sha256 ok")


def install(wheels: Path, root: Path, base_python: str, lock: Path = LOCK) -> None:
    """The check's environment under `root`, offline: venv/ (its only preinstalled packages: the base
    Python's, through a .pth to the directory holding its torch) with vllm 0.24.0 and the locked
    dependencies, and the overlays vllm-0.25.0/ and vllm-0.26.0/ (harness/testenv.py's layout)."""
    if root.exists():
        shutil.rmtree(root)
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    (site,) = (root / "venv" / "lib").glob("python*/site-packages")
    torch_dir = subprocess.run(
        [base_python, "-c", "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # the base Python's torch, whatever the working directory holds
    ).stdout.strip()
    (site / "_base_python_torch.pth").write_text(torch_dir + "\n")
    pip = [base_python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    pip += ["--no-index", "--no-deps", "--find-links", str(wheels), "--find-links", str(wheels / "deps")]
    subprocess.run([*pip, "--target", str(site), "-r", str(lock), f"vllm=={BUG}"], check=True)
    for version in (FIXED, V32):
        subprocess.run([*pip, "--target", str(root / f"vllm-{version}"), f"vllm=={version}"], check=True)
    (root / ".stamp").write_text(json.dumps({"base_python": base_python, "torch_dir": torch_dir}) + "\n")
    print(f"installed: {root}/venv (vllm {BUG}), overlays {root}/vllm-{FIXED}, {root}/vllm-{V32}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: download, slim, pack and split into gpu-bundle/")
    p.add_argument("--out", type=Path, default=BUNDLE_DIR)
    p.add_argument("--level", type=int, default=ZSTD_LEVEL)
    p.add_argument("--if-stale", action="store_true", help="do nothing if gpu-bundle/ is current")
    p = sub.add_parser("stage", help="there: check the parts that arrived and move them out of the tree")
    p.add_argument("--incoming", type=Path, default=BUNDLE_DIR)
    p.add_argument("--manifest", type=Path, default=BUNDLE_DIR / "manifest.json")
    p.add_argument("--stage", type=Path, default=Path(STAGE))
    p = sub.add_parser("assemble", help="there: check, join and unpack the parts")
    p.add_argument("--manifest", type=Path, default=BUNDLE_DIR / "manifest.json")
    p.add_argument("--stage", type=Path, default=Path(STAGE))
    p.add_argument("--tools", type=Path, default=Path(STAGE) / "tools")
    p.add_argument("--out", type=Path, default=Path(STAGE) / "unpacked")
    p = sub.add_parser("install", help="there: the check's environment, offline")
    p.add_argument("--wheels", type=Path, default=Path(STAGE) / "unpacked" / "wheels")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--base-python", default=shutil.which("python3") or sys.executable)
    args = parser.parse_args()
    if args.command == "prepare":
        if args.if_stale and is_current(args.out):
            say(f"{args.out} is current (manifest.json matches this recipe): nothing to do")
            return
        prepare(args.out, level=args.level)
    elif args.command == "stage":
        stage(args.incoming, json.loads(args.manifest.read_text()), args.stage)
    elif args.command == "assemble":
        assemble(args.stage, json.loads(args.manifest.read_text()), args.out, args.tools)
    elif args.command == "install":
        install(args.wheels, args.root, args.base_python)


if __name__ == "__main__":
    main()
