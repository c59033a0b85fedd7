"""``jaxopd.launch.launch_local``: N children with the cluster variables, exit 0 when all succeed; a child that dies
makes the launcher stop the others within the grace period and name the lost process; the exit code is the
failure's (128 + signal for a signal); a bad process count is refused. Plain Python children (no JAX)."""
from __future__ import annotations

import sys
import time

import pytest

from jaxopd.launch import describe_exit, launch_local

CHILD = """
import os, signal, sys, time
p = int(os.environ["JAXOPD_PROCESS_ID"])
assert os.environ["JAXOPD_NUM_PROCESSES"] == "{n}" and os.environ["JAXOPD_COORDINATOR"].startswith("localhost:")
open(os.path.join(sys.argv[1], f"started.{{p}}"), "w").close()
if {action!r} == "kill" and p == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
if {action!r} == "exit" and p == 0:
    sys.exit(3)
if {action!r} != "ok":
    time.sleep(120)
"""


def run_children(tmp_path, action, n=2):
    lines = []
    started = time.monotonic()
    code = launch_local([sys.executable, "-c", CHILD.format(n=n, action=action), str(tmp_path)], n, grace_s=5,
                        log=lines.append)
    return code, lines, time.monotonic() - started


def test_all_children_succeed(tmp_path):
    code, lines, _ = run_children(tmp_path, "ok", n=3)
    assert code == 0 and lines == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["started.0", "started.1", "started.2"]


def test_a_killed_child_stops_the_others_and_is_named(tmp_path):
    code, lines, elapsed = run_children(tmp_path, "kill")
    assert code == 128 + 9
    assert lines == ["process 1 of 2 was lost (killed by SIGKILL); stopping the others"]
    assert elapsed < 30         # the other child sleeps 120 s: it was stopped


def test_a_failing_child_gives_its_exit_code(tmp_path):
    code, lines, elapsed = run_children(tmp_path, "exit")
    assert code == 3 and lines == ["process 0 of 2 was lost (exit code 3); stopping the others"] and elapsed < 30


def test_bad_counts_and_exit_descriptions():
    with pytest.raises(ValueError, match="positive integer"):
        launch_local([sys.executable, "-c", "pass"], 0)
    assert describe_exit(-15) == "killed by SIGTERM" and describe_exit(2) == "exit code 2"
