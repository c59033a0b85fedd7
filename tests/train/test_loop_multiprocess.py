"""The whole training loop as several processes of one JAX cluster (``python -m experiments.train --num-processes N``):
in synchronous rollout mode, 2 and 4 processes of vanilla OPD and of ActFirst-OPD (5 updates) give the losses,
gradient norms, exported weights and first greedy token after each weight sync (every engine's, checked equal by
``--sync-check``) of one process; a 2-process run resumed from its checkpoints continues with the
losses of the uninterrupted run; a process killed with SIGKILL makes the launcher stop the other within 60 s naming
the lost process, and the relaunched pair continues from the last checkpoint with the same next loss; without the
launcher, process 0 names the lost process 1 (JAX's heartbeat) and exits with 75. Micro models
over a small ALFWorld tree; every process has one CPU device."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--preset", "cpu", "--rollout-mode", "sync", "--batch-size", "4", "--rollout-slots", "2", "--train-tasks",
         "2", "--max-turns", "2", "--first-stage-tokens", "8", "--total-tokens", "12", "--second-stage-tokens", "4",
         "--fast-action-tokens", "8", "--no-eval", "--no-progress", "--learning-rate", "1e-3",
         "--checkpoint-every", "2", "--sync-check", "on"]
RUN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    pytest.importorskip("alfworld")
    from jaxopd_envs import alfworld_gen
    from micro_models import TWO_LAYER, save_micro_pair

    folder = tmp_path_factory.mktemp("loop_multiprocess")
    student, teacher = save_micro_pair(folder / "models", shape=TWO_LAYER)
    root = alfworld_gen.ensure_games(folder / "games", seed=0, counts={"train": 2, "valid_seen": 0,
                                                                       "valid_unseen": 1}, workers=1, progress=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXOPD_")}
    env.pop("XLA_FLAGS", None)          # conftest simulates 8 devices; every process here has one
    env.update(JAX_PLATFORMS="cpu", ALFWORLD_DATA=str(root), JAXOPD_CACHE=str(folder / "cache"))
    return {"folder": folder, "env": env, "models": ["--student", str(student), "--teacher", str(teacher)]}


def command(setting, method, out, *extra):
    return [sys.executable, "-m", "experiments.train", "--method", method, *setting["models"], *FLAGS, *extra,
            "--out", str(out)]


def run(setting, method, out, *extra):
    done = subprocess.run(command(setting, method, out, *extra), cwd=REPO, env=setting["env"], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def records(out):
    return [json.loads(line) for line in (Path(out) / "train.jsonl").read_text().splitlines() if line.strip()]


def exported(folder):
    from jaxopd.models.weights import SafetensorsFile
    weights = SafetensorsFile(Path(folder) / "model.safetensors")
    return {key: np.asarray(weights[key]) for key in weights.keys()}


def assert_same_updates(mine, reference, updates):
    assert [r["step"] for r in mine] == [r["step"] for r in reference] == list(updates)
    for a, b in zip(mine, reference):
        assert a["batch_tokens"] == b["batch_tokens"], (a["step"], a["batch_tokens"], b["batch_tokens"])
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-4, atol=1e-6, err_msg=f"update {a['step']}")
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4, err_msg=f"update {a['step']}")
        # every engine decoded the same first token after the sync (else the run stops), and it is one process's
        assert a["sync_check_token"] == b["sync_check_token"], (a["step"], a["sync_check_token"], b["sync_check_token"])
        np.testing.assert_allclose(a["sync_check_logprob"], b["sync_check_logprob"], atol=1e-4)


@pytest.mark.parametrize("method, updates, processes", [("vanilla-opd", 5, 2), ("actfirst", 5, 2),
                                                        ("vanilla-opd", 5, 4), ("actfirst", 5, 4)])
def test_several_processes_train_like_one(setting, method, updates, processes):
    folder = setting["folder"] / method
    one, many = folder / f"one-{updates}", folder / ("two" if processes == 2 and updates == 5 else f"p{processes}")
    if not (one / "train.jsonl").is_file():
        run(setting, method, one, "--updates", str(updates), "--export", str(one) + "-model")
    run(setting, method, many, "--updates", str(updates), "--num-processes", str(processes),
        "--export", str(many) + "-model")
    assert_same_updates(records(many), records(one), range(1, updates + 1))
    assert len({round(r["loss"], 5) for r in records(one)}) > 1         # the updates changed the policy
    a, b = exported(str(one) + "-model"), exported(str(many) + "-model")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=0, atol=2e-5, err_msg=key)
    for process in range(1, processes):      # each process held its own lock, released at the end
        assert not (many / f".lock.{process}").read_text().strip()


def test_a_resumed_two_process_run_continues_with_the_same_losses(setting):
    reference = setting["folder"] / "vanilla-opd" / "two"
    if not (reference / "train.jsonl").is_file():
        pytest.skip("needs test_several_processes_train_like_one's 2-process vanilla OPD run")
    out = setting["folder"] / "resumed"
    run(setting, "vanilla-opd", out, "--updates", "3", "--num-processes", "2")
    run(setting, "vanilla-opd", out, "--updates", "5", "--num-processes", "2")      # from the checkpoint of update 2
    assert_same_updates(records(out), records(reference), range(1, 6))


def _children(pid):
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_a_killed_process_stops_the_other_and_the_pair_resumes(setting):
    reference = setting["folder"] / "vanilla-opd" / "two"
    if not (reference / "train.jsonl").is_file():
        pytest.skip("needs test_several_processes_train_like_one's 2-process vanilla OPD run")
    out = setting["folder"] / "killed"
    phases = setting["folder"] / "killed.phases"
    launcher = subprocess.Popen(command(setting, "vanilla-opd", out, "--updates", "5", "--num-processes", "2",
                                        "--phase-log", str(phases)),
                                cwd=REPO, env=setting["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (phases.is_file() and "step 4 " in phases.read_text()):   # after the checkpoint of update 2
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.2)
        children = _children(launcher.pid)
        assert len(children) == 2, children
        killed_at = time.monotonic()
        os.kill(children[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=90)
        assert time.monotonic() - killed_at < 60
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert "process 1 of 2 was lost (killed by SIGKILL); stopping the others" in err
    run(setting, "vanilla-opd", out, "--updates", "5", "--num-processes", "2")
    resumed = records(out)
    assert_same_updates(resumed, records(reference), range(1, 6))


def test_without_the_launcher_the_survivor_names_the_lost_process_and_the_pair_resumes(setting):
    """One process per host, as on a cluster: JAX's coordinator (process 0) sees process 1 stop; process 0's failed
    collective becomes one line naming it and exit code 75 (no abort at JAX's shutdown barrier)."""
    reference = setting["folder"] / "vanilla-opd" / "two"
    if not (reference / "train.jsonl").is_file():
        pytest.skip("needs test_several_processes_train_like_one's 2-process vanilla OPD run")
    from jaxopd.launch import free_port

    out, phases = setting["folder"] / "no-launcher", setting["folder"] / "no-launcher.phases"
    env = {**setting["env"], "JAXOPD_COORDINATOR": f"localhost:{free_port()}", "JAXOPD_NUM_PROCESSES": "2",
           "JAXOPD_HEARTBEAT_TIMEOUT": "10"}
    line = command(setting, "vanilla-opd", out, "--updates", "5", "--phase-log", str(phases))
    processes = [subprocess.Popen(line, cwd=REPO, env={**env, "JAXOPD_PROCESS_ID": str(p)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for p in range(2)]
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (phases.is_file() and "step 4 " in phases.read_text()):   # after the checkpoint of update 2
            assert all(p.poll() is None for p in processes) and time.monotonic() < deadline, \
                [p.communicate() for p in processes]
            time.sleep(0.2)
        killed_at = time.monotonic()
        processes[1].kill()
        _, err = processes[0].communicate(timeout=90)
        assert time.monotonic() - killed_at < 60
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    assert processes[0].returncode == 75, err[-3000:]
    assert "process 1 of 2 was lost (no heartbeat); stopping process 0" in err
    run(setting, "vanilla-opd", out, "--updates", "5", "--num-processes", "2")
    assert_same_updates(records(out), records(reference), range(1, 6))


def test_asynchronous_runners_are_refused_before_anything_starts(setting, tmp_path):
    flags = [f for f in FLAGS if f not in ("--rollout-mode", "sync")]
    done = subprocess.run([sys.executable, "-m", "experiments.train", "--method", "vanilla-opd", *setting["models"],
                           *flags, "--num-processes", "2", "--out", str(tmp_path / "out")],
                          cwd=REPO, env=setting["env"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "a multi-process run plays synchronous waves: add --rollout-mode sync" in done.stderr
