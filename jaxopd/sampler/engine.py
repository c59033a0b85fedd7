"""The sampling engine: a thread that runs scheduler steps on the executor and resolves request futures.

Owns the paged-KV implementation of ``EngineProtocol`` (``submit`` → ``Future[Result]``, ``submit_async``,
``abort``, ``max_concurrency``, ``update_weights``, ``wait_idle``, ``events``) plus ``warmup``, the engine's
lifecycle, request validation at submission, stop conditions (length, stop tokens, stop strings on the
incrementally decoded text, ``min_new_tokens``), policy versions, timings and the optional event log.
Every change of engine state (requests, aborts, weights, the concurrency cap, warm-up) travels through one
FIFO inbox that only the engine thread applies, between two steps. One bad request never stops the engine:
it is rejected at ``submit`` or fails alone (``finish_reason='error'``).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any

import numpy as np

from jaxopd.models.qwen3 import Qwen3
from jaxopd.sampler.buckets import Buckets
from jaxopd.sampler.detokenize import IncrementalText, completes_stop_string
from jaxopd.sampler.executor import DecodeBatch, Executor, PrefillBatch, compiled_count
from jaxopd.sampler.protocol import EngineBase
from jaxopd.sampler.sampling import SamplingArrays
from jaxopd.sampler.scheduler import POLICIES, Policy, PrefillChunk, Scheduler, Sequence, scheduling_policy
from jaxopd.sampler.types import EngineEvent, FinishReason, Request

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine limits. ``max_slots`` is the largest b_max the engine can serve (decode is compiled
    for row buckets up to it); ``max_concurrency`` can then be lowered at run time without recompiling.
    ``max_prefill_tokens`` bounds a prefill step's padded batch (rows bucket × length bucket; one chunk of up
    to ``prefill_chunk`` tokens always runs): see ``Buckets.prefill_fits``.
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
    """Continuous-batching paged-KV sampler for a ``Qwen3`` model. Use as a context manager or start()/stop().

    Threads: any thread may call ``submit``, ``abort``, ``update_weights``, ``max_concurrency``, ``warmup``
    and ``wait_idle``; they only queue a command (validated first, so errors are raised to the caller) on
    the inbox, which the engine thread applies in order between two steps. Before ``start()`` (or after
    ``stop()``) the calling thread applies weights and the cap itself; requests wait for ``start()``.

    Lifecycle: ``submit`` after ``stop()`` raises ``RuntimeError`` (``start()`` again to serve); requests in
    flight at ``stop()`` fail with ``RuntimeError("engine stopped")``. A cancelled future aborts its request.

    Weight versions: ``policy_version`` starts at ``policy_version`` (default 0); ``update_weights(state,
    version=None)`` sets it (``None``: + 1; it never decreases). The update takes effect between two steps,
    before any request submitted after the call runs; ``Result.policy_versions`` records, per request, the
    version of its first and of its last step, so a request that straddled an update is visible
    (``first != last``) and one with ``first == last`` ran on one version only.
    """

    def __init__(self, model: Qwen3, config: EngineConfig = EngineConfig(), tokenizer: Any = None, *,
                 policy_version: int = 0):
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
                                   max_prefill_rows=self.buckets.prefill_rows[-1],
                                   prefill_fits=self.buckets.prefill_fits)
        self.events: list[EngineEvent] = []
        self.stats = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "preemptions": 0,
                      "generated_tokens": 0, "errors": 0}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._arrival = itertools.count()
        self._idle = threading.Condition()
        self._in_flight = 0                      # queued commands + requests not yet resolved
        self._control = threading.Lock()         # lifecycle state, requested cap and version, inbox order
        self._device = threading.RLock()         # held by whoever applies the inbox or runs the executor
        self._state = "new"                      # new | running | stopped
        self._policy_version = self._next_version(0, policy_version)
        self._served_version = self._policy_version
        self._max_concurrency = self.scheduler.max_concurrency

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Engine":
        with self._control:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stop.clear()
            self._state = "running"
            self._thread = threading.Thread(target=self._loop, name="jaxopd-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop; requests still queued or in flight fail with ``RuntimeError("engine stopped")``, and
        later ``submit`` calls raise ``RuntimeError`` until ``start()``."""
        with self._control:
            self._state = "stopped"
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._thread = None
        with self._device:
            self._apply_inbox(stopping=True)
            for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._fail(seq, RuntimeError("engine stopped"))

    def warmup(self) -> int:
        """Compile every prefill/decode bucket (call before timing; nothing compiles afterwards); returns the
        number of shapes. Safe at any time: it runs on the engine thread between two steps (on the calling
        thread when the engine is not running), never concurrently with a step."""
        if threading.current_thread() is self._thread:
            return self.executor.warmup()
        done: Future = Future()
        self._post("warmup", done)
        return done.result()

    @property
    def max_slots(self) -> int:
        return self.config.max_slots

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def record_events(self) -> bool:
        return self.config.record_events

    @property
    def max_concurrency(self) -> int:
        """The cap b_max; reads return the last value set (it applies before the next admission)."""
        return self._max_concurrency

    @max_concurrency.setter
    def max_concurrency(self, value: int) -> None:
        value = self._check_concurrency(value)
        with self._control:
            self._max_concurrency = value
            self._post_locked("concurrency", value)
        self._kick()

    @property
    def policy_version(self) -> int:
        """The version of the last ``update_weights`` (what every request submitted from now on runs on)."""
        return self._policy_version

    def update_weights(self, state: Any, version: int | None = None) -> None:
        """Swap in new parameters (an ``nnx.State`` of the served model) between two steps and set the policy
        version (``None``: the current one + 1). ``ValueError`` names the first path whose presence, shape
        or dtype differs from the served model's, or a decreasing ``version``; the engine is not touched then.
        Updates apply in call order, so the last one wins."""
        state = self.executor.check_state(state)
        with self._control:
            new_version = self._next_version(self._policy_version, version)
            self._policy_version = new_version
            self._post_locked("weights", (state, new_version))
        self._kick()

    # ------------------------------------------------------------------ submission
    def submit(self, request: Request) -> Future:
        """Queue a request; returns a ``Future[Result]``. Invalid requests raise ``ValueError`` here, and a
        stopped engine ``RuntimeError``. Cancelling the future aborts the request."""
        served = request.prepared(max_seq_len=self.config.max_seq_len, vocab_size=self.vocab_size)
        if served.params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need an engine created with a tokenizer")
        future: Future = Future()
        seq = Sequence(request=served, future=future, arrival=next(self._arrival),
                       submitted_at=time.perf_counter(), prompt=list(served.prompt_ids))
        if served.params.stop_strings:
            seq.detokenizer = IncrementalText()
        with self._control:
            if self._state == "stopped":
                raise RuntimeError("engine is stopped: call start() before submitting more requests")
            self._record("submit", served, seq.submitted_at)
            self._post_locked("submit", seq)
        self._kick()
        future.add_done_callback(self._abort_if_cancelled(served.request_id))
        return future

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages; its future gets a result with ``finish_reason='abort'``
        (unknown or finished ids are ignored)."""
        self._post("abort", request_id)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is queued or running and every queued command (weights, cap, abort) is
        applied; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def compiled_count(self) -> int:
        """Compiled prefill/decode variants so far (all engines of this process share the caches)."""
        return compiled_count()

    # ------------------------------------------------------------------ the inbox
    def _post(self, kind: str, item: Any) -> None:
        with self._control:
            self._post_locked(kind, item)
        self._kick()

    def _post_locked(self, kind: str, item: Any) -> None:
        with self._idle:
            self._in_flight += 1
        self._inbox.put((kind, item))

    def _kick(self) -> None:
        """Have the inbox applied: wake the engine thread, or apply it here when no engine thread runs."""
        if self._state == "running" or threading.current_thread() is self._thread:
            self._wake.set()
        else:
            with self._device:
                self._apply_inbox(stopping=self._state == "stopped")

    def _apply_inbox(self, stopping: bool = False) -> None:
        """Apply queued commands in order (caller holds ``_device``). Each is isolated: an error fails only
        the request it concerns. ``stopping``: fail queued requests instead of serving them."""
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._apply(kind, item, stopping)
            except Exception as exc:  # noqa: BLE001 - an inbox command never kills the engine
                log.exception("engine command %s failed", kind)
                if kind == "submit":
                    self._error(item, exc)
                elif kind == "warmup" and not item.done():
                    item.set_exception(exc)
            finally:
                if kind != "submit":               # a request stays in flight until it resolves (once)
                    self._done_one()

    def _apply(self, kind: str, item: Any, stopping: bool) -> None:
        if kind == "submit":
            if stopping:
                self._fail(item, RuntimeError("engine stopped"))
            else:
                self.scheduler.add(item)
        elif kind == "abort":
            for seq in self.scheduler.running + self.scheduler.waiting:
                if seq.request.request_id == item:
                    self._finish(seq, "abort")
                    break
        elif kind == "weights":
            state, version = item
            self.executor.set_state(state)
            self._served_version = version
        elif kind == "concurrency":
            self.scheduler.max_concurrency = item
        elif kind == "warmup":
            item.set_result(self.executor.warmup())
        else:
            raise ValueError(f"unknown engine command {kind!r}")

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = False
            try:
                with self._device:
                    self._apply_inbox()
                    busy = self.scheduler.has_work()
                    if busy:
                        self._step()
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, never the engine
                log.exception("engine step failed")
                try:
                    self._fail_step(exc)
                except Exception:  # noqa: BLE001
                    log.exception("failing the requests of a failed step failed")
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def _fail_step(self, exc: BaseException) -> None:
        with self._device:
            for seq in list(self.scheduler.running):
                self._error(seq, exc)
            try:
                self.executor.ensure_cache()
            except Exception:  # noqa: BLE001
                log.exception("could not re-create the KV cache")

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
            s.seeds[i] = p.seed
        return s

    def _page_rows(self, seqs: list[Sequence], rows: int, width: int) -> np.ndarray:
        table = np.zeros((rows, width), np.int32)
        for i, seq in enumerate(seqs):
            n = min(len(seq.pages), width)
            table[i, :n] = seq.pages[:n]
        return table

    def _run_prefill(self, chunks: list[PrefillChunk]) -> None:
        rows, length = self.buckets.prefill_shape(len(chunks), max(c.length for c in chunks))
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
            if c.seq.first_version is None:
                c.seq.first_version = self._served_version
            if c.completes_prompt:
                c.seq.state = "decode"
                self._append_guarded(c.seq, int(next_tokens[i]), float(logprobs[i]), now)

    def _run_decode(self, seqs: list[Sequence]) -> None:
        rows, width = self.buckets.decode_shape(len(seqs), max(len(s.pages) for s in seqs))
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
            self._append_guarded(seq, int(next_tokens[i]), float(logprobs[i]), now)

    # ------------------------------------------------------------------ tokens and finishing
    def _append_guarded(self, seq: Sequence, token: int, logprob: float, now: float) -> None:
        """``_append``, failing only this sequence if its host-side handling raises."""
        try:
            self._append(seq, token, logprob, now)
        except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer raised in the stop-string check
            log.exception("request %s failed on the host", seq.request.request_id)
            self._error(seq, exc)

    def _append(self, seq: Sequence, token: int, logprob: float, now: float) -> None:
        seq.generated.append(token)
        seq.logprobs.append(logprob)
        seq.last_version = self._served_version
        self.stats["generated_tokens"] += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
            self._record("first_token", seq.request, now)
        params = seq.request.params
        n = len(seq.generated)
        new_text_from = seq.detokenizer.update(self.tokenizer, seq.generated) if seq.detokenizer else 0
        if n >= params.min_new_tokens:
            if token in params.stop_token_ids or token in self.config.eos_token_ids:
                return self._finish(seq, "stop")
            if seq.detokenizer is not None and completes_stop_string(seq.detokenizer.text, new_text_from,
                                                                     params.stop_strings):
                return self._finish(seq, "stop")
        if n >= params.max_new_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Resolve ``seq`` with its text (``decode(token_ids)``); a tokenizer error makes it an error result."""
        text, error = "", None
        if self.tokenizer is not None:
            try:
                text = self.tokenizer.decode(seq.generated)
            except Exception as exc:  # noqa: BLE001
                log.exception("decoding the output of %s failed", seq.request.request_id)
                reason, error = "error", _message(exc)
        self._resolve(seq, reason, text, error)

    def _error(self, seq: Sequence, exc: BaseException) -> None:
        self._resolve(seq, "error", "", _message(exc))

    def _resolve(self, seq: Sequence, reason: FinishReason, text: str, error: str | None) -> None:
        """Release ``seq`` and give its future a ``Result`` (exactly once, whatever happens)."""
        if seq.resolved:
            return
        seq.resolved = True
        try:
            self.scheduler.finish(seq)
        except Exception:  # noqa: BLE001 - page bookkeeping must not keep the future from resolving
            log.exception("releasing %s failed", seq.request.request_id)
        try:
            now = time.perf_counter()
            if reason == "error":
                self.stats["errors"] += 1
            self._record({"abort": "abort", "error": "error"}.get(reason, "finish"), seq.request, now)
            result = seq.result(reason, now, text, error)
            try:
                seq.future.set_result(result)
            except InvalidStateError:      # cancelled by the caller meanwhile
                pass
        finally:
            self._done_one()

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """Resolve ``seq`` with an exception (the engine stopped under it)."""
        if seq.resolved:
            return
        seq.resolved = True
        try:
            self.scheduler.finish(seq)
        except Exception:  # noqa: BLE001
            log.exception("releasing %s failed", seq.request.request_id)
        try:
            seq.future.set_exception(exc)
        except InvalidStateError:
            pass
        finally:
            self._done_one()

    def _done_one(self) -> None:
        with self._idle:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


__all__ = ["Engine", "EngineConfig", "EngineEvent"]
