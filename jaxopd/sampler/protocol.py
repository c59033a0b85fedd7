"""The one engine surface that rollouts and experiments program against.

Owns ``EngineProtocol`` (``submit`` → ``Future[Result]``, ``submit_async``, ``abort``, ``max_concurrency``,
``update_weights``, ``wait_idle``, ``events``), which the paged-KV ``Engine`` and the virtual-clock
``SimulatedEngine`` both satisfy, and ``EngineBase``, the part of that surface they share (the awaitable and
batch forms of ``submit``, the context manager, the concurrency-cap check and the event log). Plain Python.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from jaxopd.sampler.types import EngineEvent, Request, Result


@runtime_checkable
class EngineProtocol(Protocol):
    """What every engine offers. ``submit`` validates the request (``ValueError`` for a bad one) and returns a
    future resolved with its ``Result``; ``abort`` resolves it early (``finish_reason='abort'``);
    ``max_concurrency`` is the cap b_max on admitted requests (settable at run time); ``update_weights``
    swaps in new parameters between two steps; ``wait_idle`` blocks until nothing is queued or running;
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

    def update_weights(self, state: Any) -> None:
        ...

    def wait_idle(self, timeout: float | None = None) -> bool:
        ...


class EngineBase:
    """Shared implementation of the engine surface; subclasses provide ``submit``, ``start``, ``stop``,
    ``max_slots``, ``record_events`` and ``events``."""

    events: list[EngineEvent]
    record_events: bool
    max_slots: int

    def submit(self, request: Request) -> Future:
        raise NotImplementedError

    def start(self) -> "EngineBase":
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

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
        if not 1 <= value <= self.max_slots:
            raise ValueError(f"max_concurrency must be in [1, max_slots={self.max_slots}], got {value}")
        return int(value)

    def _record(self, event: str, request: Request, when: float) -> None:
        if self.record_events:
            self.events.append(EngineEvent(when, event, request.request_id, request.kind))


__all__ = ["EngineProtocol", "EngineBase"]
