"""harness.releases.model_registry: whether vLLM's model registry runs a fix's file by default.

The tests marked `network` read PyPI; when it cannot be reached they skip, saying why, unless
VLLMHOTFIX_REQUIRE_NETWORK is set (scripts/test.sh sets it): then they fail (tests/network.py).
"""

from __future__ import annotations

import io
import textwrap
import zipfile

import pytest

from harness import releases
from tests.declared import between
from tests.release_shapes import BUGGY_V2, MEMBER, V32_FORWARD, serve
from vllm_hotfix.fixes import Fix
from vllm_hotfix.fixes.cpu_sampler_fp64_gumbel import CpuSamplerFp64Gumbel
from vllm_hotfix.fixes.deepseek_final_aux import DeepseekFinalAux
from vllm_hotfix.fixes.deepseek_v32_final_aux import DEEPSEEK_V32_FIXES
from vllm_hotfix.runtime.decisions import Decision

PATCHED = Decision.PATCHED


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
    server, url, _ = serve(True, {"/v.whl": buffer.getvalue()})
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
