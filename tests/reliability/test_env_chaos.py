"""Environment chaos (``bench.env_chaos``): 32 episodes on real ALFWorld and ScienceWorld environments while
ScienceWorld JVMs are killed and ALFWorld steps raise (and one hangs past the pool's timeout): every task gets
exactly one outcome, every completed trajectory equals its fault-free run, every failure has a reason, the pool's
recoveries are the faults', and nothing (thread or JVM) outlives ``pool.close()``. Also the ScienceWorld replay
bug the chaos found: an "Ambiguous request" listing comes in another order after each reset, so a replay through
one diverged."""
from __future__ import annotations

import functools
import os
import shutil
import signal

import pytest

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="ScienceWorld needs a Java runtime")


# ------------------------------------------------------------------------------------------------ the chaos run
@pytest.fixture(scope="module")
def chaos():
    pytest.importorskip("scienceworld")
    pytest.importorskip("alfworld")
    if shutil.which("java") is None:
        pytest.skip("ScienceWorld needs a Java runtime")
    from bench.env_chaos import run_env_chaos

    return run_env_chaos(32, seed=0, log=lambda message: None)


@pytest.mark.slow      # about 2.5 minutes on 2 CPU cores (a fault-free reference run, then the run under chaos)
def test_env_chaos_every_episode_is_intact_or_reported_and_nothing_outlives_the_pool(chaos):
    report = chaos
    assert report.episodes == 32 and report.tasks_by_benchmark == {"alfworld": 16, "scienceworld": 16}
    assert report.checks["one_outcome_per_task_in_order"] and report.checks["no_duplicated_trajectory"]
    assert report.reference_failed == []
    # every task accounted for: completed intact, or failed with its reason; none silently dropped
    assert report.completed + len(report.failed) == 32
    assert report.not_intact == [] and report.intact == report.completed
    for failure in report.failed:
        kind, _, message = failure["reason"].partition(": ")
        assert kind.isidentifier() and message, failure
    # the faults happened, of every kind, and were survived
    injected = report.faults_injected
    assert injected["jvm_kill"] >= 1 and injected["alfworld_raise"] >= 1 and injected["hang"] == 1
    assert report.faults_injected_total == sum(injected.values()) == len(report.faults)
    assert report.faults_survived >= 1 and report.faults_survived + report.met_fault_and_failed == \
        report.episodes_met_fault
    assert report.intact >= 24                       # most episodes survive one fault; two in one call may fail
    # the recoveries are the faults': every pool rebuild follows an environment error or a timed-out call
    assert report.calls_timed_out >= injected["hang"]
    assert report.pool_recoveries == report.errors_raised_by_envs + report.calls_timed_out
    assert report.pool_recoveries >= injected["alfworld_raise"] + injected["hang"]
    assert report.jvm_kills_noticed + report.jvm_kills_unnoticed == injected["jvm_kill"]
    assert report.scienceworld_jvm_restarts >= 1
    # nothing outlives the pool
    assert report.leftover_threads == [] and report.threads_after <= report.threads_before
    assert report.jvms_peak >= 1 and report.jvms_after <= report.jvms_before
    assert report.passed, report.checks


# ------------------------------------------------------------------------------------------------ the bug it found
def test_canonical_ambiguity_sorts_and_renumbers_the_readings():
    from jaxopd_envs.scienceworld import canonical_ambiguity

    raw = ("Ambiguous request: Please enter the number for the action you intended (or blank to cancel):\n"
           "0:\tlook at door between workshop and hallway\n1:\tlook at door between bedroom and hallway\n"
           "2:\tlook at door between art studio and hallway\n")
    text, engine_numbers = canonical_ambiguity(raw)
    assert text.splitlines()[1:] == ["0:\tlook at door between art studio and hallway",
                                     "1:\tlook at door between bedroom and hallway",
                                     "2:\tlook at door between workshop and hallway"]
    assert text.endswith("\n") and engine_numbers == (2, 1, 0)
    assert canonical_ambiguity("You teleport to the kitchen.") == ("You teleport to the kitchen.", None)


@needs_java
def test_scienceworld_ambiguous_choices_replay_after_a_jvm_crash():
    """Regression: the engine numbers an ambiguous action's readings in another order after every reset, so a replay
    (in-env after a JVM crash, or the pool's) compared a differently ordered listing (diverged) and sent the same
    number for another reading. The listing is now sorted and a numeric answer translated."""
    from jaxopd_envs.pool import EnvPool
    from jaxopd_envs.scienceworld import ScienceWorldEnv, scienceworld_task

    task = scienceworld_task("freeze", 0)
    env = ScienceWorldEnv()
    try:
        listings = []
        for choice in (3, 0):
            env.reset(task)
            listing = env.step("look at door").text
            chosen = listing.splitlines()[choice + 1].split("\t")[1]          # "look at door between X and hallway"
            room = chosen.removeprefix("look at door between ").removesuffix(" and hallway")
            assert env.step(str(choice)).text.startswith(f"A door to the {room}")
            listings.append(listing)
        assert listings[0] == listings[1]                                      # the same listing every reset
        env.reset(task)
        env.step("look at door")
        before = env.step("4").text
        env.step("look at door")
        os.kill(env.jvm_pid, signal.SIGKILL)      # the in-env replay runs both numbered choices again
        after = env.step("1")
        assert env.restarts == 1 and after.text.startswith("A door to the bedroom") and before != after.text
    finally:
        env.close()

    with EnvPool(functools.partial(ScienceWorldEnv, max_restarts=0), num_slots=1, backend="thread") as pool:
        pool.reset(0, task)          # a second reset in one JVM lists the readings in another order than a first,
        pool.step(0, "look at door")     # which is what the pool's replay in a fresh JVM gets
        pool.reset(0, task)
        pool.step(0, "look at door")
        assert pool.step(0, "2").text.startswith("A door to the greenhouse")
        pool.step(0, "look at door")
        os.kill(pool._slots[0].env.jvm_pid, signal.SIGKILL)    # the pool rebuilds the env and replays the episode
        assert pool.step(0, "5").text.startswith("A door to the workshop")
        assert pool.recoveries == 1 and pool.trajectory(0).actions == ("look at door", "2", "look at door", "5")
