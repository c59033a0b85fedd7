"""A discrete-event stand-in for ``jaxopd.sampler.Engine`` on a virtual clock, for scheduling tests.

Owns ``FakeEngine``: the engine's public surface (``submit`` → ``Future[Result]``, ``submit_async``,
``max_concurrency``, ``events``, ``wait_idle``, ``warmup``, ``start``/``stop``) over a simulated server whose
requests hold one of at most ``max_concurrency`` slots for a deterministic service time. Nothing runs on a
device and no thread is started: the simulation advances, in virtual seconds, inside ``wait_idle()``;
future callbacks run there too and may submit more requests (as they may on the real engine's thread).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import threading
from concurrent.futures import Future
from typing import Callable, Mapping

import numpy as np

from jaxopd.sampler import EngineEvent, Request, Result, Timings

LatencyModel = Mapping[str, float] | Callable[[Request], float]
POLICIES = ("fifo", "fast-first")


@dataclasses.dataclass(eq=False)
class _SimulatedRequest:
    request: Request
    future: Future
    arrival: int
    submitted_at: float
    work: float                     # seconds of service at rate 1 (one request alone)
    remaining: float = 0.0
    admitted_at: float | None = None


class FakeEngine:
    """A simulated continuous-batching server with a concurrency cap and a virtual clock.

    ``latencies``: service time of a request, either per kind (``{"fast": 1.0, "full": 8.0}``) or a
    function of the request. ``slowdown(n)`` (>= 1, default 1) stretches every running request's service
    while n requests run together, modelling a server whose step time grows with its batch; with the
    default each request holds its slot for exactly its service time, the model of App. A.2.
    ``policy``: ``fifo`` (arrival order) or ``fast-first`` (fast actions ahead of waiting full responses).
    Single-threaded: drive it from one thread; callbacks run inside ``wait_idle``.
    """

    def __init__(self, latencies: LatencyModel, *, max_slots: int = 256, policy: str = "fifo",
                 slowdown: Callable[[int], float] | None = None, max_seq_len: int = 4096,
                 vocab_size: int = 151_936, record_events: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if isinstance(latencies, Mapping):
            for kind, value in latencies.items():
                if not math.isfinite(value) or value <= 0:
                    raise ValueError(f"latency of {kind!r} requests must be a finite positive number, got {value!r}")
        self._latencies = latencies
        self._slowdown = slowdown
        self.policy = policy
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.record_events = record_events
        self.events: list[EngineEvent] = []
        self.now = 0.0
        self._cap = max_slots
        self._arrival = itertools.count()
        self._waiting: list[_SimulatedRequest] = []
        self._running: list[_SimulatedRequest] = []
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ the Engine surface
    def start(self) -> "FakeEngine":
        return self

    def stop(self) -> None:
        with self._lock:
            for sim in self._waiting + self._running:
                if not sim.future.done():
                    sim.future.set_exception(RuntimeError("engine stopped"))
            self._waiting.clear()
            self._running.clear()

    def __enter__(self) -> "FakeEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def warmup(self) -> int:
        return 0

    def clock(self) -> float:
        """The virtual time in seconds (what every ``Timings`` field of this engine is measured in)."""
        return self.now

    @property
    def max_concurrency(self) -> int:
        return self._cap

    @max_concurrency.setter
    def max_concurrency(self, value: int) -> None:
        if not 1 <= value <= self.max_slots:
            raise ValueError(f"max_concurrency must be in [1, max_slots={self.max_slots}], got {value}")
        self._cap = int(value)

    def submit(self, request: Request) -> Future:
        request.validate(max_seq_len=self.max_seq_len, vocab_size=self.vocab_size)
        work = self._service_time(request)
        future: Future = Future()
        with self._lock:
            sim = _SimulatedRequest(request, future, next(self._arrival), self.now, work, remaining=work)
            self._waiting.append(sim)
            self._record("submit", sim)
        return future

    async def submit_async(self, request: Request) -> Result:
        """Awaitable form; the result arrives once some thread drives the simulation with ``wait_idle``."""
        return await asyncio.wrap_future(self.submit(request))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Run the simulation until nothing is queued or running (``timeout`` is ignored: virtual time)."""
        del timeout
        with self._lock:
            while True:
                self._admit()
                if not self._running:
                    return not self._waiting
                self._advance_to_next_finish()

    # ------------------------------------------------------------------ simulation
    def _service_time(self, request: Request) -> float:
        if callable(self._latencies):
            value = float(self._latencies(request))
        else:
            if request.kind not in self._latencies:
                raise ValueError(f"no latency configured for {request.kind!r} requests")
            value = float(self._latencies[request.kind])
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"service time of {request.request_id} must be finite and positive, got {value!r}")
        return value

    def _order_key(self, sim: _SimulatedRequest):
        if self.policy == "fast-first":
            return (sim.request.kind != "fast", sim.arrival)
        return (sim.arrival,)

    def _admit(self) -> None:
        self._waiting.sort(key=self._order_key)
        while self._waiting and len(self._running) < self._cap:
            sim = self._waiting.pop(0)
            sim.admitted_at = self.now
            self._running.append(sim)
            self._record("admit", sim)

    def _rate(self) -> float:
        if self._slowdown is None:
            return 1.0
        factor = float(self._slowdown(len(self._running)))
        if not math.isfinite(factor) or factor < 1.0:
            raise ValueError(f"slowdown({len(self._running)}) must be a finite number >= 1, got {factor!r}")
        return 1.0 / factor

    def _advance_to_next_finish(self) -> None:
        rate = self._rate()
        step = min(sim.remaining for sim in self._running) / rate
        self.now += step
        finished = []
        for sim in self._running:
            sim.remaining -= step * rate
            if sim.remaining <= 1e-12 * max(1.0, sim.work):
                finished.append(sim)
        for sim in finished:                 # admission order; each callback may submit more work
            self._running.remove(sim)
            self._record("finish", sim)
            n = sim.request.params.max_new_tokens
            result = Result(request_id=sim.request.request_id, kind=sim.request.kind,
                            prompt_ids=tuple(int(t) for t in sim.request.prompt_ids), token_ids=[0] * n,
                            text="", logprobs=np.zeros(n, np.float32), finish_reason="length",
                            timings=Timings(sim.submitted_at, sim.admitted_at, sim.admitted_at, self.now))
            sim.future.set_result(result)

    def _record(self, event: str, sim: _SimulatedRequest) -> None:
        if self.record_events:
            self.events.append(EngineEvent(self.now, event, sim.request.request_id, sim.request.kind))
