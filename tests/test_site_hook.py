"""The site hook in processes that never import vLLM: inert, removable, harmless when broken."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.site_venvs import make_venv
from harness.testenv import outside_checkout


@pytest.fixture(scope="module")
def hooked(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_venv(tmp_path_factory.mktemp("hooked"))


def run(python: str, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return hotfix_cli(python, "-c", code, **env)


def hotfix_cli(python: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python ARGS` outside the checkout, so the venv's installed vllm_hotfix is what runs."""
    return subprocess.run(
        [python, *args], capture_output=True, text=True, env=env or None, cwd=outside_checkout()
    )


def test_hook_installs_the_vllm_trigger(hooked: str) -> None:
    done = run(hooked, "import sys; print([type(f).__name__ for f in sys.meta_path][0])")
    assert done.stdout.strip() == "_VllmImportTrigger"


def test_disable_makes_the_hook_import_nothing(hooked: str) -> None:
    done = run(hooked, "import sys; print('vllm_hotfix' in sys.modules)", VLLMHOTFIX_DISABLE="1")
    assert done.stdout.strip() == "False" and done.stderr == ""


def test_status_and_uninstall_remove_exactly_the_hook(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "venv")
    status = hotfix_cli(python, "-m", "vllm_hotfix", "status", "--json", "--no-probe")
    document = json.loads(status.stdout)  # no vLLM in this venv: exit 2, the text is one line
    assert status.returncode == 2 and document["vllm_installed"] is None
    assert document["site_hook"].endswith("vllm_hotfix_site_hook.pth")
    site = next((tmp_path / "venv").glob("lib/python*/site-packages"))
    before = sorted(p.name for p in site.iterdir())
    done = hotfix_cli(python, "-m", "vllm_hotfix", "uninstall-site-hook")
    assert done.returncode == 0 and "removed" in done.stdout
    after = sorted(p.name for p in site.iterdir())
    assert sorted(set(before) - set(after)) == ["vllm_hotfix_site_hook.pth"]
    assert run(python, "import sys; print('vllm_hotfix' in sys.modules)").stdout.strip() == "False"


def test_the_old_command_names_still_work(tmp_path: Path) -> None:
    """The commands were named after sitecustomize before they were named after what they write."""
    python = make_venv(tmp_path / "venv", hook=False)
    site = next((tmp_path / "venv").glob("lib/python*/site-packages"))
    done = hotfix_cli(python, "-m", "vllm_hotfix", "install-sitecustomize")
    assert done.returncode == 0 and (site / "vllm_hotfix_site_hook.pth").is_file(), done.stderr
    done = hotfix_cli(python, "-m", "vllm_hotfix", "uninstall-sitecustomize")
    assert done.returncode == 0 and not (site / "vllm_hotfix_site_hook.pth").exists(), done.stderr


def test_install_refuses_to_overwrite_a_foreign_file(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "venv", hook=False)
    site = next((tmp_path / "venv").glob("lib/python*/site-packages"))
    (site / "vllm_hotfix_site_hook.pth").write_text("# someone else's\n")
    done = hotfix_cli(python, "-m", "vllm_hotfix", "install-site-hook")
    assert done.returncode != 0 and "not written by vllm-hotfix" in done.stderr
    assert (site / "vllm_hotfix_site_hook.pth").read_text() == "# someone else's\n"


@pytest.mark.parametrize("damage", ["removed", "broken"])
def test_a_missing_or_broken_package_never_breaks_start_up(tmp_path: Path, damage: str) -> None:
    python = make_venv(tmp_path / "venv")
    package = next((tmp_path / "venv").glob("lib/python*/site-packages/vllm_hotfix"))
    if damage == "removed":
        shutil.rmtree(package)  # pip uninstall leaves the .pth, which it did not install
    else:
        (package / "__init__.py").write_text("raise SystemError('half-written install')\n")
    done = run(python, "print('started')")
    assert done.returncode == 0 and done.stdout.strip() == "started"
    warning = done.stderr.splitlines()
    hook = str(next((tmp_path / "venv").glob("lib/python*/site-packages/vllm_hotfix_site_hook.pth")))
    assert len(warning) == 1 and warning[0].startswith("vllm-hotfix: site hook skipped")
    # the file pip uninstall leaves behind, and what to do with it, on one short line
    assert warning[0].endswith(f"; delete {hook} or reinstall vllm-hotfix")
    assert len(warning[0]) - len(hook) < 160


def test_without_vllm_import_and_status_work_and_say_so(hooked: str) -> None:
    code = (
        "import json, sys, vllm_hotfix; s = vllm_hotfix.status();"
        "print(json.dumps([s['vllm_installed'], s['armed'], [f['reason'] for f in s['fixes']],"
        " sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))]))"
    )
    done = run(hooked, code)
    import json

    installed, armed, reasons, heavy = json.loads(done.stdout)
    assert installed is None and armed is False and heavy == []
    assert reasons and all(r == "vLLM is not installed: nothing to fix" for r in reasons)
