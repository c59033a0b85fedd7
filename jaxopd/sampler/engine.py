"""The sampling engine: a thread that runs scheduler steps on the executor and resolves request futures.

Owns the paged-KV implementation of ``EngineProtocol`` (``submit`` → ``Future[Result]``, ``submit_async``,
``abort``, ``max_concurrency``, ``update_weights``, ``wait_idle``, ``events``) plus ``warmup``, request
validation at submission, stop conditions (length, stop tokens, stop strings on the decoded tail,
``min_new_tokens``), timings and the optional event log. One bad request never stops the engine: it is
rejected at ``submit`` or fails alone.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from jaxopd.models.qwen3 import Qwen3
from jaxopd.sampler.buckets import Buckets, bucket
from jaxopd.sampler.executor import DecodeBatch, Executor, PrefillBatch, compiled_count
from jaxopd.sampler.protocol import EngineBase
from jaxopd.sampler.sampling import SamplingArrays
from jaxopd.sampler.scheduler import POLICIES, Policy, PrefillChunk, Scheduler, Sequence, scheduling_policy
from jaxopd.sampler.types import EngineEvent, Request

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine limits. ``max_slots`` is the largest b_max the engine can serve (decode is compiled
    for row buckets up to it); ``max_concurrency`` can then be lowered at run time without recompiling.
    ``policy``: a name of ``scheduler.POLICIES`` (``fifo``, ``fast-first``, ``priority``) or a
    ``SchedulingPolicy``. ``attention_backend``: a name of ``kernels.available_backends()``."""

    max_slots: int = 64
    page_size: int = 16
    num_pages: int = 2048
    max_seq_len: int = 4096
    prefill_chunk: int = 512
    max_prefill_tokens: int = 4096
    max_prefill_rows: int = 16
    policy: Policy = "fifo"
    eos_token_ids: tuple[int, ...] = (151645, 151643)
    attention_backend: str = "reference"
    record_events: bool = False

    def validate(self) -> None:
        for name in ("max_slots", "page_size", "num_pages", "max_seq_len", "prefill_chunk",
                     "max_prefill_tokens", "max_prefill_rows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        try:
            scheduling_policy(self.policy)
        except ValueError:
            raise ValueError(f"EngineConfig.policy must be one of {tuple(POLICIES)} or a SchedulingPolicy, "
                             f"got {self.policy!r}") from None
        pages_per_seq = math.ceil(self.max_seq_len / self.page_size)
        if self.num_pages - 1 < pages_per_seq:
            raise ValueError(f"num_pages {self.num_pages} cannot hold one sequence of max_seq_len "
                             f"{self.max_seq_len} ({pages_per_seq} pages + the null page)")
        if self.max_prefill_tokens < min(self.prefill_chunk, 16):
            raise ValueError("max_prefill_tokens must be at least min(prefill_chunk, 16)")


class Engine(EngineBase):
    """Continuous-batching paged-KV sampler for a ``Qwen3`` model. Use as a context manager or start()/stop()."""

    def __init__(self, model: Qwen3, config: EngineConfig = EngineConfig(), tokenizer: Any = None):
        config.validate()
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.buckets = Buckets.make(max_slots=config.max_slots, max_seq_len=config.max_seq_len,
                                    page_size=config.page_size, prefill_chunk=config.prefill_chunk,
                                    max_prefill_tokens=config.max_prefill_tokens,
                                    max_prefill_rows=config.max_prefill_rows)
        self.executor = Executor(model, num_pages=config.num_pages, page_size=config.page_size,
                                 buckets=self.buckets, attention_backend=config.attention_backend)
        self.scheduler = Scheduler(max_slots=config.max_slots, page_size=config.page_size,
                                   num_pages=config.num_pages, policy=config.policy,
                                   prefill_chunk=config.prefill_chunk,
                                   max_prefill_tokens=config.max_prefill_tokens,
                                   max_prefill_rows=self.buckets.prefill_rows[-1])
        self.events: list[EngineEvent] = []
        self.stats = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "preemptions": 0,
                      "generated_tokens": 0}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._arrival = itertools.count()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._pending_state = None
        self._pending_concurrency: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Engine":
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="jaxopd-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop; requests still in flight are failed with ``RuntimeError``."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting) + self._drain_inbox():
            self.scheduler.finish(seq)
            if not seq.future.done():
                seq.future.set_exception(RuntimeError("engine stopped"))
            self._done_one()

    def warmup(self) -> int:
        """Compile every prefill/decode bucket (call before timing; nothing compiles afterwards)."""
        if self._thread is not None and self._thread.is_alive() and self._in_flight:
            raise RuntimeError("warmup() must run while the engine is idle")
        return self.executor.warmup(self.config.max_prefill_tokens)

    @property
    def max_slots(self) -> int:
        return self.config.max_slots

    @property
    def record_events(self) -> bool:
        return self.config.record_events

    @property
    def max_concurrency(self) -> int:
        return self.scheduler.max_concurrency

    @max_concurrency.setter
    def max_concurrency(self, value: int) -> None:
        value = self._check_concurrency(value)
        if self._thread is not None and self._thread.is_alive():
            self._pending_concurrency = value
            self._wake.set()
        else:
            self.scheduler.max_concurrency = value

    def update_weights(self, state: Any) -> None:
        """Swap in new parameters (an ``nnx.State`` of the same model); applied between two steps."""
        if self._thread is not None and self._thread.is_alive():
            self._pending_state = state
            self._wake.set()
        else:
            self.executor.set_state(state)

    # ------------------------------------------------------------------ submission
    def submit(self, request: Request) -> Future:
        """Queue a request; returns a ``Future[Result]``. Invalid requests raise ``ValueError`` here."""
        request.validate(max_seq_len=self.config.max_seq_len, vocab_size=self.vocab_size)
        if request.params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need an engine created with a tokenizer")
        future: Future = Future()
        seq = Sequence(request=request, future=future, arrival=next(self._arrival),
                       submitted_at=time.perf_counter(), prompt=[int(t) for t in request.prompt_ids])
        with self._idle:
            self._in_flight += 1
        self._record("submit", request, seq.submitted_at)
        self._inbox.put(("submit", seq))
        self._wake.set()
        return future

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages; its future gets a result with ``finish_reason='abort'``."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def compiled_count(self) -> int:
        """Compiled prefill/decode variants so far (all engines of this process share the caches)."""
        return compiled_count()

    # ------------------------------------------------------------------ the loop
    def _drain_inbox(self) -> list[Sequence]:
        out = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return out
            if kind == "submit":
                out.append(item)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._apply_pending()
            self._take_inbox()
            if not self.scheduler.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self._step()
            except Exception as exc:  # a device failure fails the requests in flight, not the engine
                log.exception("engine step failed")
                for seq in list(self.scheduler.running):
                    self._fail(seq, exc)

    def _apply_pending(self) -> None:
        if self._pending_state is not None:
            self.executor.set_state(self._pending_state)
            self._pending_state = None
        if self._pending_concurrency is not None:
            self.scheduler.max_concurrency = self._pending_concurrency
            self._pending_concurrency = None

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self.scheduler.add(item)
            else:
                for seq in self.scheduler.running + self.scheduler.waiting:
                    if seq.request.request_id == item:
                        self._finish(seq, "abort")
                        break

    def _step(self) -> None:
        now = time.perf_counter()
        for seq in self.scheduler.admit(now):
            self._record("admit", seq.request, now)
        chunks = self.scheduler.prefill_chunks()
        if chunks:
            self._run_prefill(chunks)
        decode = self.scheduler.decode_sequences()
        for seq in self.scheduler.preempted:
            self.stats["preemptions"] += 1
            self._record("preempt", seq.request, time.perf_counter())
        if decode:
            self._run_decode(decode)
        self.stats["steps"] += 1

    def _sampling(self, seqs: list[Sequence], rows: int) -> SamplingArrays:
        s = SamplingArrays.empty(rows)
        for i, seq in enumerate(seqs):
            p = seq.request.params
            s.temperature[i], s.top_p[i], s.top_k[i] = p.temperature, p.top_p, p.top_k
            s.seeds[i] = p.seed & 0xFFFFFFFF
        return s

    def _page_rows(self, seqs: list[Sequence], rows: int, width: int) -> np.ndarray:
        table = np.zeros((rows, width), np.int32)
        for i, seq in enumerate(seqs):
            n = min(len(seq.pages), width)
            table[i, :n] = seq.pages[:n]
        return table

    def _run_prefill(self, chunks: list[PrefillChunk]) -> None:
        rows = bucket(len(chunks), self.buckets.prefill_rows)
        length = bucket(max(c.length for c in chunks), self.buckets.prefill_lengths)
        tokens = np.zeros((rows, length), np.int32)
        starts = np.zeros(rows, np.int32)
        lengths = np.zeros(rows, np.int32)
        for i, c in enumerate(chunks):
            tokens[i, :c.length] = c.seq.tokens[c.start:c.start + c.length]
            starts[i], lengths[i] = c.start, c.length
        seqs = [c.seq for c in chunks]
        batch = PrefillBatch(tokens, starts, lengths,
                             self._page_rows(seqs, rows, self.buckets.max_pages_per_seq),
                             self._sampling(seqs, rows))
        next_tokens, logprobs = self.executor.prefill(batch)
        self.stats["prefill_steps"] += 1
        now = time.perf_counter()
        for i, c in enumerate(chunks):
            c.seq.num_cached += c.length
            if c.completes_prompt:
                c.seq.state = "decode"
                self._append(c.seq, int(next_tokens[i]), float(logprobs[i]), now)

    def _run_decode(self, seqs: list[Sequence]) -> None:
        rows = bucket(len(seqs), self.buckets.decode_rows)
        width = bucket(max(len(s.pages) for s in seqs), self.buckets.decode_pages)
        tokens = np.zeros(rows, np.int32)
        positions = np.zeros(rows, np.int32)
        active = np.zeros(rows, bool)
        for i, seq in enumerate(seqs):
            tokens[i] = seq.generated[-1]
            positions[i] = seq.num_cached
            active[i] = True
        batch = DecodeBatch(tokens, positions, self._page_rows(seqs, rows, width), active,
                            self._sampling(seqs, rows))
        next_tokens, logprobs = self.executor.decode(batch)
        self.stats["decode_steps"] += 1
        now = time.perf_counter()
        for i, seq in enumerate(seqs):
            seq.num_cached += 1
            self._append(seq, int(next_tokens[i]), float(logprobs[i]), now)

    # ------------------------------------------------------------------ tokens and finishing
    def _append(self, seq: Sequence, token: int, logprob: float, now: float) -> None:
        seq.generated.append(token)
        seq.logprobs.append(logprob)
        self.stats["generated_tokens"] += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
            self._record("first_token", seq.request, now)
        params = seq.request.params
        n = len(seq.generated)
        if n >= params.min_new_tokens:
            if token in params.stop_token_ids or token in self.config.eos_token_ids:
                return self._finish(seq, "stop")
            if params.stop_strings and self._stop_string_hit(seq):
                return self._finish(seq, "stop")
        if n >= params.max_new_tokens:
            self._finish(seq, "length")

    def _stop_string_hit(self, seq: Sequence) -> bool:
        stops = seq.request.params.stop_strings
        window = 2 * max(map(len, stops)) + 8
        tail = self.tokenizer.decode(seq.generated[-window:])
        return any(s in tail for s in stops)

    def _text(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(seq.generated)
        cut = [text.index(s) + len(s) for s in seq.request.params.stop_strings if s in text]
        return text[:min(cut)] if cut else text

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq)
        now = time.perf_counter()
        result = seq.result(reason, now, self._text(seq))
        self._record("abort" if reason == "abort" else "finish", seq.request, now)
        if not seq.future.done():
            seq.future.set_result(result)
        self._done_one()

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        self.scheduler.finish(seq)
        if not seq.future.done():
            seq.future.set_exception(exc)
        self._done_one()

    def _done_one(self) -> None:
        with self._idle:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()


__all__ = ["Engine", "EngineConfig", "EngineEvent"]
