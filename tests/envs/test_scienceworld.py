"""ScienceWorld on the real engine (scienceworld 1.2.3 + java): split rule, gold path, threads, JVM crash and close."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxopd_envs.base import EnvError, Task
from jaxopd_envs.checks import normalize_scienceworld_observation
from jaxopd_envs.scienceworld import (
    SCIENCEWORLD_TRAIN_TASK_TYPES,
    SCIENCEWORLD_VARIATIONS,
    ScienceWorldEnv,
    scienceworld_split,
    scienceworld_task,
    scienceworld_tasks,
)

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="ScienceWorld needs a Java runtime")
BOIL = scienceworld_task("boil", 0)
MELT = scienceworld_task("melt", 3)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"        # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def sw_env():
    env = ScienceWorldEnv()
    yield env
    env.close()


@pytest.fixture(scope="module")
def boil_gold(sw_env):
    return sw_env.gold_actions(BOIL)


# ---- split rule (no JVM) ------------------------------------------------------------------------

def test_split_rule_counts_and_disjointness():
    train, evaluation = scienceworld_split("train"), scienceworld_split("eval")
    assert len(SCIENCEWORLD_VARIATIONS) == 30 and len(SCIENCEWORLD_TRAIN_TASK_TYPES) == 17
    assert len(evaluation) == 150                                      # 5 x 30 (App. C.1)
    assert sum(1 for name, _ in evaluation if name in SCIENCEWORLD_TRAIN_TASK_TYPES) == 85
    assert len(train) == 2300                                          # paper: 2,294 (types not named)
    assert not set(train) & set(evaluation)
    assert [v for name, v in train if name == "boil"] == list(range(15))        # first half of 30
    assert [v for name, v in evaluation if name == "boil"] == [25, 26, 27, 28, 29]
    assert [v for name, v in train if name == "identify-life-stages-2"] == [0, 1, 2, 3, 4]   # n = 10
    assert [v for name, v in evaluation if name == "identify-life-stages-2"] == [5, 6, 7, 8, 9]
    assert {name for name, _ in train} == set(SCIENCEWORLD_TRAIN_TASK_TYPES)
    tasks = scienceworld_tasks("eval")
    assert tasks[0].task_id == "scienceworld/eval/boil-25" and tasks[0].payload["simplification"] == "easy"
    custom = scienceworld_split("train", train_task_types=("power-component",))
    assert custom == [("power-component", v) for v in range(10)]
    with pytest.raises(ValueError, match="unknown ScienceWorld split"):
        scienceworld_split("valid_seen")
    with pytest.raises(ValueError, match="unknown ScienceWorld task types"):
        scienceworld_split("train", train_task_types=("boil", "fly"))
    with pytest.raises(ValueError, match="would overlap"):
        scienceworld_split("eval", train_task_types=("tiny",), variations={"tiny": 8})
    with pytest.raises(ValueError, match="out of range"):
        scienceworld_task("boil", 30)


def test_bad_input_without_starting_a_jvm():
    env = ScienceWorldEnv()
    with pytest.raises(ValueError, match="before reset"):
        env.step("look around")
    with pytest.raises(ValueError, match="not a ScienceWorld task"):
        env.reset(Task(benchmark="alfworld", split="train", task_id="x", task_type="pick"))
    with pytest.raises(ValueError, match="payload needs"):
        env.reset(Task(benchmark="scienceworld", split="train", task_id="x", task_type="boil"))
    assert env.jvm_pid is None
    env.close()
    with pytest.raises(EnvError, match="closed"):
        env.reset(BOIL)


def test_unchecked_arguments_are_rejected_without_a_jvm():
    """Issue 15.16: an unknown simplification or a non-integer variation fails at once, naming the value."""
    with pytest.raises(ValueError, match="unknown ScienceWorld simplification 'hard'"):
        ScienceWorldEnv(simplification="hard")
    with pytest.raises(ValueError, match="unknown ScienceWorld simplification"):
        scienceworld_task("boil", 0, simplification="easy,fast")
    with pytest.raises(ValueError, match="needs electrical actions"):
        scienceworld_task("power-component", 0, simplification="noElectricalAction")
    assert scienceworld_task("boil", 0, simplification="openDoors,teleportAction").payload["simplification"] == \
        "openDoors,teleportAction"
    for variation in (1.5, 1.0, True, "1", None):
        with pytest.raises(ValueError, match="variation"):
            scienceworld_task("boil", variation)
    import numpy as np
    assert scienceworld_task("boil", np.int64(3)).payload["variation"] == 3
    env = ScienceWorldEnv()
    try:
        for payload, match in (({"task_name": "boil", "variation": 1.5}, "must be an int"),
                               ({"task_name": "boil", "variation": 0, "simplification": "hard"}, "simplification"),
                               ({"task_name": "boil", "variation": 30}, "out of range")):
            with pytest.raises(ValueError, match=match):
                env.reset(Task("scienceworld", "train", "scienceworld/train/x", "boil", payload))
        with pytest.raises(ValueError, match="max_restarts"):
            ScienceWorldEnv(max_restarts=1.5)
        assert env.jvm_pid is None
    finally:
        env.close()


# ---- real engine --------------------------------------------------------------------------------

@needs_java
def test_variation_table_matches_engine(sw_env):
    sw_env.reset(BOIL)
    engine = sw_env._engine
    assert {name: engine.get_max_variations(name) for name in engine.get_task_names()} == dict(SCIENCEWORLD_VARIATIONS)


@needs_java
def test_boil_gold_path_reaches_score_100_and_success(sw_env, boil_gold):
    assert len(boil_gold) == 39
    first = sw_env.reset(BOIL)
    assert first.turn == 0 and first.score == 0.0 and not first.done and not first.won
    assert first.text.startswith("This room is called the hallway.")
    assert first.instruction.startswith("Your task is to boil water.")
    assert "focus on OBJ" in first.action_templates and len(first.action_templates) == 25
    assert "kitchen" in first.objects and len(first.admissible_actions) > 50
    observations = [first]
    listed = []
    for action in boil_gold:
        if observations[-1].done:
            break
        listed.append(action in observations[-1].admissible_actions)
        observations.append(sw_env.step(action))
    # The engine accepts aliases its valid-action list does not spell ("examine X", "use thermometer in
    # inventory on ..."), and no-ops ("open door to kitchen" when it is already open) are not listed.
    assert [i for i, ok in enumerate(listed) if not ok] == [0, 13] + list(range(16, 36))
    assert [o.last_action_valid for o in observations[1:]] == listed
    last = observations[-1]
    # the task is complete at turn 36; the gold path's last three steps come after completion
    assert last.turn == 36 and last.score == 100.0 and last.won and last.done
    scores = [o.score for o in observations]
    assert scores == sorted(scores)                                      # max reached: never decreases
    assert [(o.turn, o.score) for o in observations if o.reward > 0] == [
        (9, 3.0), (12, 70.0), (15, 72.0), (16, 73.0), (22, 75.0), (36, 100.0)]
    assert all(o.won == (o.score >= 99.999) for o in observations)
    with pytest.raises(ValueError, match="is over"):      # issue 15.17: as ALFWorld, no step after done
        sw_env.step(boil_gold[36])


@needs_java
def test_normalised_action_is_sent_in_the_engine_spelling(sw_env):
    """Issue 15.14: an action admissible after NFKC/case/space normalisation is executed, not refused."""
    sw_env.reset(BOIL)
    reference = sw_env.step("look around")
    assert reference.last_action_valid and "No known action" not in reference.text
    for spelling in ("look\u00a0around", "\uff4c\uff4f\uff4f\uff4b \uff41\uff52\uff4f\uff55\uff4e\uff44",
                     "  LOOK   Around "):
        observation = sw_env.step(spelling)
        assert observation.last_action_valid, spelling
        assert normalize_scienceworld_observation(observation.text) == \
            normalize_scienceworld_observation(reference.text), spelling
    invalid = sw_env.step("fly to the moon")                     # not admissible: sent as is, as before
    assert not invalid.last_action_valid and invalid.text.startswith("No known action matches that input")
    assert invalid.turn == 5


@needs_java
def test_text_the_engine_cannot_receive_is_bad_input_not_a_crash(sw_env):
    """Issue 15.15: a lone surrogate is a ValueError before the JVM; the healthy JVM is neither killed nor restarted."""
    sw_env.reset(BOIL)
    pid, restarts = sw_env.jvm_pid, sw_env.restarts
    for text in ("look around\ud800", "\udc80"):
        with pytest.raises(ValueError, match="not valid text"):
            sw_env.step(text)
    with pytest.raises(ValueError, match="unknown ScienceWorld task type"):      # every text sent is checked
        sw_env.reset(Task("scienceworld", "train", "x", "boil", {"task_name": "boil\ud800", "variation": 0}))
    assert (sw_env.jvm_pid, sw_env.restarts) == (pid, restarts) and _pid_alive(pid)
    sw_env.reset(BOIL)
    assert sw_env.step("look around").turn == 1


def _play(env: ScienceWorldEnv, task: Task, actions) -> list:
    return [env.reset(task)] + [env.step(a) for a in actions]


def _state_view(observation):
    """An observation as App. B.5 compares it. After a reset the engine may list objects in another order
    and name identical objects by other aliases (seen on most task types), so the text is taken in its
    normal form and the admissible list by size; everything else must be identical."""
    return (normalize_scienceworld_observation(observation.text), observation.instruction,
            len(observation.admissible_actions), frozenset(observation.action_templates), observation.done,
            observation.won, observation.score, observation.reward, observation.turn, observation.last_action_valid,
            observation.info["raw_score"], observation.info["moves"])


def _views(observations):
    return [_state_view(o) for o in observations]


@needs_java
def test_two_envs_in_two_threads_match_sequential_runs(sw_env, boil_gold):
    melt_prefix = ["open door to kitchen", "go to kitchen", "look around", "pick up thermometer",
                   "open freezer", "focus on ice"]
    boil_prefix = boil_gold[:6]
    sequential = {"boil": _play(sw_env, BOIL, boil_prefix), "melt": _play(sw_env, MELT, melt_prefix)}
    second = ScienceWorldEnv()
    try:
        threaded: dict = {}
        threads = [threading.Thread(target=lambda: threaded.__setitem__("boil", _play(sw_env, BOIL, boil_prefix))),
                   threading.Thread(target=lambda: threaded.__setitem__("melt", _play(second, MELT, melt_prefix)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert _views(threaded["boil"]) == _views(sequential["boil"])
        assert _views(threaded["melt"]) == _views(sequential["melt"])
        assert _views(threaded["boil"]) != _views(threaded["melt"])
        assert threaded["melt"][0].info["task_name"] == "melt" and threaded["melt"][0].info["variation"] == 3
        pid = second.jvm_pid
        assert pid != sw_env.jvm_pid and _pid_alive(pid)
    finally:
        second.close()
    assert not _pid_alive(pid)                                            # close() stops the JVM
    second.close()                                                        # idempotent


@needs_java
def test_killed_jvm_is_restarted_and_episode_replayed(sw_env, boil_gold):
    reference = _play(sw_env, BOIL, boil_gold[:7])
    sw_env.reset(BOIL)
    for action in boil_gold[:5]:
        sw_env.step(action)
    pid, restarts = sw_env.jvm_pid, sw_env.restarts
    os.kill(pid, signal.SIGKILL)
    observation = sw_env.step(boil_gold[5])
    assert sw_env.restarts == restarts + 1 and sw_env.jvm_pid != pid and not _pid_alive(pid)
    assert _state_view(observation) == _state_view(reference[6])
    assert _state_view(sw_env.step(boil_gold[6])) == _state_view(reference[7])


@needs_java
@pytest.mark.slow
def test_jvm_stops_when_the_interpreter_exits_without_close(tmp_path):
    script = textwrap.dedent("""
        from jaxopd_envs.scienceworld import ScienceWorldEnv, scienceworld_task
        env = ScienceWorldEnv()
        env.reset(scienceworld_task("boil", 0))
        print(env.jvm_pid, flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.split()[-1])
    deadline = time.time() + 10
    while _pid_alive(pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not _pid_alive(pid)


@needs_java
@pytest.mark.slow
def test_pool_rebuilds_a_killed_scienceworld_env(boil_gold):
    """Through EnvPool, with the env's own restart disabled, so that the pool rebuilds and replays."""
    from jaxopd_envs.pool import EnvPool

    melt_gold = None
    with EnvPool(lambda: ScienceWorldEnv(max_restarts=0), 2, call_timeout_s=120) as pool:
        pool.reset(0, BOIL)
        pool.reset(1, MELT)
        for action in boil_gold[:4]:
            pool.step(0, action)
        os.kill(pool._slots[0].env.jvm_pid, signal.SIGKILL)
        after = pool.step(0, boil_gold[4])
        trajectory = pool.trajectory(0)
        assert trajectory.recoveries == 1 and pool.trajectory(1).recoveries == 0
        assert trajectory.actions == tuple(boil_gold[:5])
        melt_gold = pool._slots[1].env.gold_actions(MELT)       # leaves slot 1 needing a reset
    with ScienceWorldEnv() as fresh:
        reference = _play(fresh, BOIL, boil_gold[:5])
    assert _views(trajectory.observations) == _views(reference) and _state_view(after) == _state_view(reference[5])
    assert len(melt_gold) > 5
