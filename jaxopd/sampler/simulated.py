"""A discrete-event engine on a virtual clock: the engine surface without a model, for scheduling studies.

Owns ``SimulatedEngine``, an ``EngineProtocol`` whose requests hold one of at most ``max_concurrency`` slots
for a deterministic service time. Admission, slots and the scheduling policy are the real engine's
``Scheduler`` (so a policy behaves here exactly as it does there); requests, results, timings and events are
the real types. Nothing runs on a device, no thread is started and KV memory is not modelled (each request
holds one page of a pool sized so pages never bind): the simulation advances, in virtual seconds, inside
``wait_idle()``; future callbacks run there too and may submit more requests (as they may on the real
engine's thread). Same contract as the real engine: validation at ``submit``, ``RuntimeError`` after
``stop()``, a cancelled future aborts its request, ``update_weights(state, version)`` sets the policy version
that ``Result.policy_versions`` records (at admission and at finish). No request can fail on the host here
(nothing is decoded), so ``finish_reason`` is ``length`` or ``abort``.
"""
from __future__ import annotations

import itertools
import math
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Mapping

from jaxopd.sampler.protocol import EngineBase
from jaxopd.sampler.scheduler import Policy, Scheduler, Sequence
from jaxopd.sampler.types import EngineEvent, FinishReason, Request, Result

LatencyModel = Mapping[str, float] | Callable[[Request], float]


class SimulatedEngine(EngineBase):
    """A simulated continuous-batching server with a concurrency cap and a virtual clock.

    ``latencies``: service time of a request, either per kind (``{"fast": 1.0, "full": 8.0}``) or a
    function of the request. ``slowdown(n)`` (>= 1, default 1) stretches every running request's service
    while n requests run together, modelling a server whose step time grows with its batch; with the
    default each request holds its slot for exactly its service time, the model of App. A.2.
    ``policy``: as the real engine's (``fifo``, ``fast-first``, ``priority`` or a ``SchedulingPolicy``).
    A finished request has ``max_new_tokens`` zero tokens. Single-threaded: drive it from one thread;
    callbacks run inside ``wait_idle``.
    """

    def __init__(self, latencies: LatencyModel, *, max_slots: int = 256, policy: Policy = "fifo",
                 slowdown: Callable[[int], float] | None = None, max_seq_len: int = 4096,
                 vocab_size: int = 151_936, record_events: bool = True):
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if isinstance(latencies, Mapping):
            for kind, value in latencies.items():
                if not math.isfinite(value) or value <= 0:
                    raise ValueError(f"latency of {kind!r} requests must be a finite positive number, got {value!r}")
        self._latencies = latencies
        self._slowdown = slowdown
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.record_events = record_events
        self.events: list[EngineEvent] = []
        self.now = 0.0
        self.state: Any = None            # the last weights passed to update_weights (unused by the simulation)
        self.policy_version = 0           # the version of the last update_weights
        self._stopped = False
        # one page of max_seq_len tokens holds any request, and there is one per slot: pages never bind
        self.scheduler = Scheduler(max_slots=max_slots, page_size=max_seq_len, num_pages=max_slots + 1,
                                   policy=policy, prefill_chunk=max_seq_len, max_prefill_tokens=max_seq_len,
                                   max_prefill_rows=max_slots)
        self.policy = self.scheduler.policy
        self._arrival = itertools.count()
        self._work: dict[Sequence, float] = {}        # seconds of service at rate 1 (one request alone)
        self._remaining: dict[Sequence, float] = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ the engine surface
    def start(self) -> "SimulatedEngine":
        self._stopped = False
        return self

    def stop(self) -> None:
        """Fail every request still queued or running with ``RuntimeError``; later submits raise until ``start()``."""
        with self._lock:
            self._stopped = True
            for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._release(seq)
                if not seq.future.done():
                    seq.future.set_exception(RuntimeError("engine stopped"))

    def warmup(self) -> int:
        return 0

    def clock(self) -> float:
        """The virtual time in seconds (what every ``Timings`` field of this engine is measured in)."""
        return self.now

    @property
    def max_concurrency(self) -> int:
        return self.scheduler.max_concurrency

    @max_concurrency.setter
    def max_concurrency(self, value: int) -> None:
        self.scheduler.max_concurrency = self._check_concurrency(value)

    def update_weights(self, state: Any, version: int | None = None) -> None:
        """Keep ``state`` (the simulation's service times do not depend on weights) and set the policy version
        (``None``: + 1; it never decreases)."""
        with self._lock:
            self.policy_version = self._next_version(self.policy_version, version)
            self.state = state

    def submit(self, request: Request) -> Future:
        served = request.prepared(max_seq_len=self.max_seq_len, vocab_size=self.vocab_size)
        work = self._service_time(served)
        future: Future = Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("engine is stopped: call start() before submitting more requests")
            seq = Sequence(request=served, future=future, arrival=next(self._arrival), submitted_at=self.now,
                           prompt=list(served.prompt_ids))
            self._work[seq] = self._remaining[seq] = work
            self.scheduler.add(seq)
            self._record("submit", served, self.now)
        future.add_done_callback(self._abort_if_cancelled(served.request_id))
        return future

    def generate(self, requests: list[Request]) -> list[Result]:
        """Submit all, simulate until idle, return the results."""
        futures = [self.submit(r) for r in requests]
        self.wait_idle()
        return [f.result() for f in futures]

    def abort(self, request_id: str) -> None:
        """Finish a queued or running request now with ``finish_reason='abort'`` and no tokens."""
        with self._lock:
            for seq in self.scheduler.running + self.scheduler.waiting:
                if seq.request.request_id == request_id:
                    self._finish(seq, "abort")
                    return

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Run the simulation until nothing is queued or running (``timeout`` is ignored: virtual time)."""
        del timeout
        with self._lock:
            while True:
                for seq in self.scheduler.admit(self.now):
                    seq.first_version = self.policy_version
                    self._record("admit", seq.request, self.now)
                if not self.scheduler.running:
                    return not self.scheduler.waiting
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

    def _rate(self) -> float:
        if self._slowdown is None:
            return 1.0
        running = len(self.scheduler.running)
        factor = float(self._slowdown(running))
        if not math.isfinite(factor) or factor < 1.0:
            raise ValueError(f"slowdown({running}) must be a finite number >= 1, got {factor!r}")
        return 1.0 / factor

    def _advance_to_next_finish(self) -> None:
        running = self.scheduler.running
        rate = self._rate()
        step = min(self._remaining[seq] for seq in running) / rate
        self.now += step
        finished = []
        for seq in running:
            self._remaining[seq] -= step * rate
            if self._remaining[seq] <= 1e-12 * max(1.0, self._work[seq]):
                finished.append(seq)
        for seq in finished:                 # admission order; each callback may submit more work
            seq.generated = [0] * seq.request.params.max_new_tokens
            seq.logprobs = [0.0] * len(seq.generated)
            seq.first_token_at = seq.admitted_at
            seq.last_version = self.policy_version
            self._finish(seq, "length")

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._work.pop(seq, None)
        self._remaining.pop(seq, None)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._release(seq)
        self._record("abort" if reason == "abort" else "finish", seq.request, self.now)
        try:
            seq.future.set_result(seq.result(reason, self.now))
        except InvalidStateError:          # cancelled meanwhile
            pass


__all__ = ["SimulatedEngine", "LatencyModel"]
