"""The game generator's planner processes exit with their parent: a ``python -m jaxopd_envs.alfworld_gen`` killed
outright (SIGKILL) leaves no worker burning CPU."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.test_train_kill_resume import alive, descendants

ROOT = Path(__file__).resolve().parents[2]


def test_killed_generator_leaves_no_worker(tmp_path):
    pytest.importorskip("alfworld")
    process = subprocess.Popen([sys.executable, "-m", "jaxopd_envs.alfworld_gen", "--out", str(tmp_path / "games"),
                                "--num", "200", "--num-valid-seen", "0", "--num-valid-unseen", "0", "--workers", "2"],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        workers: set[int] = set()
        while time.monotonic() < deadline and process.poll() is None:
            workers = alive(descendants(process.pid))
            if len(workers) >= 2:        # the spawn pool's planners (and its resource tracker) are up
                break
            time.sleep(0.1)
        assert len(workers) >= 2, "the generator started no worker processes"
        time.sleep(1.0)                 # let them pick up work
        workers = alive(descendants(process.pid))
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while alive(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(workers), f"workers outlived the killed generator: {sorted(alive(workers))}"
    finally:
        if process.poll() is None:
            process.kill()
        for pid in alive(descendants(process.pid)):
            os.kill(pid, signal.SIGKILL)
