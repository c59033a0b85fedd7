"""Backpressure of the training loop's async rollout runners (``jaxopd.methods.sources.RolloutRunners``): with a backlog
bound, runners start episodes only while the samples ahead of the trainer stay below it, one episode may always
run, and without a bound every slot plays."""
from __future__ import annotations

import threading
import time

import pytest

from jaxopd.methods.config import build_config
from jaxopd.methods.sources import RolloutRunners


class GatedStrategy:
    """Episodes that run until the test releases them; counts how many ran at once."""

    def __init__(self):
        self.release = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.started: list[int] = []

    def run_episode(self, slot, task, reference, *, seed):
        with self.lock:
            self.started.append(seed)
        if not self.release.acquire(timeout=30):
            raise TimeoutError("the test never released this episode")
        return f"episode {seed}"


def wait_until(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def settle():
    time.sleep(0.3)     # long enough for an idle runner thread to start an episode it is allowed to


def take(runners, samples, queued):
    finished = runners.results.get(timeout=10)
    runners.delivered(samples, queued)
    return finished


def test_backlog_bounds_the_episodes_in_flight():
    strategy = GatedStrategy()
    # 4 slots, a backlog of 4 samples, 2 samples per episode expected: 0 + 1 * 2 < 4 lets a second start, not a third
    runners = RolloutRunners(strategy, 4, lambda i: (None, None, i), 0, backlog=4, per_episode=2)
    try:
        runners.resume()
        assert wait_until(lambda: len(strategy.started) == 2)
        settle()
        assert strategy.started == [0, 1] and runners.max_busy == 2

        # both finish; until the trainer takes them in they still count against the backlog
        strategy.release.release(2)
        assert wait_until(lambda: runners.results.qsize() == 2)
        settle()
        assert len(strategy.started) == 2
        # taken in with 4 fresh samples buffered: the backlog is full, but one episode may always run
        take(runners, 2, 2)
        take(runners, 2, 4)
        assert wait_until(lambda: len(strategy.started) == 3)
        settle()
        assert len(strategy.started) == 3

        # the trainer took a batch: room for one more (0 + 1 * 2 < 4), not two
        runners.report(0)
        assert wait_until(lambda: len(strategy.started) == 4)
        settle()
        assert strategy.started == [0, 1, 2, 3] and runners.max_busy == 2
    finally:
        strategy.release.release(100)
        runners.close()


def test_per_episode_estimate_follows_delivered_episodes():
    strategy = GatedStrategy()
    # a first guess of 10 samples an episode: one at a time under a backlog of 10
    runners = RolloutRunners(strategy, 3, lambda i: (None, None, i), 0, backlog=10, per_episode=10)
    try:
        runners.resume()
        assert wait_until(lambda: len(strategy.started) == 1)
        settle()
        assert len(strategy.started) == 1
        strategy.release.release(1)
        # the episode gave 2 samples, not 10: with 2 buffered, 2 + 2 * k < 10 lets three run
        take(runners, 2, 2)
        assert wait_until(lambda: len(strategy.started) == 4)
        settle()
        assert len(strategy.started) == 4 and runners.max_busy == 3
    finally:
        strategy.release.release(100)
        runners.close()


def test_no_backlog_plays_every_slot_and_failed_episodes_free_room():
    strategy = GatedStrategy()
    runners = RolloutRunners(strategy, 3, lambda i: (None, None, i), 0, backlog=None)
    try:
        runners.resume()
        assert wait_until(lambda: runners.max_busy == 3)
    finally:
        strategy.release.release(100)
        runners.close()

    strategy = GatedStrategy()
    runners = RolloutRunners(strategy, 2, lambda i: (None, None, i), 0, backlog=3, per_episode=2)
    try:
        runners.resume()
        assert wait_until(lambda: len(strategy.started) == 2)   # 0 + 1 * 2 < 3
        settle()
        assert len(strategy.started) == 2
        strategy.release.release(1)
        assert wait_until(lambda: runners.results.qsize() == 1)
        settle()
        assert len(strategy.started) == 2        # 0 + (1 running + 1 undelivered) * 2 >= 3
        finished = take(runners, 0, 0)          # a failed episode gives no samples and frees its room
        assert wait_until(lambda: len(strategy.started) == 3)
        assert finished.index in (0, 1)
    finally:
        strategy.release.release(100)
        runners.close()


def test_backlog_config():
    config = build_config("vanilla-opd", preset="cpu")
    assert config.rollout_backlog is None
    assert config.backlog_limit() == config.batch_size * (config.max_version_lag + 1)
    assert build_config("vanilla-opd", preset="cpu", rollout_backlog=0).backlog_limit() is None
    assert build_config("vanilla-opd", preset="cpu", rollout_backlog=40).backlog_limit() == 40
    with pytest.raises(ValueError, match="rollout_backlog must be a non-negative integer"):
        build_config("vanilla-opd", preset="cpu", rollout_backlog=-1)


def test_a_task_whose_reference_fails_fails_its_episode_and_the_runners_go_on():
    """``task_at`` builds a task's reference on first use (``jaxopd_envs.references.LazyReferences``); when that raises,
    the episode is reported failed with the error and the runner thread plays the next task."""
    from jaxopd_envs.references import ReferenceBuildError

    class Plain:
        def run_episode(self, slot, task, reference, *, seed):
            return f"episode {seed}"

    def task_at(index):
        if index == 1:
            raise ReferenceBuildError("no reference for task 1: replay did not reach success")
        return None, None, index

    runners = RolloutRunners(Plain(), 1, task_at, 0)
    try:
        runners.resume()
        got = [runners.results.get(timeout=10) for _ in range(3)]
    finally:
        runners.close()
    assert [(f.index, f.trajectory) for f in got] == [(0, "episode 0"), (1, None), (2, "episode 2")]
    assert got[1].error == "ReferenceBuildError: no reference for task 1: replay did not reach success"


def test_sync_waves_leave_out_a_task_whose_reference_fails():
    """The sync and collection path (``TaskStream.picks``): the failing task is logged and left out of the wave,
    the others keep their order, and the failure is what a run that stalls reports."""
    from jaxopd_envs.references import ReferenceBuildError
    from jaxopd.methods.sources import TaskStream

    logged: list[str] = []
    stream = TaskStream([], 0, None, logged.append)

    def task_at(index):
        if index == 5:
            raise ReferenceBuildError("no reference for task 5: replay did not reach success")
        return f"task {index}", None, index

    stream.at = task_at
    assert stream.picks(range(4, 7)) == [("task 4", None, 4), ("task 6", None, 6)]
    assert logged == ["training episode 5 failed: ReferenceBuildError: no reference for task 5: replay did not "
                      "reach success"]
    assert stream.last_failure == "ReferenceBuildError: no reference for task 5: replay did not reach success"
