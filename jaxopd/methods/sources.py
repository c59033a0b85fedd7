"""Where the distillation loop's training samples come from: one interface, three sources.

``SampleSource`` is what ``Trainer.run`` reads: ``start``, then per update ``fill(buffer, version, wait)`` until the
buffer holds the next batch, ``taken`` once it left, ``pause`` / ``resume`` around an evaluation, ``close``. Each
source plays episodes of the run's ``TaskStream`` (the seeded, endless order of training tasks) and keeps the run's
``Counters`` (task cursor, episodes, collections), which checkpoints carry. The three sources:

- ``AsyncRollouts``: runner threads (the papers' runners) stream episodes into the buffer while the trainer steps;
- ``SyncWaves``: between two updates, waves of ``rollout_slots`` episodes in task order (a reproducible run);
- ``Collections``: ActionOPD's collection steps, ``collection_tasks`` task starts with one behaviour snapshot,
  then one epoch of minibatches over them; the run's budget counts collection steps.

A source that spans processes (``docs/multiprocess.md``) fits the same seam.
"""
from __future__ import annotations

import abc
import dataclasses
import queue
import threading
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

import numpy as np

from jaxopd_envs.base import Task
from jaxopd_envs.references import ReferenceBuildError
from jaxopd.methods.base import Method
from jaxopd.rollout.trajectory import Trajectory
from jaxopd.sample import Sample
from jaxopd.train.buffer import SampleBuffer

__all__ = ["Counters", "TaskStream", "SampleSource", "AsyncRollouts", "SyncWaves", "Collections", "RolloutRunners",
           "Finished", "make_source"]

MAX_EMPTY_COLLECTIONS = 3      # collections / sync waves in a row without one trainable sample before giving up
MAX_FAILED_IN_A_ROW = 8        # async: this many x rollout_slots failed episodes in a row stop the run
POLL_S = 0.25                  # how often a trainer waiting for samples looks for SIGINT / SIGTERM


@dataclasses.dataclass
class Counters:
    """The run's counters that a checkpoint carries: the first task index not yet delivered (``cursor``), the
    collection steps or sync waves played, the episodes played and failed, the training wall-clock, and the
    trainable samples of the latest waves (``wave_sizes``, wave -> samples; a resumed run still names the size of
    the collection step whose epoch it finishes)."""

    cursor: int = 0
    collections: int = 0
    episodes: int = 0
    failed_episodes: int = 0
    wall_s: float = 0.0
    wave_sizes: dict[int, int] = dataclasses.field(default_factory=dict)

    KEPT_SIZES: ClassVar[int] = 4       # the buffer holds samples of the last two waves at most (lag <= 1)

    def load(self, metadata: Mapping[str, Any]) -> None:
        for field in dataclasses.fields(self):
            if field.name == "wave_sizes":      # JSON metadata keys are strings
                self.wave_sizes = {int(k): int(v) for k, v in metadata.get(field.name, {}).items()}
            elif field.name in metadata:
                setattr(self, field.name, type(getattr(self, field.name))(metadata[field.name]))

    def sized(self, wave: int, samples: int) -> None:
        self.wave_sizes[wave] = samples
        for old in sorted(self.wave_sizes)[:-self.KEPT_SIZES]:
            del self.wave_sizes[old]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class TaskStream:
    """Training task ``index`` of the run's endless stream (``at``): epoch by epoch, each a seeded permutation of
    ``tasks``, with its reference trajectory and episode seed. ``fail`` logs a failed training episode and keeps
    its error as ``last_failure``, which a stalled run reports."""

    def __init__(self, tasks: Sequence[Task], seed: int, references: Mapping[str, Any] | None,
                 log: Callable[[str], None]):
        self.tasks, self.seed, self.references, self.log = list(tasks), seed, references, log
        self._orders: dict[int, np.ndarray] = {}
        self.last_failure: str | None = None

    def at(self, index: int) -> tuple[Task, Any, int]:
        epoch, position = divmod(index, len(self.tasks))
        order = self._orders.get(epoch)
        if order is None:
            order = self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))
        task = self.tasks[int(order[position])]
        seed = int(np.random.SeedSequence([self.seed, index]).generate_state(1, np.uint32)[0])
        return task, (self.references or {}).get(task.task_id), seed

    def picks(self, indices: Iterable[int]) -> list[tuple[Task, Any, int]]:
        """The tasks at ``indices`` with their references and seeds; a task whose reference cannot be built is
        logged and left out (its episode counts as failed)."""
        picks = []
        for index in indices:
            try:
                picks.append(self.at(index))
            except ReferenceBuildError as error:
                self.fail(index, f"{type(error).__name__}: {error}")
        return picks

    def fail(self, episode: Any, error: str | None) -> None:
        self.last_failure = error
        self.log(f"training episode {episode} failed: {error}")


class SampleSource(abc.ABC):
    """Samples for the trainer (see the module docstring). ``played`` collects the trajectories played since the
    loop last read them (its rollout metrics); ``too_long`` counts the samples longer than ``max_train_tokens``,
    which cannot be trained on and are dropped."""

    unit = "update"                 # what the run's budget (``config.updates``) counts
    progress_label = "updates"

    def __init__(self, method: Method, config: Any, strategy: Any, tasks: TaskStream, counters: Counters):
        self.method, self.config, self.strategy, self.tasks, self.counters = method, config, strategy, tasks, counters
        self.played: list[Trajectory] = []
        self.too_long = 0

    def start(self, buffer: SampleBuffer, version: int) -> None:
        """Begin playing (the buffer holds what a resumed run restored)."""

    @abc.abstractmethod
    def fill(self, buffer: SampleBuffer, version: int, wait: Callable[[], None]) -> None:
        """Add samples to ``buffer`` until it holds the next batch for ``version`` (or, at the end of a budget, as
        many as there will be); ``wait()`` is called whenever the source waits (the loop's look for SIGINT /
        SIGTERM, which may raise)."""

    def taken(self, buffer: SampleBuffer, version: int) -> None:
        """A batch left ``buffer`` and the policy moved on to ``version``."""

    def pause(self) -> None:
        """Start no episode until ``resume`` (and wait for those running)."""

    def resume(self) -> None:
        pass

    def close(self) -> None:
        pass

    def checkpoint_counters(self) -> Counters:
        """The counters as a checkpoint of this moment records them."""
        return self.counters

    def steps(self, version: int) -> int:
        """The run's progress in the units its budget counts."""
        return version

    def finished(self, version: int, buffer: SampleBuffer) -> bool:
        """Whether the run has trained ``config.updates`` of its units."""
        return self.steps(version) >= self.config.updates

    def record(self, samples: Sequence[Sample]) -> dict[str, Any]:
        """What the source adds to an update's metrics, given the update's samples."""
        return {}

    def take_played(self) -> list[Trajectory]:
        played, self.played = self.played, []
        return played

    def _fit(self, samples: list[Sample]) -> list[Sample]:
        kept = [s for s in samples if len(s) <= self.config.max_train_tokens]
        self.too_long += len(samples) - len(kept)
        return kept


class AsyncRollouts(SampleSource):
    """The papers' pipeline: ``rollout_slots`` runner threads (``RolloutRunners``) play the task stream and the
    trainer takes finished episodes as they come; which sample lands in which batch depends on thread timing.
    ``MAX_FAILED_IN_A_ROW`` x ``rollout_slots`` failed episodes in a row stop the run."""

    def __init__(self, method: Method, config: Any, strategy: Any, tasks: TaskStream, counters: Counters):
        super().__init__(method, config, strategy, tasks, counters)
        self.runners = RolloutRunners(strategy, config.rollout_slots, tasks.at, counters.cursor,
                                      backlog=config.backlog_limit(), per_episode=config.max_turns)

    def start(self, buffer: SampleBuffer, version: int) -> None:
        self.runners.report(buffer.available(version))
        self.runners.resume()

    def fill(self, buffer: SampleBuffer, version: int, wait: Callable[[], None]) -> None:
        failed_in_a_row = 0
        while buffer.available(version) < self.config.batch_size:
            try:
                finished = self.runners.results.get(timeout=POLL_S)
            except queue.Empty:
                wait()
                continue
            if finished.trajectory is None:
                self.runners.delivered(0, buffer.available(version))
                self.counters.failed_episodes += 1
                failed_in_a_row += 1
                self.tasks.fail(finished.index, finished.error)
                if failed_in_a_row >= MAX_FAILED_IN_A_ROW * self.config.rollout_slots:
                    raise RuntimeError(f"{failed_in_a_row} training episodes in a row failed; "
                                       f"last failure: {finished.error}")
                continue
            failed_in_a_row = 0
            self.counters.episodes += 1
            self.played.append(finished.trajectory)
            fitted = self._fit(self.method.samples([finished.trajectory]))
            buffer.add(fitted)
            self.runners.delivered(len(fitted), buffer.available(version))
            self.counters.cursor = self.runners.low_water()

    def taken(self, buffer: SampleBuffer, version: int) -> None:
        self.runners.report(buffer.available(version))

    def pause(self) -> None:
        self.runners.pause()

    def resume(self) -> None:
        self.runners.resume()

    def close(self) -> None:
        self.runners.close()

    def checkpoint_counters(self) -> Counters:
        self.counters.cursor = self.runners.low_water()   # episodes in flight are replayed on resume
        return self.counters


class SyncWaves(SampleSource):
    """Between two updates, waves of ``rollout_slots`` episodes in task order with the current weights, their
    samples buffered in task order: a run, killed and resumed or not, gives the same losses.
    ``MAX_EMPTY_COLLECTIONS`` waves in a row without a trainable sample stop the run."""

    what = "waves"

    def __init__(self, method: Method, config: Any, strategy: Any, tasks: TaskStream, counters: Counters):
        super().__init__(method, config, strategy, tasks, counters)
        self.wave, self.wanted = config.rollout_slots, config.batch_size

    def fill(self, buffer: SampleBuffer, version: int, wait: Callable[[], None]) -> None:
        counters, empty = self.counters, 0
        while buffer.available(version) < self.wanted:
            if empty == MAX_EMPTY_COLLECTIONS:       # before the budget: a run of empty ones is an error
                raise RuntimeError(f"{self.config.method}: {empty} consecutive {self.what} of {self.wave} task "
                                   f"starts gave no training samples{self._no_samples()}")
            if self._budget_spent():
                break       # the last collection step gave nothing left to train on
            start = counters.cursor
            trajectories = self._play(self.tasks.picks(range(start, start + self.wave)))
            counters.cursor = start + self.wave
            collection = counters.collections
            counters.collections = collection + 1
            counters.episodes += len(trajectories)
            counters.failed_episodes += self.wave - len(trajectories)
            self.played.extend(trajectories)
            before = buffer.available(version)
            buffer.add(self._fit(self.method.samples(trajectories, collection_id=collection)))
            counters.sized(collection, buffer.available(version) - before)
            empty = empty + 1 if buffer.available(version) == before else 0
            wait()

    def _play(self, picks: Sequence[tuple[Task, Any, int]]) -> list[Trajectory]:
        """Every pick played once, ``rollout_slots`` at a time (``RolloutStrategy.play``); the trajectories in pick
        order, failed episodes logged and left out."""
        if not picks:
            return []
        outcomes = play_share(self.strategy, picks)
        for outcome in outcomes:
            if not outcome.ok:
                self.tasks.fail(outcome.task.task_id, outcome.error)
        return [outcome.trajectory for outcome in outcomes if outcome.ok]

    def _budget_spent(self) -> bool:
        return False

    def _no_samples(self) -> str:
        return f"; last failure: {self.tasks.last_failure}"


def play_share(strategy: Any, picks: Sequence[tuple[Task, Any, int]]) -> list[Any]:
    """The outcomes of ``picks`` in pick order. In a multi-process run (``jaxopd.train.distributed``) process p of P
    plays picks p, p + P, … on its own engine and environments, and the outcomes are all-gathered, so that every
    process holds the whole wave, as one process would have played it (each request's sampling seed is its task's
    and turn's, not its engine's)."""
    import jax

    from jaxopd.train import distributed

    count, index = jax.process_count(), jax.process_index()
    mine = list(picks[index::count]) if count > 1 else list(picks)
    outcomes: list[Any] = []
    if mine:
        references = {task.task_id: reference for task, reference, _ in mine if reference is not None}
        outcomes = list(strategy.play([task for task, _, _ in mine], references, seeds=[seed for _, _, seed in mine]))
    if count == 1:
        return outcomes
    shares = distributed.allgather_objects(outcomes)
    return [shares[i % count][i // count] for i in range(len(picks))]


class Collections(SyncWaves):
    """ActionOPD's collection steps (its App. A.4, Table 8): ``collection_tasks`` task starts played with one
    behaviour snapshot, then one epoch of minibatches over what they gave; the run's budget counts collection steps,
    and it ends once the last one's epoch is trained."""

    what = "collections"
    unit = "collection"
    progress_label = "collection steps"

    def __init__(self, method: Method, config: Any, strategy: Any, tasks: TaskStream, counters: Counters):
        super().__init__(method, config, strategy, tasks, counters)
        self.wave, self.wanted = config.collection_tasks, 1

    def steps(self, version: int) -> int:
        return self.counters.collections

    def finished(self, version: int, buffer: SampleBuffer) -> bool:
        return self.counters.collections >= self.config.updates and buffer.available(version) == 0

    def record(self, samples: Sequence[Sample]) -> dict[str, Any]:
        collection = max(sample.collection for sample in samples)   # which collection step this minibatch is of
        return {"collection": collection, "collections": self.counters.collections,
                "collection_samples": self.counters.wave_sizes.get(collection, -1)}

    def _budget_spent(self) -> bool:
        return self.counters.collections >= self.config.updates

    def _no_samples(self) -> str:
        return (" (no state had a valid teacher action and a reward range among its candidates); the teacher or "
                "the student cannot act in this format")


def make_source(method: Method, config: Any, strategy: Any, tasks: TaskStream, counters: Counters) -> SampleSource:
    """The run's source: ActionOPD's collections, else sync waves or async rollouts by ``config.rollout_mode``."""
    if method.trains_in_collections:
        return Collections(method, config, strategy, tasks, counters)
    if config.rollout_mode == "sync":
        return SyncWaves(method, config, strategy, tasks, counters)
    return AsyncRollouts(method, config, strategy, tasks, counters)


# ----------------------------------------------------------------------------------------------------------
# The runner threads of the asynchronous source
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Finished:
    index: int
    trajectory: Trajectory | None
    error: str | None = None


class RolloutRunners:
    """``slots`` host threads that play training tasks ``task_at(i)`` for i = cursor, cursor + 1, ... and put
    every finished episode on ``results``. ``pause()`` stops starting episodes and waits for the running ones.

    Backpressure: with a ``backlog`` (samples), a runner starts an episode only while the samples ahead of the
    trainer (``queued``, the fresh samples the trainer reports buffered, plus ``per_episode`` for each episode
    running or delivered and not yet taken in with ``delivered``) stay below it; one episode may always run.
    Without it the runners play without pause and most of what they play goes stale before the trainer can take
    it (2026-12-03, 10 CPU updates of vanilla OPD: 20 episodes played and 223 samples dropped without a bound, 11
    and 33 with the default one, in the same wall-clock)."""

    def __init__(self, strategy: Any, slots: int, task_at: Callable[[int], tuple[Task, Any, int]], start: int,
                 *, backlog: int | None = None, per_episode: float = 1.0):
        self.strategy = strategy
        self.task_at = task_at
        self.results: queue.Queue[Finished] = queue.Queue()
        self._next = start
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._stop = threading.Event()
        self._busy = 0
        self._idle = threading.Condition(self._lock)
        self._backlog = backlog
        self._queued = 0
        self._undelivered = 0       # episodes put on results and not yet taken in by the trainer
        self._per_episode = float(per_episode)
        self._episodes_seen = 0
        self._samples_seen = 0
        self.max_busy = 0           # the most episodes played at once (for tests and logs)
        self._threads = [threading.Thread(target=self._loop, args=(slot,), name=f"rollout-runner-{slot}",
                                          daemon=True) for slot in range(slots)]
        self._in_flight: set[int] = set()
        for thread in self._threads:
            thread.start()

    def resume(self) -> None:
        with self._idle:
            self._running.set()
            self._idle.notify_all()

    def pause(self) -> None:
        with self._idle:
            self._running.clear()
            self._idle.notify_all()
            self._idle.wait_for(lambda: self._busy == 0)

    def report(self, queued: int) -> None:
        """The trainer's count of fresh buffered samples (after it buffers or takes samples, or a version
        passes)."""
        with self._idle:
            self._queued = int(queued)
            self._idle.notify_all()

    def delivered(self, samples: int, queued: int) -> None:
        """The trainer took in one result of ``results`` that gave ``samples`` samples (0 for a failed
        episode) and now holds ``queued`` fresh ones."""
        with self._idle:
            self._undelivered -= 1
            if samples:
                self._episodes_seen += 1
                self._samples_seen += int(samples)
                self._per_episode = self._samples_seen / self._episodes_seen
            self._queued = int(queued)
            self._idle.notify_all()

    def _may_start(self) -> bool:
        if self._backlog is None or self._busy + self._undelivered == 0:    # never let the trainer starve
            return True
        return self._queued + (self._busy + self._undelivered) * self._per_episode < self._backlog

    def low_water(self) -> int:
        """The first task index whose episode has not been delivered: where a resumed run starts again."""
        with self._lock:
            return min(self._in_flight) if self._in_flight else self._next

    def close(self) -> None:
        with self._idle:
            self._stop.set()
            self._running.set()
            self._idle.notify_all()
        for thread in self._threads:
            thread.join(timeout=600)

    def _loop(self, slot: int) -> None:
        while True:
            self._running.wait()
            if self._stop.is_set():
                return
            with self._idle:
                self._idle.wait_for(lambda: self._stop.is_set() or not self._running.is_set() or self._may_start())
                if self._stop.is_set():
                    return
                if not self._running.is_set():
                    continue
                index = self._next
                self._next += 1
                self._busy += 1
                self.max_busy = max(self.max_busy, self._busy)
                self._in_flight.add(index)
            try:
                try:     # the task's reference may be built here, and fail: that episode fails, not the runner
                    task, reference, seed = self.task_at(index)
                    trajectory = self.strategy.run_episode(slot, task, reference, seed=seed)
                    finished = Finished(index, trajectory)
                except Exception as error:  # noqa: BLE001 - one failed episode never stops the run
                    finished = Finished(index, None, f"{type(error).__name__}: {error}")
                with self._idle:
                    self._undelivered += 1
                self.results.put(finished)
            finally:
                with self._idle:
                    self._busy -= 1
                    self._in_flight.discard(index)
                    self._idle.notify_all()
