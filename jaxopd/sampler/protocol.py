"""The one engine surface that rollouts and experiments program against.

Owns ``EngineProtocol`` (``submit`` → ``Future[Result]``, ``submit_async``, ``abort``, ``max_concurrency``,
``update_weights``, ``wait_idle``, ``events``), which the paged-KV ``Engine`` and the virtual-clock
``SimulatedEngine`` both satisfy, and ``EngineBase``, the part of that surface they share (the awaitable and
batch forms of ``submit``, the context manager, the concurrency-cap and weight-version checks, the
cancel-aborts hook and the event log). Plain Python.
"""
from __future__ import annotations

import abc

import asyncio
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from jaxopd.sampler.types import EngineEvent, Request, Result, is_int


@runtime_checkable
class EngineProtocol(Protocol):
    """What every engine offers.

    ``submit`` validates the request (``ValueError`` naming the bad field; ``RuntimeError`` once the engine
    is stopped) and returns a future resolved with its ``Result``; ``Result.finish_reason`` is ``stop``,
    ``length``, ``abort`` or ``error`` (a failure of that request alone, message in ``Result.error``).
    ``abort`` resolves a request early (``finish_reason='abort'``); cancelling its future (``future.cancel()``,
    or an ``asyncio`` timeout around ``submit_async``) aborts it too. ``max_concurrency`` is the cap b_max
    on admitted requests (settable at run time; reading it returns the last value set).
    ``update_weights(state, version=None)`` swaps in new parameters between two steps and sets the policy
    version (``None``: the current one + 1; versions never decrease); every request records the versions
    it ran under in ``Result.policy_versions``. ``wait_idle`` blocks until nothing is queued or running;
    ``events`` is the event log (empty unless the engine records events)."""

    events: list[EngineEvent]

    def submit(self, request: Request) -> Future:
        ...

    async def submit_async(self, request: Request) -> Result:
        ...

    def abort(self, request_id: str) -> None:
        ...

    @property
    def max_concurrency(self) -> int:
        ...

    @max_concurrency.setter
    def max_concurrency(self, value: int) -> None:
        ...

    def update_weights(self, state: Any, version: int | None = None) -> None:
        ...

    def wait_idle(self, timeout: float | None = None) -> bool:
        ...


class EngineBase(abc.ABC):
    """Shared implementation of the engine surface; subclasses provide ``submit``, ``start``, ``stop``,
    ``max_slots``, ``record_events`` and ``events``."""

    events: list[EngineEvent]
    record_events: bool
    max_slots: int

    @abc.abstractmethod
    def submit(self, request: Request) -> Future:
        """Queue a request; a ``Future[Result]``."""

    @abc.abstractmethod
    def start(self) -> "EngineBase":
        """Start serving; returns the engine."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop serving; requests still in flight end."""

    async def submit_async(self, request: Request) -> Result:
        """Awaitable form of ``submit``."""
        return await asyncio.wrap_future(self.submit(request))

    def generate(self, requests: list[Request]) -> list[Result]:
        """Submit all and wait for all (a convenience for scripts and tests)."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _check_concurrency(self, value: int) -> int:
        if not is_int(value) or not 1 <= value <= self.max_slots:
            raise ValueError(f"max_concurrency must be in [1, max_slots={self.max_slots}] (an integer), got {value!r}")
        return int(value)

    @staticmethod
    def _next_version(current: int, version: int | None) -> int:
        """The policy version an ``update_weights(state, version)`` sets, given the ``current`` one."""
        if version is None:
            return current + 1
        if not is_int(version) or version < 0:
            raise ValueError(f"version must be None (the current version + 1) or an integer >= 0, got {version!r}")
        if version < current:
            raise ValueError(f"version {version} would go back from the current policy version {current}: "
                             "versions never decrease")
        return int(version)

    def _abort_if_cancelled(self, request_id: str):
        """A done-callback for a request's future: a cancelled future aborts its request.

        It also marks the cancellation as notified (``set_running_or_notify_cancel``, the executor's half of
        the ``Future`` protocol): ``concurrent.futures.wait`` and ``as_completed`` count a future as done only
        once that is called, so without it they never returned for a cancelled request."""
        def callback(future: Future) -> None:
            if future.cancelled():
                future.set_running_or_notify_cancel()
                self.abort(request_id)
        return callback

    def _record(self, event: str, request: Request, when: float) -> None:
        if self.record_events:
            self.events.append(EngineEvent(when, event, request.request_id, request.kind))


__all__ = ["EngineProtocol", "EngineBase"]
