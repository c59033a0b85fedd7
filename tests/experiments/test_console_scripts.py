"""The console scripts (``jaxopd-train``, ``jaxopd-eval``, ...) declared in pyproject.toml: each names a command
line's ``main`` and, installed, runs it (``--help`` exits 0 and shows the options of that command)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from importlib import import_module, metadata
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
SCRIPTS = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
# an option only that command has, to tell that the script runs the right one
OWN_OPTION = {"jaxopd-speedup": "--contexts-file", "jaxopd-train": "--method", "jaxopd-eval": "--student",
              "jaxopd-compare": "--eval", "jaxopd-report": "--evaluation", "jaxopd-fetch": "--gguf",
              "jaxopd-generate": "--max-new-tokens"}


def test_every_script_names_a_main_and_is_checked_here():
    assert set(SCRIPTS) == set(OWN_OPTION)
    for name, target in SCRIPTS.items():
        module, _, attr = target.partition(":")
        assert attr == "main", name
        assert callable(getattr(import_module(module), attr)), name


def test_the_installed_distribution_declares_the_same_scripts():
    installed = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")
                 if ep.dist is not None and ep.dist.name == "jaxopd"}
    assert installed == SCRIPTS, "reinstall: pip install -e ."


@pytest.mark.parametrize("name", sorted(OWN_OPTION))
def test_script_help_runs_its_command(name):
    exe = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(exe).exists():
        pytest.fail(f"{name} is not installed beside {sys.executable}: reinstall with pip install -e .")
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert OWN_OPTION[name] in result.stdout
