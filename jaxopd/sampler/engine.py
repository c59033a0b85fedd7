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
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any

import jax
import numpy as np

from jaxopd_kernels import registry as kernels
from jaxopd.models.decoder import CausalLM
from jaxopd.sampler.allocator import OutOfPages
from jaxopd.sampler.buckets import Buckets
from jaxopd.sampler.detokenize import IncrementalText, completes_stop_string
from jaxopd.sampler.executor import DecodeBatch, Executor, MixedBatch, PrefillBatch, ScoreBatch, compiled_count
from jaxopd.sampler.protocol import EngineBase
from jaxopd.sampler.sampling import SamplingArrays
from jaxopd.sampler.scheduler import POLICIES, Policy, PrefillChunk, Scheduler, Sequence, scheduling_policy
from jaxopd.sampler.types import EngineEvent, FinishReason, Request

log = logging.getLogger(__name__)


FINE_LENGTH_STEPS = 8       # ``fine_length_step``: a chunk's lengths in this many equal steps above the small ones


def fine_length_step(prefill_chunk: int) -> int:
    """A ``prefill_length_step`` for agent prompts, whose lengths spread over the whole chunk (an ALFWorld prompt is
    300 to 1,000 tokens): an eighth of the chunk (128 for 1,024: 33 prefill shapes with 4 rows, against 14)."""
    return max(16, prefill_chunk // FINE_LENGTH_STEPS)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine limits. ``max_slots`` is the largest b_max the engine can serve (decode is compiled
    for row buckets up to it); ``max_concurrency`` can then be lowered at run time without recompiling.
    ``max_prefill_tokens`` bounds a prefill step's padded batch (rows bucket × length bucket; one chunk of up
    to ``prefill_chunk`` tokens always runs): see ``Buckets.prefill_fits``.
    ``policy``: a name of ``scheduler.POLICIES`` (``fifo``, ``fast-first``, ``priority``) or a
    ``SchedulingPolicy``. ``attention_backend``: a name of ``kernels.available_backends()``, or ``"auto"`` (the
    default): ``kernels.default_backend_name()``, i.e. ``pallas-gpu`` on a GPU, ``pallas-tpu`` on a TPU,
    ``reference`` on CPU. ``prefix_sharing``: requests whose token prefixes agree on whole pages share those
    pages (a chain hash of full pages, see ``PageAllocator``) and skip their prefill; outputs are the same as
    without sharing. ``scoring``: serve ``score`` requests (``Request.score_ids``); warm-up then also compiles
    the scoring step on every prefill shape.
    ``eos_token_ids``: the ids that end every request; ``None`` (the default): the model's own end-of-turn ids
    (``ModelConfig.end_token_ids``: Qwen3's ``<|im_end|>`` and ``<|endoftext|>``, a Llama config's ``eos_token_id``).
    ``overlap``: in the steady state (the same rows decode at steps k and k+1, nothing to admit, prefill or
    apply) decode step k+1 is dispatched, fed step k's tokens on the device, before the host processes step
    k; a stop found at step k then drops that row's token of step k+1 (never returned). Outputs are those of
    the synchronous engine (``overlap=False``, kept for comparison and debugging).
    ``mixed_steps``: a step that has both prompt chunks to prefill and rows to decode runs them as one device
    step (``executor.mixed_step``: one pass of the weights for both) instead of a prefill step, then a decode
    step; the rows that decode are those that were decoding before the step. ``None`` (the default): on when
    the backend's decode reads pages in place (``pallas-gpu``, ``pallas-tpu``), since the mixed step's decode
    rows span the whole page window, which a gather backend pays for; off for ``reference`` on CPU. Warm-up
    then compiles one more shape per prefill shape. Outputs equal the separate steps' (same tokens; log-probs
    to float rounding, as the batch composition differs).
    ``prefill_length_step``: None (the default) pads a prefill chunk to a power of two (a 600-token prompt runs as
    1,024 tokens) and its rows to 1, 4, 16 or 64; a step (e.g. 128) pads lengths to its multiples and rows to a power
    of two, for a few more compiled shapes. The agents' engines (``experiments.evaluate``, ``jaxopd.methods.loop``)
    use ``fine_length_step``. Measured on 2 CPU cores, the trained SmolLM2 teacher on 4 valid_unseen games x 6 turns
    (24 prompts of 300 to 1,000 tokens): 62 % of the prefilled tokens were real with the default, 84 % with a step
    of 128, and the evaluation took 163.6 s against 99.9 s (same episodes, token for token).
    ``scan_layers`` (opt-in, a decode-step candidate measured on GPUs): every step runs the decoder layers as one
    ``jax.lax.scan`` over a stacked copy of their parameters, and the layers' KV caches are one page pool
    (``executor.LayerScan``); costs the layers' parameter bytes once more in device memory. Same tokens as the
    unrolled layers; log-probs to float rounding."""

    max_slots: int = 64
    page_size: int = 16
    num_pages: int = 2048
    max_seq_len: int = 4096
    prefill_chunk: int = 512
    max_prefill_tokens: int = 4096
    max_prefill_rows: int = 16
    policy: Policy = "fifo"
    eos_token_ids: tuple[int, ...] | None = None
    attention_backend: str = "auto"
    record_events: bool = False
    overlap: bool = True
    prefix_sharing: bool = True
    scoring: bool = True
    mixed_steps: bool | None = None
    scan_layers: bool = False
    prefill_length_step: int | None = None

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
        if self.prefill_length_step is not None and (not isinstance(self.prefill_length_step, int)
                                                     or isinstance(self.prefill_length_step, bool)
                                                     or self.prefill_length_step <= 0):
            raise ValueError(f"EngineConfig.prefill_length_step must be a positive int or None, got "
                             f"{self.prefill_length_step!r}")
        if self.max_prefill_tokens < min(self.prefill_chunk, 16):
            raise ValueError("max_prefill_tokens must be at least min(prefill_chunk, 16)")
        try:
            kernels.resolve_backend_name(self.attention_backend)
        except ValueError as exc:
            raise ValueError(f"EngineConfig.attention_backend: {exc}") from None
        for name in ("prefix_sharing", "scoring", "record_events", "overlap", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.mixed_steps is not None and not isinstance(self.mixed_steps, bool):
            raise ValueError(f"EngineConfig.mixed_steps must be a bool or None (by backend), got {self.mixed_steps!r}")

    @property
    def backend_name(self) -> str:
        """The attention backend actually used (``"auto"`` resolved for this platform)."""
        return kernels.resolve_backend_name(self.attention_backend)

    @property
    def uses_mixed_steps(self) -> bool:
        """``mixed_steps`` resolved: ``None`` means on exactly when the backend's decode reads pages in place."""
        if self.mixed_steps is not None:
            return self.mixed_steps
        return bool(getattr(kernels.get_backend(self.backend_name), "decode_in_place", False))


class Engine(EngineBase):
    """Continuous-batching paged-KV sampler for a ``CausalLM`` model. Use as a context manager or start()/stop().

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

    def __init__(self, model: CausalLM, config: EngineConfig = EngineConfig(), tokenizer: Any = None, *,
                 policy_version: int = 0):
        config.validate()
        if config.eos_token_ids is None:
            config = dataclasses.replace(config, eos_token_ids=model.config.end_token_ids)
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.buckets = Buckets.make(max_slots=config.max_slots, max_seq_len=config.max_seq_len,
                                    page_size=config.page_size, prefill_chunk=config.prefill_chunk,
                                    max_prefill_tokens=config.max_prefill_tokens,
                                    max_prefill_rows=config.max_prefill_rows,
                                    length_step=config.prefill_length_step)
        self.executor = Executor(model, num_pages=config.num_pages, page_size=config.page_size,
                                 buckets=self.buckets, attention_backend=config.backend_name,
                                 scoring=config.scoring, mixed_steps=config.uses_mixed_steps,
                                 scan_layers=config.scan_layers)
        self.scheduler = Scheduler(max_slots=config.max_slots, page_size=config.page_size,
                                   num_pages=config.num_pages, policy=config.policy,
                                   prefill_chunk=config.prefill_chunk,
                                   max_prefill_tokens=config.max_prefill_tokens,
                                   max_prefill_rows=self.buckets.prefill_rows[-1],
                                   prefill_fits=self.buckets.prefill_fits,
                                   prefix_sharing=config.prefix_sharing)
        self.events: list[EngineEvent] = []
        self.stats = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "preemptions": 0,
                      "generated_tokens": 0, "errors": 0, "shared_pages": 0, "prefill_tokens_saved": 0,
                      "scored_tokens": 0, "mixed_steps": 0,
                      # the prefill steps' real tokens against their padded shapes (what the buckets cost)
                      "prefill_tokens": 0, "prefill_padded_tokens": 0}
        self.scheduler.stats = self.stats        # the scheduler counts shared pages / prefill tokens saved
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
        self._run: _DecodeRun | None = None      # the decode rows of the current steady state (engine thread)
        self._decode_buffers: dict[tuple[int, int], _DecodeBuffers] = {}

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
            self._run = None                     # its steps in flight are dropped with their requests
            self._decode_buffers.clear()         # ... and may still read their host arrays: never reuse them

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
        if served.score_ids is not None and not self.config.scoring:
            raise ValueError("score requests need an engine with EngineConfig.scoring=True")
        if served.params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need an engine created with a tokenizer")
        future: Future = Future()
        seq = Sequence(request=served, future=future, arrival=next(self._arrival),
                       submitted_at=time.perf_counter(), prompt=list(served.prompt_ids))
        if served.score_ids is not None:                 # the completion is prefilled, never decoded
            seq.generated = list(served.score_ids)
            seq.score_logprobs = np.zeros(len(served.score_ids), np.float32)
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
            self.scheduler.clear_prefix_cache()      # the cached keys/values are stale now
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
                    busy = self.scheduler.has_work() or self._run is not None
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
        """Fail the requests of a failed step. A step that failed before anything ran (in admission, say)
        fails the head of the queue instead, the request it was admitting: otherwise the same step would fail
        again at once, forever."""
        with self._device:
            running = list(self.scheduler.running)
            for seq in running:
                self._error(seq, exc)
            if not running and self.scheduler.waiting:
                self._error(self.scheduler.waiting[0], exc)
            self._run = None
            self._decode_buffers.clear()             # steps of the dropped run may still read their host arrays
            self.scheduler.clear_prefix_cache()      # a failed step may have left the cache re-created
            try:
                self.executor.ensure_cache()
            except Exception:  # noqa: BLE001
                log.exception("could not re-create the KV cache")

    def _step(self) -> None:
        if self._run is not None:                # steady state: the next decode step of the same rows
            self._advance_run()
            self.stats["steps"] += 1
            return
        now = time.perf_counter()
        for seq in self.scheduler.admit(now):
            self._record("admit", seq.request, now)
        chunks = self.scheduler.prefill_chunks()
        if chunks and self.executor.mixed_steps and self._mixed_step(chunks):
            self.stats["steps"] += 1
            return
        if chunks:
            self._run_prefill(chunks)
        decode = self._decode_sequences()
        if decode:
            self._run_decode(decode)
        self.stats["steps"] += 1

    def _decode_sequences(self) -> list[Sequence]:
        """The scheduler's rows to decode this step (each given a page for its next position), recording the
        sequences it preempted to find those pages."""
        decode = self.scheduler.decode_sequences()
        for seq in self.scheduler.preempted:
            self.stats["preemptions"] += 1
            self._record("preempt", seq.request, time.perf_counter())
        return decode

    def _mixed_step(self, chunks: list[PrefillChunk]) -> bool:
        """Run this step's generation chunks and the rows already decoding as one device step (scoring chunks
        in their own step); False, having done nothing, when the step has no row to decode or no generation
        chunk. A chunk whose sequence the decode rows' pages preempted waits for its re-admission."""
        if all(c.seq.is_score for c in chunks) or \
                not any(s.state == "decode" for s in self.scheduler.running):
            return False
        decode = self._decode_sequences()
        chunks = [c for c in chunks if c.seq.state == "prefill"]
        scoring = [c for c in chunks if c.seq.is_score]
        plain = [c for c in chunks if not c.seq.is_score]
        if scoring:
            self._run_score_prefill(scoring)
        if plain and decode:
            self._run_mixed(plain, decode)
        elif plain:
            self._run_generation_prefill(plain)
        elif decode:
            self._run_decode(decode)
        return True

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
        """Prefill the step's chunks: generation chunks in one ``prefill_step``, scoring chunks in one
        ``score_step`` (each a sub-batch of a batch that fits, so each fits a warmed-up shape)."""
        plain = [c for c in chunks if not c.seq.is_score]
        scoring = [c for c in chunks if c.seq.is_score]
        if plain:
            self._run_generation_prefill(plain)
        if scoring:
            self._run_score_prefill(scoring)

    def _prefill_arrays(self, chunks: list[PrefillChunk]):
        rows, length = self.buckets.prefill_shape(len(chunks), max(c.length for c in chunks))
        tokens = np.zeros((rows, length), np.int32)
        starts = np.zeros(rows, np.int32)
        lengths = np.zeros(rows, np.int32)
        for i, c in enumerate(chunks):
            tokens[i, :c.length] = c.seq.tokens[c.start:c.start + c.length]
            starts[i], lengths[i] = c.start, c.length
        seqs = [c.seq for c in chunks]
        self.stats["prefill_tokens"] += int(lengths.sum())
        self.stats["prefill_padded_tokens"] += rows * length
        return rows, tokens, starts, lengths, self._page_rows(seqs, rows, self.buckets.max_pages_per_seq)

    def _run_score_prefill(self, chunks: list[PrefillChunk]) -> None:
        """Prefill scoring chunks; each position of a completion's context scores the next token. A request
        whose last chunk ran is finished with the log-probs of its completion (``Request.score_ids``)."""
        rows, tokens, starts, lengths, page_table = self._prefill_arrays(chunks)
        targets = np.zeros(tokens.shape, np.int32)
        temperature = np.ones(rows, np.float32)
        spans = []
        for i, c in enumerate(chunks):
            seq_tokens, prompt_len = c.seq.tokens, len(c.seq.prompt)
            lo = max(c.start, prompt_len - 1)                  # positions whose next token is in the completion
            hi = min(c.start + c.length, len(seq_tokens) - 1)
            if hi > lo:
                targets[i, lo - c.start:hi - c.start] = seq_tokens[lo + 1:hi + 1]
            spans.append((lo, hi))
            temperature[i] = c.seq.request.params.temperature
        logprobs = self.executor.score(ScoreBatch(tokens, starts, lengths, page_table, targets, temperature))
        self.stats["prefill_steps"] += 1
        now = time.perf_counter()
        for i, c in enumerate(chunks):
            seq, (lo, hi) = c.seq, spans[i]
            seq.num_cached += c.length
            if seq.first_version is None:
                seq.first_version = self._served_version
            prompt_len = len(seq.prompt)
            if hi > lo:
                seq.score_logprobs[lo + 1 - prompt_len:hi + 1 - prompt_len] = logprobs[i, lo - c.start:hi - c.start]
            if c.completes_prompt:
                seq.logprobs = [float(x) for x in seq.score_logprobs]
                seq.last_version = self._served_version
                seq.first_token_at = now
                self.stats["scored_tokens"] += len(seq.generated)
                self._finish(seq, "length")

    def _generation_prefill_batch(self, chunks: list[PrefillChunk]) -> PrefillBatch:
        rows, tokens, starts, lengths, page_table = self._prefill_arrays(chunks)
        return PrefillBatch(tokens, starts, lengths, page_table, self._sampling([c.seq for c in chunks], rows))

    def _run_generation_prefill(self, chunks: list[PrefillChunk]) -> None:
        next_tokens, logprobs = self.executor.prefill(self._generation_prefill_batch(chunks))
        self._take_prefill(chunks, next_tokens, logprobs)

    def _take_prefill(self, chunks: list[PrefillChunk], next_tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Account a generation prefill step: chunks are cached; a chunk that completes its prompt gives the
        sequence its first token (sampled after the chunk's last token)."""
        self.stats["prefill_steps"] += 1
        now = time.perf_counter()
        for i, c in enumerate(chunks):
            c.seq.num_cached += c.length
            if c.seq.first_version is None:
                c.seq.first_version = self._served_version
            if c.completes_prompt:
                c.seq.state = "decode"
                self._append_guarded(c.seq, int(next_tokens[i]), float(logprobs[i]), now)

    # ------------------------------------------------------------------ decode runs (vectorised, overlapped)
    def _run_decode(self, seqs: list[Sequence]) -> None:
        """Start a decode run over ``seqs`` (each has a page for its next position): dispatch its first step,
        then advance it (dispatch the next step if the steady state allows, process this one)."""
        run = self._start_run(seqs, *self.buckets.decode_shape(len(seqs), max(len(s.pages) for s in seqs)))
        self._dispatch(run, run.buffers.tokens)
        self._advance_run()

    def _run_mixed(self, chunks: list[PrefillChunk], seqs: list[Sequence]) -> None:
        """Prefill ``chunks`` and start a decode run over ``seqs`` with one device step (``executor.mixed``): its
        decode rows are ``Buckets.mixed_decode_rows`` over the whole page window, a compiled decode shape too."""
        run = self._start_run(seqs, self.buckets.mixed_decode_rows, self.buckets.max_pages_per_seq)
        prefill = self._generation_prefill_batch(chunks)
        next_tokens, logprobs, decode_tokens, decode_logprobs = self.executor.mixed(
            MixedBatch(prefill, self._decode_batch(run, run.buffers.tokens)))
        run.pending.append((decode_tokens, decode_logprobs, self._served_version))
        self.stats["decode_steps"] += 1
        self.stats["mixed_steps"] += 1
        self._take_prefill(chunks, next_tokens, logprobs)
        self._advance_run()

    def _start_run(self, seqs: list[Sequence], rows: int, width: int) -> "_DecodeRun":
        buffers = self._decode_buffers.get((rows, width))
        if buffers is None:
            buffers = self._decode_buffers[(rows, width)] = _DecodeBuffers(rows, width)
        self._run = _DecodeRun(seqs, buffers, self.config.eos_token_ids)   # nothing is in flight: buffers are free
        return self._run

    def _decode_batch(self, run: "_DecodeRun", tokens: Any) -> DecodeBatch:
        b = run.buffers
        return DecodeBatch(tokens, b.positions[run.positions_index], b.page_tables[run.table_index], b.active,
                           b.sampling)

    def _dispatch(self, run: "_DecodeRun", tokens: Any) -> None:
        next_tokens, logprobs = self.executor.decode(self._decode_batch(run, tokens))
        run.pending.append((next_tokens, logprobs, self._served_version))
        self.stats["decode_steps"] += 1

    def _advance_run(self) -> None:
        """Dispatch step k+1 when the steady state allows it, then process step k; end the run when nothing
        of it is in flight any more."""
        run = self._run
        if run.pending and self._can_overlap(run):
            self._dispatch_next(run)
        if run.pending:
            self._process(run)
        if not run.pending:
            self._end_run(run)

    def _can_overlap(self, run: "_DecodeRun") -> bool:
        """Whether step k+1 of the same rows is exactly what the synchronous engine would run next, whatever
        step k samples (except stops, whose extra token is dropped): no command waiting in the inbox, no
        request to admit, no prefill, no row reaching its length at step k."""
        if not self.config.overlap or run.broken or len(run.pending) != 1 or self._stop.is_set():
            return False
        if not self._inbox.empty():
            return False
        sched = self.scheduler
        running = len(sched.running)
        if running != run.n:                     # a prefill (or anything but these rows) is running
            return False
        if sched.waiting and running < min(sched.max_concurrency, sched.max_slots):
            return False                         # the synchronous engine would try to admit first
        return not bool(np.any(run.base + run.steps + 1 >= run.max_new))

    def _dispatch_next(self, run: "_DecodeRun") -> None:
        """Dispatch step k+1 fed with step k's tokens on the device: positions + 1, and a new page for rows
        whose next position starts one (if a page is missing, or the page window would grow, run k alone)."""
        b, n = run.buffers, run.n
        positions = b.positions[1 - run.positions_index]
        np.add(b.positions[run.positions_index], b.active, out=positions)    # padding rows stay at 0
        page_index = positions[:n] // self.config.page_size
        need = np.flatnonzero(page_index >= run.num_pages)
        if need.size:
            if np.any(page_index[need] >= b.width):
                return
            try:
                pages = self.scheduler.allocator.allocate(int(need.size))
            except OutOfPages:
                return
            table = b.page_tables[1 - run.table_index]      # the other buffer: step k may still read this one
            np.copyto(table, b.page_tables[run.table_index])
            table[need, page_index[need]] = pages
            run.table_index = 1 - run.table_index
            run.num_pages[need] += 1
            for i, page in zip(need.tolist(), pages):
                run.seqs[i].pages.append(page)
        run.positions_index = 1 - run.positions_index
        self._dispatch(run, run.pending[0][0])

    def _process(self, run: "_DecodeRun") -> None:
        """Take step k's tokens: record them for every live row at once, then finish the rows that stop or
        reach their length (stop strings: only rows that have them)."""
        tokens_on_device, logprobs_on_device, version = run.pending.popleft()
        # Wait for every device of the step: ``np.asarray`` of a replicated output waits for one replica only, and
        # this step's host arrays (aliased by the CPU backend) are rewritten for a later step once it is processed
        jax.block_until_ready((tokens_on_device, logprobs_on_device))
        n = run.n
        tokens = np.asarray(tokens_on_device)[:n]
        logprobs = np.asarray(logprobs_on_device)[:n]
        now = time.perf_counter()
        run.token_steps.append(tokens)
        run.logprob_steps.append(logprobs)
        run.versions.append(version)
        run.steps += 1
        alive = run.alive
        self.stats["generated_tokens"] += int(np.count_nonzero(alive))
        if run.needs_first_token:                # only a sequence whose first token was not prefilled
            run.needs_first_token = False
            for i, seq in enumerate(run.seqs):
                if alive[i] and seq.first_token_at is None:
                    seq.first_token_at = now
                    self._record("first_token", seq.request, now)
        generated = run.base + run.steps
        may_stop = generated >= run.min_new
        stop = may_stop & (tokens[:, None] == run.stop_table).any(axis=1) if run.stop_table.shape[1] else \
            np.zeros(n, bool)
        for i in run.string_rows:
            if not alive[i]:
                continue
            seq = run.seqs[i]
            try:
                self._flush_row(run, i)
                new_text_from = seq.detokenizer.update(self.tokenizer, seq.generated)
                if may_stop[i] and not stop[i] and completes_stop_string(
                        seq.detokenizer.text, new_text_from, seq.request.params.stop_strings):
                    stop[i] = True
            except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer raised in the stop-string check
                log.exception("request %s failed on the host", seq.request.request_id)
                self._error(seq, exc)
        finished = np.flatnonzero(alive & (stop | (generated >= run.max_new)))
        for i in finished.tolist():
            self._finish(run.seqs[i], "stop" if stop[i] else "length")

    def _end_run(self, run: "_DecodeRun") -> None:
        """Copy the run's tokens into its live sequences (one slice per row) and leave the steady state."""
        self._run = None
        rows = np.flatnonzero(run.alive)
        if rows.size and run.steps:
            tokens = np.stack(run.token_steps, axis=1).tolist()
            logprobs = np.stack(run.logprob_steps, axis=1).tolist()
            for i in rows.tolist():
                run.flush(i, tokens[i], logprobs[i])

    def _flush_row(self, run: "_DecodeRun", i: int) -> None:
        if run.flushed[i] < run.steps:
            done = int(run.flushed[i])
            run.flush(i, [int(t[i]) for t in run.token_steps[done:]], [float(x[i]) for x in run.logprob_steps[done:]],
                      offset=done)

    def _leave_run(self, seq: Sequence) -> None:
        """``seq`` resolves: bring its tokens up to date and drop it from the run's later steps."""
        run = self._run
        if run is not None:
            i = run.row_of.get(id(seq))
            if i is not None and run.alive[i]:
                self._flush_row(run, i)
                run.alive[i] = False
                run.broken = True

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
        self._leave_run(seq)
        text, error = "", None
        if self.tokenizer is not None:
            try:
                text = self.tokenizer.decode(seq.output_ids)
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
        self._leave_run(seq)
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
        self._leave_run(seq)
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


class _DecodeBuffers:
    """The host arrays of decode steps of one padded shape, allocated once and filled in place. Positions and
    page tables have two buffers each: step k+1's are written while step k may still read the other."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        self.tokens = np.zeros(rows, np.int32)
        self.positions = (np.zeros(rows, np.int32), np.zeros(rows, np.int32))
        self.page_tables = (np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32))
        self.active = np.zeros(rows, bool)
        self.sampling = SamplingArrays.empty(rows)


class _DecodeRun:
    """Consecutive decode steps over one list of sequences (row i = ``seqs[i]``) and their per-row arrays.

    Tokens of processed steps are kept per step (``token_steps``) and copied into each ``Sequence`` only when
    it leaves the run (finishes, or the run ends) or, for rows with stop strings, every step. ``pending``: the
    dispatched, unprocessed steps (tokens, log-probs, the weight version that produced them), at most two.
    ``broken``: a row left, so no further step is dispatched."""

    def __init__(self, seqs: list[Sequence], buffers: _DecodeBuffers, eos_token_ids: tuple[int, ...]):
        n = len(seqs)
        self.seqs, self.n, self.buffers = seqs, n, buffers
        params = [seq.request.params for seq in seqs]
        self.row_of = {id(seq): i for i, seq in enumerate(seqs)}
        self.alive = np.ones(n, bool)
        self.base = np.fromiter((len(seq.generated) for seq in seqs), np.int64, n)
        self.cached = np.fromiter((seq.num_cached for seq in seqs), np.int64, n)
        self.num_pages = np.fromiter((len(seq.pages) for seq in seqs), np.int64, n)
        self.min_new = np.fromiter((p.min_new_tokens for p in params), np.int64, n)
        self.max_new = np.fromiter((p.max_new_tokens for p in params), np.int64, n)
        stops = [tuple(p.stop_token_ids) + tuple(eos_token_ids) for p in params]
        self.stop_table = np.full((n, max(map(len, stops))), -1, np.int64)
        for i, ids in enumerate(stops):
            self.stop_table[i, :len(ids)] = ids
        self.string_rows = [i for i, seq in enumerate(seqs) if seq.detokenizer is not None]
        self.needs_first_token = any(seq.first_token_at is None for seq in seqs)
        self.token_steps: list[np.ndarray] = []
        self.logprob_steps: list[np.ndarray] = []
        self.versions: list[int] = []
        self.steps = 0
        self.flushed = np.zeros(n, np.int64)
        self.pending: deque = deque()
        self.broken = False
        self.positions_index = self.table_index = 0
        # fill the step arrays in place (padding rows: token 0, position 0, null pages, inactive)
        b = buffers
        b.tokens[:] = 0
        b.tokens[:n] = [seq.generated[-1] for seq in seqs]
        b.positions[0][:] = 0
        b.positions[0][:n] = self.cached
        table = b.page_tables[0]
        table[:] = 0
        for i, seq in enumerate(seqs):
            pages = seq.pages[:b.width]
            table[i, :len(pages)] = pages
        b.active[:] = False
        b.active[:n] = True
        s = b.sampling
        s.temperature[:] = 1.0
        s.top_p[:] = 1.0
        s.top_k[:] = 0
        s.seeds[:] = 0
        s.temperature[:n] = [p.temperature for p in params]
        s.top_p[:n] = [p.top_p for p in params]
        s.top_k[:n] = [p.top_k for p in params]
        s.seeds[:n] = [p.seed for p in params]

    def flush(self, i: int, tokens: list, logprobs: list, offset: int = 0) -> None:
        """Append row ``i``'s tokens of steps ``flushed[i]..steps`` (``tokens[j]`` is step ``offset + j``)."""
        seq, done = self.seqs[i], int(self.flushed[i]) - offset
        seq.generated.extend(tokens[done:])
        seq.logprobs.extend(logprobs[done:])
        seq.num_cached = int(self.cached[i]) + self.steps
        seq.last_version = self.versions[self.steps - 1]
        self.flushed[i] = self.steps


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


__all__ = ["Engine", "EngineConfig", "EngineEvent", "fine_length_step"]
