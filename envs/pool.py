"""A pool of text environments stepped concurrently, in host threads or in worker processes, with per-call
timeouts and crash recovery.

Owns the slot → environment mapping, the two ways of running environment calls ("thread": every
environment lives in this process and a bounded thread pool runs the calls; "process": environments live
in worker processes, each a one-process ``concurrent.futures.ProcessPoolExecutor``, and host threads wait
on their futures), the per-slot trajectory record (task, actions, observations), and recovery: a failed
environment (exception, timeout, or a worker process that died) is discarded, rebuilt through its factory
and brought back to the same point by replaying reset + the slot's actions, each replayed observation
checked against the recorded one, so no trajectory is lost or mixed with another.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, TypeVar

from jaxopd_envs.base import EnvError, Observation, Task, TextEnv, require_int
from jaxopd_envs.checks import observation_texts_equivalent
from jaxopd_envs.workers import worker_init

logger = logging.getLogger(__name__)

__all__ = ["EnvPool", "EnvTimeoutError", "EngineBusyError", "WorkerLostError", "SlotTrajectory",
           "BENCHMARK_EQUIVALENCE", "BACKENDS", "START_METHODS", "default_backend", "env_class_of"]

BENCHMARK_EQUIVALENCE = "benchmark"     # verify_replay default: the benchmark's App. B.5 observation normal form
AUTO_BACKEND = "auto"
BACKENDS = ("thread", "process")
# Never "fork": a forked child inherits JAX's (and py4j's) threads in whatever state they were, and locks
# held at that instant stay held forever in the child.
START_METHODS = ("spawn", "forkserver")

_T = TypeVar("_T")


class EnvTimeoutError(EnvError):
    """An environment call did not return within the pool's timeout."""


class EngineBusyError(EnvTimeoutError):
    """A call could not even start: the lock its engine shares with other environments stayed taken.

    The environment itself never ran, so it is kept (not rebuilt)."""


class WorkerLostError(EnvError):
    """The worker process that held an environment died or was stopped; the environment is gone."""


@dataclasses.dataclass(frozen=True)
class SlotTrajectory:
    """What one slot has played since its last reset: o_1, a_1, o_2, ...

    ``observations[i + 1]`` is the observation that followed ``actions[i]``.
    """

    slot: int
    task: Task | None
    actions: tuple[str, ...]
    observations: tuple[Observation, ...]
    recoveries: int                     # environment rebuilds of this slot over the pool's life


def env_class_of(env_factory: Callable[[], TextEnv]) -> type[TextEnv] | None:
    """The ``TextEnv`` class a factory builds, when it is one (or a ``functools.partial`` of one), else None."""
    function = env_factory
    while isinstance(function, functools.partial):
        function = function.func
    return function if isinstance(function, type) and issubclass(function, TextEnv) else None


def default_backend(env_factory: Callable[[], TextEnv]) -> str:
    """The backend chosen per benchmark: the env class's ``pool_backend`` (ALFWorld: "process",
    ScienceWorld: "thread"). A factory that is not a class or a partial of one (a lambda, which a worker
    process could not receive anyway) runs in threads."""
    env_class = env_class_of(env_factory)
    return "thread" if env_class is None else env_class.pool_backend


def _call_with_timeout(fn: Callable[[], _T], timeout_s: float | None, description: str, *,
                       on_late_result: Callable[[Any], None] | None = None, lock: Any = None,
                       lock_wait_s: float | None = None, on_abandon: Callable[[], None] | None = None) -> _T:
    """Run ``fn`` in a daemon thread and wait at most ``timeout_s`` for it (None: run inline, no limit).

    ``lock`` (an engine's lock shared with other environments) is acquired by that thread before the
    clock starts, so the timeout counts the call only, never the wait for others; if it is not acquired
    within ``lock_wait_s`` the call is dropped without running (``EngineBusyError``). A call that times
    out is abandoned: ``on_abandon`` runs (e.g. to stop the worker process running it), and if it later
    returns, ``on_late_result`` receives the value (e.g. to close an environment built too late).
    """
    if timeout_s is None:
        if lock is None:
            return fn()
        with lock:
            return fn()
    outcome: concurrent.futures.Future = concurrent.futures.Future()
    started = threading.Event()
    handoff = threading.Lock()          # decides, once, whether the waiter or the late result handler owns the value
    abandoned = False

    def target() -> None:
        if lock is not None:
            lock.acquire()
        try:
            with handoff:
                if abandoned:           # the waiter gave up before the call could start: never start it
                    return
                started.set()
            try:
                value = fn()
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                with handoff:
                    outcome.set_exception(error)
                return
            with handoff:
                outcome.set_result(value)
                late = abandoned
            if late and on_late_result is not None:
                on_late_result(value)
        finally:
            if lock is not None:
                lock.release()

    threading.Thread(target=target, name=f"envcall:{description[:40]}", daemon=True).start()
    if not started.wait(lock_wait_s):
        with handoff:
            abandoned = not started.is_set()
        if abandoned:
            raise EngineBusyError(f"{description} could not start within {lock_wait_s:g} s: its engine stayed busy")
    try:
        return outcome.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        with handoff:
            if not outcome.done():
                abandoned = True
        if not abandoned:               # finished in the instant between the timeout and the lock
            return outcome.result()
        if on_abandon is not None:
            on_abandon()
        raise EnvTimeoutError(f"{description} did not return within {timeout_s:g} s") from None


def _close_quietly(env: TextEnv) -> None:
    try:
        env.close()
    except Exception:                   # noqa: BLE001 - a broken environment may fail to close
        logger.warning("closing a discarded environment failed", exc_info=True)


def _close_in_background(env: TextEnv) -> None:
    threading.Thread(target=_close_quietly, args=(env,), name="envpool-close", daemon=True).start()


# ------------------------------------------------------------------------------- worker process side
# These run inside a worker process: the environments of that worker, by id.

_WORKER_ENVS: dict[int, TextEnv] = {}


_worker_init = worker_init     # ignore Ctrl-C, exit with the parent (jaxopd_envs.workers)


def _worker_build(env_id: int, env_factory: Callable[[], TextEnv]) -> str:
    env = env_factory()
    if not isinstance(env, TextEnv):
        raise EnvError(f"env_factory returned {type(env).__name__}, not a TextEnv")
    _WORKER_ENVS[env_id] = env
    return env.benchmark


def _worker_call(env_id: int, method: str, args: tuple) -> Any:
    env = _WORKER_ENVS.get(env_id)
    if env is None:
        raise EnvError(f"environment {env_id} is not in worker process {os.getpid()}")
    return getattr(env, method)(*args)


def _worker_close(env_ids: list[int] | None) -> None:
    """Close the given environments of this worker (None: all of them)."""
    for env_id in list(_WORKER_ENVS) if env_ids is None else env_ids:
        env = _WORKER_ENVS.pop(env_id, None)
        if env is not None:
            _close_quietly(env)


# ------------------------------------------------------------------------------- host side of a worker


class _Worker:
    """One worker process (a ``ProcessPoolExecutor`` with one process) and the environments it owns.

    The process runs one call at a time; ``lock`` is held by the host thread whose call is in flight, so
    the pool times a call from the moment it owns the worker. ``generation`` numbers the processes: when
    one dies (or is stopped because a call hung), the next call starts a new process under a new
    generation, and environments of an older generation are gone (``WorkerLostError``).
    """

    def __init__(self, index: int, context: multiprocessing.context.BaseContext) -> None:
        self.index = index
        self.lock = threading.RLock()
        self._context = context
        self._state_lock = threading.Lock()
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._alive = False
        self.generation = 0
        self.pid: int | None = None

    def live_generation(self) -> int:
        """The generation of the running process, starting a new process when there is none."""
        with self._state_lock:
            if not self._alive:
                if self._executor is not None:
                    self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = concurrent.futures.ProcessPoolExecutor(1, mp_context=self._context,
                                                                        initializer=_worker_init,
                                                                        initargs=(os.getpid(),))
                self.generation += 1
                try:
                    self.pid = self._executor.submit(os.getpid).result()   # starts the process
                except BrokenProcessPool as error:
                    raise WorkerLostError(f"worker process {self.index} failed to start: {error}") from error
                self._alive = True
            return self.generation

    def call(self, generation: int, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` in the process of ``generation`` and wait for it."""
        with self.lock:
            with self._state_lock:
                if generation != self.generation or not self._alive:
                    raise WorkerLostError(f"worker process {self.index} was replaced: its environments are gone")
                executor, pid = self._executor, self.pid
            try:
                return executor.submit(fn, *args).result()
            except BrokenProcessPool as error:
                self._mark_dead(generation)
                raise WorkerLostError(f"worker process {self.index} (pid {pid}) died: {error}") from error

    def send(self, generation: int, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` in the process of ``generation`` without waiting (a no-op if it is gone)."""
        with self._state_lock:
            if generation != self.generation or not self._alive:
                return
            executor = self._executor
        try:
            executor.submit(fn, *args)
        except (BrokenProcessPool, RuntimeError):
            self._mark_dead(generation)

    def kill(self, generation: int | None = None) -> None:
        """Stop the process (of ``generation``; None: whichever runs) at once, e.g. under a hung call."""
        with self._state_lock:
            if not self._alive or generation not in (None, self.generation):
                return
            self._alive, pid = False, self.pid
        logger.warning("stopping worker process %d (pid %s)", self.index, pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _mark_dead(self, generation: int) -> None:
        with self._state_lock:
            if generation == self.generation:
                self._alive = False

    def shutdown(self, timeout_s: float | None) -> None:
        """Close the worker's environments (waiting at most ``timeout_s``), stop its process and join it."""
        with self._state_lock:
            executor, alive, pid = self._executor, self._alive, self.pid
            self._executor, self._alive = None, False
        if executor is None:
            return
        if alive:
            try:
                executor.submit(_worker_close, None).result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                logger.warning("worker process %d did not close its environments in %s s; stopping it",
                               self.index, timeout_s)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            except Exception:           # noqa: BLE001 - a dead worker cannot close anything
                pass
        executor.shutdown(wait=True, cancel_futures=True)


class _RemoteEnv(TextEnv):
    """A ``TextEnv`` that lives in a worker process: each call runs there, one call per worker at a time."""

    def __init__(self, worker: _Worker, generation: int, env_id: int, benchmark: str) -> None:
        self.benchmark = benchmark
        self.call_lock = worker.lock
        self.worker = worker
        self.generation = generation
        self.env_id = env_id
        self._in_flight = False
        self._closed = False

    def tasks(self, split: str):
        return self._call("tasks", split)

    def reset(self, task: Task) -> Observation:
        return self._call("reset", task)

    def step(self, action: str) -> Observation:
        return self._call("step", action)

    def _call(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise EnvError("this environment's handle is closed")
        with self.worker.lock:
            self._in_flight = True
            try:
                return self.worker.call(self.generation, _worker_call, self.env_id, method, args)
            finally:
                self._in_flight = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._in_flight:             # a call the pool gave up on still runs: stop its process
            self.worker.kill(self.generation)
        else:
            self.worker.send(self.generation, _worker_close, [self.env_id])


# --------------------------------------------------------------------------------------------- the pool


@dataclasses.dataclass
class _Operation:
    run: Callable[["_Slot"], Observation]
    future: concurrent.futures.Future


class _Slot:
    """One environment position: its env (None until built / after a failure), history and queue."""

    def __init__(self, index: int):
        self.index = index
        self.env: TextEnv | None = None
        self.task: Task | None = None
        self.actions: list[str] = []
        self.observations: list[Observation] = []
        self.recoveries = 0
        self.env_lock = threading.Lock()        # held while a thread uses ``env`` or the history
        self.queue_lock = threading.Lock()      # guards ``pending`` and ``scheduled``, and orders submit vs close
        self.pending: collections.deque[_Operation] = collections.deque()
        self.scheduled = False                  # an operation of this slot is queued or running


class EnvPool:
    """Steps ``num_slots`` environments concurrently, in host threads or in worker processes.

    Each slot owns one environment built by ``env_factory`` (lazily, on its first call, or all at once
    by :meth:`warm_up`). Calls on one slot run one at a time and in submission order; calls on
    different slots run concurrently, at most ``max_workers`` at once. The interface is the same for
    both backends: ``submit_reset``/``submit_step`` return futures, ``areset``/``astep`` are their
    ``asyncio`` forms, and ``trajectory`` is kept in this process.

    ``backend``: "thread" runs environments in this process, calls in a pool of ``max_workers`` threads
    (default ``num_slots``); "process" gives each of ``max_workers`` worker processes (default: the
    number of CPUs, at most ``num_slots``) the environments of slots ``i, i + max_workers, ...``, built
    there by ``env_factory`` (which must then be picklable: a class or ``functools.partial``), started
    with ``start_method`` ("spawn" or "forkserver"; never "fork"). "auto" (default) chooses per
    benchmark from the env class (``TextEnv.pool_backend``): ALFWorld processes, ScienceWorld threads.

    Timeouts count the call only: an engine that serialises its instances (``TextEnv.call_lock``; a
    worker process runs one call at a time) is acquired before the clock starts, and a call that cannot
    start within ``call_timeout_s * num_slots`` fails with ``EngineBusyError`` without touching the
    environment. A call past ``call_timeout_s`` is abandoned: in a worker process the process is stopped
    (the call ends with it); a thread cannot be stopped, so there the call runs on in its daemon thread.

    Failure handling: a call that raises (anything but ``ValueError``, which signals bad input and
    leaves the environment untouched) or that exceeds ``call_timeout_s`` marks the environment as
    failed. It is discarded (closed in the background), a new one is built by the factory, reset to
    the slot's task and given the slot's actions again, and the call is retried, up to ``max_retries``
    times. A worker process that dies takes its environments with it: each of its slots is rebuilt and
    replayed the same way on its next call, in a new process. If every attempt fails, the call's future
    raises ``EnvError`` (``EnvTimeoutError`` for a timeout); the slot's recorded trajectory is unchanged
    and its next call rebuilds and replays.

    ``verify_replay`` decides whether a replayed observation is the recorded one: by default
    (``"benchmark"``) the same termination flag and equal text in the benchmark's App. B.5 normal
    form (``jaxopd_envs.checks.observation_texts_equivalent``; ScienceWorld may enumerate objects in another
    order after a reset); or a callable ``(recorded, replayed) -> bool``; or None (no check). A replay
    that does not match is a failed attempt: the trajectory is never continued from another state.

    :meth:`close` fails queued calls with ``EnvError("pool closed: ...")``, waits for running ones, closes
    every environment and joins every worker process; a submit racing it either raises that error or
    returns a future that ends. (``multiprocessing``'s own helper, the resource tracker, is shared by the
    whole interpreter and stays.)
    """

    def __init__(self, env_factory: Callable[[], TextEnv], num_slots: int, *, backend: str = AUTO_BACKEND,
                 max_workers: int | None = None, start_method: str = "spawn",
                 call_timeout_s: float | None = 60.0, build_timeout_s: float | None = 300.0, max_retries: int = 1,
                 verify_replay: Callable[[Observation, Observation], bool] | str | None = BENCHMARK_EQUIVALENCE):
        if not callable(env_factory):
            raise ValueError("env_factory must be a callable returning a TextEnv")
        num_slots = require_int(num_slots, "num_slots", minimum=1)
        if max_workers is not None:
            max_workers = require_int(max_workers, "max_workers", minimum=1)
        for name, value in (("call_timeout_s", call_timeout_s), ("build_timeout_s", build_timeout_s)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        max_retries = require_int(max_retries, "max_retries", minimum=0)
        if not (verify_replay is None or callable(verify_replay) or verify_replay == BENCHMARK_EQUIVALENCE):
            raise ValueError(f"verify_replay must be a callable, None or {BENCHMARK_EQUIVALENCE!r}, "
                             f"got {verify_replay!r}")
        if backend == AUTO_BACKEND:
            backend = default_backend(env_factory)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be {AUTO_BACKEND!r} or one of {BACKENDS}, got {backend!r}")
        self.env_factory = env_factory
        self.num_slots = num_slots
        self.backend = backend
        self.call_timeout_s = call_timeout_s
        self.build_timeout_s = build_timeout_s
        self.max_retries = max_retries
        self.verify_replay = verify_replay
        self.envs_built = 0                      # factory calls that returned an environment
        self._count_lock = threading.Lock()
        self._env_ids = itertools.count()
        self._workers: list[_Worker] = []
        if backend == "thread":
            self.max_workers = max_workers or num_slots
            threads = self.max_workers
        else:
            if start_method not in START_METHODS:
                raise ValueError(f"start_method must be one of {START_METHODS} (never 'fork' under JAX), "
                                 f"got {start_method!r}")
            try:
                pickle.dumps(env_factory)
            except Exception as error:
                raise ValueError(f"the process backend needs a picklable env_factory (a TextEnv class or a "
                                 f"functools.partial of one): {error}") from error
            self.max_workers = min(max_workers or os.cpu_count() or 1, num_slots)
            context = multiprocessing.get_context(start_method)
            self._workers = [_Worker(i, context) for i in range(self.max_workers)]
            threads = num_slots                  # a host thread waits for each slot; the processes bound the work
        self.start_method = start_method if backend == "process" else None
        self._slots = [_Slot(i) for i in range(num_slots)]
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="envpool")
        self._closed = False
        self._close_lock = threading.Lock()

    # -- public API ---------------------------------------------------------------------------------
    def submit_reset(self, slot: int, task: Task) -> concurrent.futures.Future:
        """Reset ``slot``'s environment to ``task``; the future gives o_1. Clears the slot's trajectory."""
        if not isinstance(task, Task):
            raise ValueError(f"task must be a jaxopd_envs.base.Task, got {type(task).__name__}")
        return self._submit(slot, lambda s: self._reset(s, task))

    def submit_step(self, slot: int, action: str) -> concurrent.futures.Future:
        """Execute ``action`` in ``slot``'s episode; the future gives the next observation."""
        if not isinstance(action, str):
            raise ValueError(f"action must be a str, got {type(action).__name__}")
        return self._submit(slot, lambda s: self._step(s, action))

    async def areset(self, slot: int, task: Task) -> Observation:
        """``asyncio`` form of :meth:`submit_reset`."""
        return await asyncio.wrap_future(self.submit_reset(slot, task))

    async def astep(self, slot: int, action: str) -> Observation:
        """``asyncio`` form of :meth:`submit_step`."""
        return await asyncio.wrap_future(self.submit_step(slot, action))

    def reset(self, slot: int, task: Task) -> Observation:
        """Blocking :meth:`submit_reset`."""
        return self.submit_reset(slot, task).result()

    def step(self, slot: int, action: str) -> Observation:
        """Blocking :meth:`submit_step`."""
        return self.submit_step(slot, action).result()

    def warm_up(self) -> None:
        """Build every slot's environment now, concurrently (otherwise each is built on first use)."""
        futures = [self._submit(i, self._build_only) for i in range(self.num_slots)]
        for future in futures:
            future.result()

    def trajectory(self, slot: int) -> SlotTrajectory:
        """A snapshot of what ``slot`` has played since its last reset."""
        state = self._slot(slot)
        with state.env_lock:
            return SlotTrajectory(slot=state.index, task=state.task, actions=tuple(state.actions),
                                  observations=tuple(state.observations), recoveries=state.recoveries)

    def trajectories(self) -> list[SlotTrajectory]:
        return [self.trajectory(i) for i in range(self.num_slots)]

    @property
    def recoveries(self) -> int:
        """Environment rebuilds after failures, over all slots."""
        return sum(s.recoveries for s in self._slots)

    @property
    def worker_pids(self) -> list[int | None]:
        """Process ids of the worker processes ("process" backend; None: not started or stopped)."""
        return [w.pid if w._alive else None for w in self._workers]

    def worker_of(self, slot: int) -> int:
        """Index of the worker process that holds ``slot``'s environment ("process" backend)."""
        if self.backend != "process":
            raise ValueError("worker_of() is only defined for the process backend")
        return self._slot(slot).index % len(self._workers)

    def close(self) -> None:
        """Fail queued calls, wait for running ones, close every environment and worker. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True          # from here on no submit gets past its slot's queue lock
        for state in self._slots:
            with state.queue_lock:
                pending, state.pending = list(state.pending), collections.deque()
            for operation in pending:
                if operation.future.set_running_or_notify_cancel():
                    operation.future.set_exception(EnvError("pool closed: the environment pool was closed "
                                                            "before this call ran"))
        self._executor.shutdown(wait=True)
        for state in self._slots:
            with state.env_lock:
                env, state.env = state.env, None
            if env is not None and self.backend == "thread":
                try:
                    _call_with_timeout(lambda e=env: _close_quietly(e), self.call_timeout_s, "close")
                except EnvTimeoutError:
                    logger.warning("slot %d: closing its environment timed out", state.index)
        for worker in self._workers:     # closes the worker's environments, then joins its process
            worker.shutdown(self.call_timeout_s)

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- scheduling ------------------------------------------------------------------------------
    def _slot(self, slot: int) -> _Slot:
        try:
            index = require_int(slot, "slot")
        except ValueError:
            index = -1
        if not 0 <= index < self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots}), got {slot!r}")
        return self._slots[index]

    def _submit(self, slot: int, run: Callable[[_Slot], Observation]) -> concurrent.futures.Future:
        state = self._slot(slot)
        operation = _Operation(run=run, future=concurrent.futures.Future())
        with state.queue_lock:
            # Checked under the slot's queue lock: close() sets the flag first and then drains every queue
            # under the same lock, so an operation queued here is either drained (failed) by close() or
            # scheduled before the thread pool shuts down. No future is left pending.
            if self._closed:
                raise EnvError("pool closed: the environment pool accepts no calls after close()")
            state.pending.append(operation)
            if not state.scheduled:
                state.scheduled = True
                self._executor.submit(self._run_next, state)
        return operation.future

    def _run_next(self, state: _Slot) -> None:
        """Run the slot's oldest queued call, then re-queue the slot if more calls wait (fair across slots)."""
        with state.queue_lock:
            operation = state.pending.popleft() if state.pending else None
        if operation is not None and operation.future.set_running_or_notify_cancel():
            try:
                with state.env_lock:
                    result = operation.run(state)
            except BaseException as error:  # noqa: BLE001 - delivered through the future
                operation.future.set_exception(error)
            else:
                operation.future.set_result(result)
        with state.queue_lock:
            if state.pending and not self._closed:
                self._executor.submit(self._run_next, state)
            else:
                state.scheduled = False     # after close() the remaining operations are drained by close()

    # -- environment calls with recovery -------------------------------------------------------------
    def _lock_wait_s(self, timeout_s: float | None) -> float | None:
        """How long a call may wait for its engine: every other slot's call ahead of it, each within its timeout."""
        return None if timeout_s is None else timeout_s * self.num_slots

    def _build(self, state: _Slot) -> TextEnv:
        description = f"slot {state.index}: build"
        if self.backend == "thread":
            # no engine lock here: a factory may generate games for minutes, and builds have their own timeout
            env = _call_with_timeout(self.env_factory, self.build_timeout_s, description,
                                     on_late_result=_close_in_background)
        else:
            worker = self._workers[state.index % len(self._workers)]
            env = _call_with_timeout(lambda: self._build_in_worker(worker), self.build_timeout_s, description,
                                     on_late_result=_close_in_background, lock=worker.lock,
                                     lock_wait_s=self._lock_wait_s(self.build_timeout_s), on_abandon=worker.kill)
        if not isinstance(env, TextEnv):
            raise EnvError(f"env_factory returned {type(env).__name__}, not a TextEnv")
        with self._count_lock:
            self.envs_built += 1
        return env

    def _build_in_worker(self, worker: _Worker) -> _RemoteEnv:
        generation = worker.live_generation()
        env_id = next(self._env_ids)
        benchmark = worker.call(generation, _worker_build, env_id, self.env_factory)
        return _RemoteEnv(worker, generation, env_id, benchmark)

    def _build_only(self, state: _Slot) -> None:
        if state.env is None:
            state.env = self._build(state)
            if state.task is not None:
                self._replay(state, state.env)

    def _timed(self, env: TextEnv, fn: Callable[[], _T], description: str) -> _T:
        return _call_with_timeout(fn, self.call_timeout_s, description, lock=env.call_lock,
                                  lock_wait_s=self._lock_wait_s(self.call_timeout_s))

    def _replay(self, state: _Slot, env: TextEnv) -> None:
        """Bring a fresh ``env`` to the slot's recorded point: reset(task) then every recorded action."""
        where = f"slot {state.index} replay of {state.task.task_id}"
        replayed = [self._timed(env, lambda: env.reset(state.task), f"{where}: reset")]
        for turn, action in enumerate(state.actions, start=1):
            replayed.append(self._timed(env, lambda a=action: env.step(a), f"{where}: step {turn}"))
        if self.verify_replay is None:
            return
        if self.verify_replay == BENCHMARK_EQUIVALENCE:
            def matches(recorded: Observation, now: Observation) -> bool:
                return recorded.done == now.done and observation_texts_equivalent(env.benchmark, recorded.text,
                                                                                  now.text)
        else:
            matches = self.verify_replay
        for turn, (recorded, now) in enumerate(zip(state.observations, replayed)):
            if not matches(recorded, now):
                raise EnvError(f"{where} diverged at turn {turn}: recorded {recorded.text[:200]!r}, "
                               f"replayed {now.text[:200]!r}")

    def _discard(self, state: _Slot, description: str, error: BaseException) -> None:
        """Drop a failed environment (closed in the background); the slot's next attempt rebuilds it."""
        env, state.env = state.env, None
        state.recoveries += 1
        logger.warning("slot %d: %s failed (%s: %s); the environment is rebuilt and the episode replayed "
                       "(recovery %d)", state.index, description, type(error).__name__, error, state.recoveries)
        if env is not None:
            _close_in_background(env)

    def _call(self, state: _Slot, description: str, call: Callable[[TextEnv], Observation]) -> Observation:
        last_error: BaseException | None = None
        for _ in range(self.max_retries + 1):
            try:
                if state.env is None:
                    state.env = self._build(state)
                    if state.task is not None:
                        self._replay(state, state.env)
                env = state.env
            except EngineBusyError as error:    # nothing ran; a half-replayed env is still discarded
                last_error = error
                if state.env is not None:
                    self._discard(state, f"rebuild before {description}", error)
                continue
            except Exception as error:  # noqa: BLE001 - a failed rebuild is one more failed attempt
                last_error = error
                self._discard(state, f"rebuild before {description}", error)
                continue
            try:
                return self._timed(env, functools.partial(call, env), f"slot {state.index}: {description}")
            except ValueError:
                raise                       # bad input: the environment is fine and stays
            except EngineBusyError as error:
                last_error = error          # the call never started: the environment is fine and stays
            except Exception as error:  # noqa: BLE001 - any other failure means a broken environment
                last_error = error
                self._discard(state, description, error)
        error_type = (EngineBusyError if isinstance(last_error, EngineBusyError)
                      else EnvTimeoutError if isinstance(last_error, EnvTimeoutError) else EnvError)
        raise error_type(f"slot {state.index}: {description} failed after {self.max_retries + 1} attempt(s): "
                         f"{type(last_error).__name__}: {last_error}") from last_error

    def _reset(self, state: _Slot, task: Task) -> Observation:
        state.task, state.actions, state.observations = None, [], []   # nothing to replay before a reset
        observation = self._call(state, f"reset({task.task_id})", lambda env: env.reset(task))
        state.task, state.observations = task, [observation]
        return observation

    def _step(self, state: _Slot, action: str) -> Observation:
        if state.task is None:
            raise ValueError(f"slot {state.index}: step() before a successful reset()")
        observation = self._call(state, f"step {len(state.actions) + 1} ({action!r})", lambda env: env.step(action))
        state.actions.append(action)
        state.observations.append(observation)
        return observation
