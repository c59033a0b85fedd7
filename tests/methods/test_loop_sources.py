"""The loop's sample sources without models (``jaxopd.methods.sources``): sync waves fill the buffer in task order
and count their episodes, a run of empty waves is an error naming the last failure, ActionOPD's collections stop at
their budget and report which collection a minibatch is of, and the counters a checkpoint carries round-trip."""
from __future__ import annotations

import json
import types

import numpy as np
import pytest

from jaxopd.methods.sources import (MAX_EMPTY_COLLECTIONS, Collections, Counters, SyncWaves, TaskStream,
                                    make_source)
from jaxopd.sample import Sample
from jaxopd.train.buffer import SampleBuffer

TASKS = [types.SimpleNamespace(task_id=f"t{i}") for i in range(5)]


def config(**fields):
    base = dict(method="vanilla-opd", rollout_slots=2, batch_size=3, collection_tasks=3, updates=2,
                max_train_tokens=10, rollout_mode="sync")
    return types.SimpleNamespace(**{**base, **fields})


class Strategy:
    """Plays every task; the tasks in ``failing`` fail."""

    def __init__(self, failing=()):
        self.failing, self.played = set(failing), []

    def play(self, tasks, references, *, seeds):
        self.played.append([task.task_id for task in tasks])
        return [types.SimpleNamespace(ok=task.task_id not in self.failing, task=task,
                                      trajectory=None if task.task_id in self.failing else task.task_id,
                                      error="boom" if task.task_id in self.failing else None) for task in tasks]


class Method:
    """Each trajectory gives ``per_episode`` samples (the last one too long to train on when ``too_long``)."""

    trains_in_collections = False

    def __init__(self, per_episode=2, too_long=False):
        self.per_episode, self.too_long = per_episode, too_long
        self.version = 0            # the policy version the samples are of

    def samples(self, trajectories, *, collection_id=-1):
        out = []
        for _ in trajectories:
            for i in range(self.per_episode):
                length = 12 if self.too_long and i == self.per_episode - 1 else 4
                out.append(Sample(np.zeros(length, np.int32), np.arange(length) > 1, np.zeros(length, np.float32),
                                  self.version,
                                  collection=collection_id))
        return out


class Collecting(Method):
    trains_in_collections = True


def stream(log=None):
    return TaskStream(TASKS, 0, None, (log if log is not None else []).append)


def test_sync_waves_fill_in_task_order_and_count_episodes():
    strategy, counters = Strategy(failing={"t9"}), Counters()
    source = make_source(Method(too_long=True), config(), strategy, stream(), counters)
    assert isinstance(source, SyncWaves) and not isinstance(source, Collections)
    buffer, waits = SampleBuffer(), []
    source.fill(buffer, 0, wait=lambda: waits.append(1))
    # 1 trainable sample per episode (the other is too long): 2 waves of 2 episodes give 4 >= 3
    assert buffer.available(0) == 4 and source.too_long == 4 and len(waits) == 2
    assert counters.as_dict() == {"cursor": 4, "collections": 2, "episodes": 4, "failed_episodes": 0, "wall_s": 0.0,
                                  "wave_sizes": {0: 2, 1: 2}}
    order = [stream().at(i)[0].task_id for i in range(4)]
    assert sum(strategy.played, []) == order
    assert len(source.take_played()) == 4 and source.take_played() == []
    assert source.steps(3) == 3 and source.finished(2, buffer) and not source.finished(1, buffer)


def test_empty_waves_stop_the_run_with_the_last_failure():
    logged = []
    failing = {task.task_id for task in TASKS}
    source = make_source(Method(), config(), Strategy(failing), stream(logged), Counters())
    with pytest.raises(RuntimeError, match=f"{MAX_EMPTY_COLLECTIONS} consecutive waves of 2 task starts gave no "
                                           "training samples; last failure: boom"):
        source.fill(SampleBuffer(), 0, wait=lambda: None)
    assert source.counters.failed_episodes == 2 * MAX_EMPTY_COLLECTIONS
    assert len(logged) == 2 * MAX_EMPTY_COLLECTIONS and logged[0].endswith("failed: boom")


def test_collections_stop_at_their_budget_and_name_their_collection():
    counters, method = Counters(), Collecting(per_episode=1)
    source = make_source(method, config(updates=2), Strategy(), stream(), counters)
    assert isinstance(source, Collections)
    buffer = SampleBuffer()
    source.fill(buffer, 0, wait=lambda: None)
    assert counters.collections == 1 and buffer.available(0) == 3 and counters.cursor == 3
    taken = buffer.take(2, 0, allow_partial=True)
    assert source.record(taken) == {"collection": 0, "collections": 1, "collection_samples": 3}
    source.fill(buffer, 1, wait=lambda: None)          # one sample is still buffered: no new collection
    assert counters.collections == 1
    buffer.take(2, 1, allow_partial=True)
    method.version = 2
    source.fill(buffer, 2, wait=lambda: None)
    assert counters.collections == 2 and source.steps(5) == 2 and not source.finished(2, buffer)
    buffer.take(3, 2, allow_partial=True)
    source.fill(buffer, 3, wait=lambda: None)          # the budget is spent: nothing more is collected
    assert counters.collections == 2 and buffer.available(3) == 0 and source.finished(3, buffer)


def test_collections_without_a_signal_are_an_error():
    source = make_source(Collecting(per_episode=0), config(updates=5), Strategy(), stream(), Counters())
    with pytest.raises(RuntimeError, match="consecutive collections of 3 task starts gave no training samples .*"
                                           "cannot act in this format"):
        source.fill(SampleBuffer(), 0, wait=lambda: None)


def test_counters_round_trip_through_checkpoint_metadata():
    counters = Counters(cursor=9, collections=2, episodes=7, failed_episodes=1, wall_s=3.5)
    for wave in range(6):
        counters.sized(wave, 10 + wave)
    assert counters.wave_sizes == {2: 12, 3: 13, 4: 14, 5: 15}       # the latest waves only
    again = Counters()
    again.load(json.loads(json.dumps({**counters.as_dict(), "config": {"method": "actfirst"}})))  # keys as strings
    assert again == counters and isinstance(again.cursor, int) and isinstance(again.wall_s, float)


def test_a_resumed_collection_still_names_its_size():
    """The size of the collection step whose epoch a resumed run finishes comes from the checkpoint's counters."""
    counters, method = Counters(), Collecting(per_episode=1)
    source = make_source(method, config(updates=2), Strategy(), stream(), counters)
    buffer = SampleBuffer()
    source.fill(buffer, 0, wait=lambda: None)
    resumed = Counters()
    resumed.load(json.loads(json.dumps(counters.as_dict())))
    again = make_source(method, config(updates=2), Strategy(), stream(), resumed)
    assert again.record(buffer.take(2, 0, allow_partial=True))["collection_samples"] == 3
