"""A pool of text environments stepped concurrently in host threads, with per-call timeouts and crash recovery.

Owns the slot → environment mapping, the bounded thread pool that runs environment calls, the
per-slot trajectory record (task, actions, observations), and recovery: a failed environment
(exception or timeout) is discarded, rebuilt through its factory and brought back to the same point
by replaying reset + the slot's actions, so no trajectory is lost or mixed with another.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any, Callable, TypeVar

from envs.base import EnvError, Observation, Task, TextEnv
from envs.checks import observation_texts_equivalent

logger = logging.getLogger(__name__)

__all__ = ["EnvPool", "EnvTimeoutError", "SlotTrajectory", "BENCHMARK_EQUIVALENCE"]

BENCHMARK_EQUIVALENCE = "benchmark"     # verify_replay default: the benchmark's App. B.5 observation normal form

_T = TypeVar("_T")


class EnvTimeoutError(EnvError):
    """An environment call did not return within the pool's timeout."""


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


def _call_with_timeout(fn: Callable[[], _T], timeout_s: float | None, description: str,
                       on_late_result: Callable[[Any], None] | None = None) -> _T:
    """Run ``fn`` in a daemon thread and wait at most ``timeout_s`` (None: run inline, no limit).

    A call that times out keeps running in its (daemon) thread, which exit does not wait for; if it
    later returns, ``on_late_result`` receives the value (e.g. to close an environment built too late).
    """
    if timeout_s is None:
        return fn()
    outcome: concurrent.futures.Future = concurrent.futures.Future()
    handoff = threading.Lock()          # decides, once, whether the waiter or the late result handler owns the value
    abandoned = False

    def target() -> None:
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

    threading.Thread(target=target, name=f"envcall:{description[:40]}", daemon=True).start()
    try:
        return outcome.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        with handoff:
            if not outcome.done():
                abandoned = True
        if not abandoned:               # finished in the instant between the timeout and the lock
            return outcome.result()
        raise EnvTimeoutError(f"{description} did not return within {timeout_s:g} s") from None


def _close_quietly(env: TextEnv) -> None:
    try:
        env.close()
    except Exception:                   # noqa: BLE001 - a broken environment may fail to close
        logger.warning("closing a discarded environment failed", exc_info=True)


def _close_in_background(env: TextEnv) -> None:
    threading.Thread(target=_close_quietly, args=(env,), name="envpool-close", daemon=True).start()


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
        self.queue_lock = threading.Lock()      # guards ``pending`` and ``scheduled``
        self.pending: collections.deque[_Operation] = collections.deque()
        self.scheduled = False                  # an operation of this slot is queued or running


class EnvPool:
    """Steps ``num_slots`` environments concurrently through a bounded thread pool.

    Each slot owns one environment built by ``env_factory`` (lazily, on its first call, or all at once
    by :meth:`warm_up`). Calls on one slot run one at a time and in submission order; calls on
    different slots run concurrently, at most ``max_workers`` at once.

    Failure handling: a call that raises (anything but ``ValueError``, which signals bad input and
    leaves the environment untouched) or that exceeds ``call_timeout_s`` marks the environment as
    failed. It is discarded (closed in the background), a new one is built by the factory, reset to
    the slot's task and given the slot's actions again, and the call is retried, up to ``max_retries``
    times. If every attempt fails, the call's future raises ``EnvError`` (``EnvTimeoutError`` for a
    timeout); the slot's recorded trajectory is unchanged and its next call rebuilds and replays.

    ``verify_replay`` decides whether a replayed observation is the recorded one: by default
    (``"benchmark"``) the same termination flag and equal text in the benchmark's App. B.5 normal
    form (``envs.checks.observation_texts_equivalent``; ScienceWorld may enumerate objects in another
    order after a reset); or a callable ``(recorded, replayed) -> bool``; or None (no check). A replay
    that does not match is a failed attempt: the trajectory is never continued from another state.
    """

    def __init__(self, env_factory: Callable[[], TextEnv], num_slots: int, *, max_workers: int | None = None,
                 call_timeout_s: float | None = 60.0, build_timeout_s: float | None = 300.0, max_retries: int = 1,
                 verify_replay: Callable[[Observation, Observation], bool] | str | None = BENCHMARK_EQUIVALENCE):
        if not callable(env_factory):
            raise ValueError("env_factory must be a callable returning a TextEnv")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        for name, value in (("call_timeout_s", call_timeout_s), ("build_timeout_s", build_timeout_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if not (verify_replay is None or callable(verify_replay) or verify_replay == BENCHMARK_EQUIVALENCE):
            raise ValueError(f"verify_replay must be a callable, None or {BENCHMARK_EQUIVALENCE!r}, "
                             f"got {verify_replay!r}")
        self.env_factory = env_factory
        self.num_slots = num_slots
        self.max_workers = max_workers or num_slots
        self.call_timeout_s = call_timeout_s
        self.build_timeout_s = build_timeout_s
        self.max_retries = max_retries
        self.verify_replay = verify_replay
        self.envs_built = 0                      # factory calls that returned an environment
        self._count_lock = threading.Lock()
        self._slots = [_Slot(i) for i in range(num_slots)]
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.max_workers,
                                                               thread_name_prefix="envpool")
        self._closed = False

    # -- public API ---------------------------------------------------------------------------------
    def submit_reset(self, slot: int, task: Task) -> concurrent.futures.Future:
        """Reset ``slot``'s environment to ``task``; the future gives o_1. Clears the slot's trajectory."""
        if not isinstance(task, Task):
            raise ValueError(f"task must be an envs.base.Task, got {type(task).__name__}")
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
            return SlotTrajectory(slot=slot, task=state.task, actions=tuple(state.actions),
                                  observations=tuple(state.observations), recoveries=state.recoveries)

    def trajectories(self) -> list[SlotTrajectory]:
        return [self.trajectory(i) for i in range(self.num_slots)]

    @property
    def recoveries(self) -> int:
        """Environment rebuilds after failures, over all slots."""
        return sum(s.recoveries for s in self._slots)

    def close(self) -> None:
        """Fail queued calls, wait for running ones, close every environment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for state in self._slots:
            with state.queue_lock:
                pending, state.pending = list(state.pending), collections.deque()
            for operation in pending:
                if operation.future.set_running_or_notify_cancel():
                    operation.future.set_exception(EnvError("the environment pool was closed"))
        self._executor.shutdown(wait=True)
        for state in self._slots:
            with state.env_lock:
                env, state.env = state.env, None
            if env is not None:
                _call_with_timeout(lambda e=env: _close_quietly(e), self.call_timeout_s, "close")

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- scheduling ------------------------------------------------------------------------------
    def _slot(self, slot: int) -> _Slot:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots}), got {slot!r}")
        return self._slots[slot]

    def _submit(self, slot: int, run: Callable[[_Slot], Observation]) -> concurrent.futures.Future:
        state = self._slot(slot)
        if self._closed:
            raise EnvError("the environment pool is closed")
        operation = _Operation(run=run, future=concurrent.futures.Future())
        with state.queue_lock:
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
                state.scheduled = False

    # -- environment calls with recovery -------------------------------------------------------------
    def _build(self, state: _Slot) -> TextEnv:
        env = _call_with_timeout(self.env_factory, self.build_timeout_s, f"slot {state.index}: build",
                                 on_late_result=_close_in_background)
        if not isinstance(env, TextEnv):
            raise EnvError(f"env_factory returned {type(env).__name__}, not a TextEnv")
        with self._count_lock:
            self.envs_built += 1
        return env

    def _build_only(self, state: _Slot) -> None:
        if state.env is None:
            state.env = self._build(state)
            if state.task is not None:
                self._replay(state, state.env)

    def _replay(self, state: _Slot, env: TextEnv) -> None:
        """Bring a fresh ``env`` to the slot's recorded point: reset(task) then every recorded action."""
        where = f"slot {state.index} replay of {state.task.task_id}"
        replayed = [_call_with_timeout(lambda: env.reset(state.task), self.call_timeout_s, f"{where}: reset")]
        for turn, action in enumerate(state.actions, start=1):
            replayed.append(_call_with_timeout(lambda a=action: env.step(a), self.call_timeout_s,
                                               f"{where}: step {turn}"))
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
            except Exception as error:  # noqa: BLE001 - a failed rebuild is one more failed attempt
                last_error = error
                self._discard(state, f"rebuild before {description}", error)
                continue
            try:
                return _call_with_timeout(lambda: call(env), self.call_timeout_s,
                                          f"slot {state.index}: {description}")
            except ValueError:
                raise                       # bad input: the environment is fine and stays
            except Exception as error:  # noqa: BLE001 - any other failure means a broken environment
                last_error = error
                self._discard(state, description, error)
        error_type = EnvTimeoutError if isinstance(last_error, EnvTimeoutError) else EnvError
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
