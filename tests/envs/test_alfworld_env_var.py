"""alfworld's ``info`` module writes ``$ALFWORLD_DATA`` (``~/.cache/alfworld``) when imported; ``envs`` imports the
wheel through ``envs.import_alfworld``, which leaves the variable as the user set it. Without it, a process that had
generated games or read the goal library took that empty cache for official games ("$ALFWORLD_DATA holds no
solvable ALFWorld games") in every later check of the task source. Fresh interpreters: alfworld not yet imported."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("alfworld")

PROBE = """
import os, sys
{import_line}
print(repr(os.environ.get("ALFWORLD_DATA")))
"""


def probe(import_line: str, value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    if value is not None:
        env["ALFWORLD_DATA"] = value
    result = subprocess.run([sys.executable, "-c", PROBE.format(import_line=import_line)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_wheel_itself_writes_the_variable():
    assert probe("import alfworld", None) != "None"          # the premise: a bare import sets it


@pytest.mark.parametrize("call", ["from jaxopd_envs.alfworld_state import _goal_patterns; _goal_patterns()",
                                  "from jaxopd_envs import alfworld_gen; alfworld_gen._alfred()"])
def test_envs_leave_an_unset_variable_unset(call):
    assert probe(call, None) == "None"


def test_envs_keep_the_users_value(tmp_path):
    assert probe("from jaxopd_envs.alfworld_state import _goal_patterns; _goal_patterns()", str(tmp_path)) == repr(
        str(tmp_path))
