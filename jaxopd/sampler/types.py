"""Request, result and event types of the sampler: what a caller submits, what comes back, what is logged.

Owns validation of a request against an engine's limits (each bad field raises ``ValueError`` naming it) and
the normalised copy an engine serves (concrete seed, tuples of plain ints and strings). A request's ``kind``
is an open tag (``fast``, ``full``, ``teacher``, ``candidate``, ``score``, ...) that scheduling policies map to
priorities; the sampler attaches no other meaning to it. Plain host-side dataclasses.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import secrets
from collections.abc import Sequence as SequenceABC
from typing import Literal, Sequence

import numpy as np

from jaxopd.models.logprobs import ROLLOUT_TEMPERATURE

RequestKind = str
"""An open tag naming what a request is for (any non-empty string): ActFirst's ``fast`` actions and ``full``
responses, STI's ``teacher`` turns, ActionOPD's ``candidate`` actions, ``score`` requests, ..."""
FinishReason = Literal["stop", "length", "abort", "error"]

SEED_LIMIT = 2 ** 32
"""Seeds are unsigned 32-bit integers (the counter RNG of ``jaxopd.sampler.sampling`` mixes 32 bits)."""
INT32_MAX = 2 ** 31 - 1

_request_counter = itertools.count()


def is_int(value) -> bool:
    """A Python or numpy integer, never a bool (``True`` is not a token count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """A Python or numpy int/float, never a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _is_finite(value) -> bool:
    """``math.isfinite`` of a real number; an int too large for a float is not finite (no OverflowError)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_sequence(value) -> bool:
    """A list, tuple, range or 1-D array; a str or bytes is not a sequence of items here."""
    if isinstance(value, (str, bytes)):
        return False
    if isinstance(value, np.ndarray):
        return value.ndim == 1
    return isinstance(value, SequenceABC)


def fresh_seed() -> int:
    """A new random 32-bit seed (what ``seed=None`` gets, as in vLLM)."""
    return secrets.randbits(32)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to decode one request.

    ``min_new_tokens``: stop tokens and stop strings are ignored until this many tokens exist (the
    speedup benchmark fixes output lengths with ``min_new_tokens == max_new_tokens``).
    ``top_k = 0`` disables top-k (``top_k <= vocab_size``); ``top_p = 1`` disables nucleus sampling;
    ``temperature = 0`` is greedy. ``temperature`` defaults to ``ROLLOUT_TEMPERATURE``, the train step's too.

    ``stop_token_ids``: a sequence of token ids (a bare int is rejected). ``stop_strings``: a sequence of
    non-empty strings; a bare ``str`` is rejected rather than read letter by letter (write ``("</action>",)``).
    Stop rule: the request stops at the first token, counted from ``min_new_tokens`` on, that is a stop token
    or whose newly decoded text completes a stop string (an occurrence that ended earlier never counts, so
    one that ended before ``min_new_tokens`` does not stop the request later). Stop tokens and strings are
    kept in the output, and ``Result.text`` is always ``decode(Result.token_ids)``: when the last token
    carries text after the stop string, that text is kept too.

    ``seed``: ``None`` (the default) draws a fresh seed per request, as vLLM does, so samples of one prompt
    differ; an explicit seed in ``[0, 2**32)`` makes the request reproducible (the draw of each token depends
    only on the seed and its position, never on the batch). ``Result.seed`` reports the seed used.
    """

    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float = ROLLOUT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field; ``vocab_size`` bounds token ids and ``top_k``."""
        if not is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        if not is_real(self.temperature) or not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (a finite number; 0 is greedy), got {self.temperature!r}")
        if not is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (a number), got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        top_k_limit = INT32_MAX if vocab_size is None else min(INT32_MAX, vocab_size)
        if self.top_k > top_k_limit:
            raise ValueError(f"top_k must be <= {top_k_limit:,} (the vocabulary size), got {self.top_k!r}")
        if not _is_sequence(self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a sequence of token ids such as (151645,), "
                             f"got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            if not is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
                bound = ">= 0" if vocab_size is None else f"in [0, {vocab_size})"
                raise ValueError(f"stop_token_ids must hold integer token ids {bound}, got {token!r}")
        if isinstance(self.stop_strings, str):
            raise ValueError(f"stop_strings must be a sequence of strings such as ({self.stop_strings!r},), not the "
                             f"bare string {self.stop_strings!r} (which would be read as one stop string per letter)")
        if not _is_sequence(self.stop_strings):
            raise ValueError(f"stop_strings must be a sequence of non-empty strings, got {self.stop_strings!r}")
        for stop in self.stop_strings:
            if not isinstance(stop, str):
                raise ValueError(f"stop_strings must hold str values, got {stop!r}")
            if not stop:
                raise ValueError("stop_strings must not contain an empty string")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be None (a fresh seed per request) or an integer in [0, 2**32), "
                             f"got {self.seed!r}")

    def normalized(self) -> "SamplingParams":
        """A copy with plain Python types (tuples of ints and strs, int/float scalars) and a concrete seed
        (``fresh_seed()`` when ``seed`` is None). Call after ``validate``."""
        return SamplingParams(max_new_tokens=int(self.max_new_tokens), min_new_tokens=int(self.min_new_tokens),
                              temperature=float(self.temperature), top_p=float(self.top_p), top_k=int(self.top_k),
                              stop_token_ids=tuple(int(t) for t in self.stop_token_ids),
                              stop_strings=tuple(str(s) for s in self.stop_strings),
                              seed=fresh_seed() if self.seed is None else int(self.seed))


@dataclasses.dataclass
class Request:
    """One generation request. ``kind``: an open tag that scheduling policies may rank (see
    ``jaxopd.sampler.scheduler.SchedulingPolicy``); ``priority``: lower is more urgent (vLLM's convention).

    ``score_ids``: makes it a *scoring* request (build one with ``Request.scoring``): the engine prefills
    ``prompt_ids + score_ids`` through the paged cache (sharing prefix pages like any request), samples
    nothing, and returns ``Result.token_ids = score_ids`` with ``Result.logprobs[i]`` = log π(score_ids[i] |
    prompt, score_ids[:i]) under ``params.temperature`` (``tempered_log_softmax``: the full vocabulary, no
    top-p/top-k; temperature 0 gives the plain log-softmax), and ``finish_reason='length'``. Only
    ``params.temperature`` matters then. A score request aborted or failed before it was scored returns no
    tokens (``token_ids == []``).
    """

    prompt_ids: Sequence[int]
    params: SamplingParams
    kind: RequestKind = "full"
    priority: int = 0
    request_id: str = ""
    score_ids: Sequence[int] | None = None

    @classmethod
    def scoring(cls, prompt_ids: Sequence[int], completion_ids: Sequence[int], *,
                temperature: float = ROLLOUT_TEMPERATURE, kind: RequestKind = "score", priority: int = 0,
                request_id: str = "") -> "Request":
        """A scoring request for the log-probs of ``completion_ids`` after ``prompt_ids`` at ``temperature``."""
        return cls(prompt_ids, SamplingParams(max_new_tokens=1, temperature=temperature), kind=kind,
                   priority=priority, request_id=request_id, score_ids=completion_ids)

    def __post_init__(self):
        if not self.request_id:
            self.request_id = f"req-{next(_request_counter)}"

    def validate(self, *, max_seq_len: int, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"kind must be a non-empty string tag (fast, full, teacher, ...), got {self.kind!r}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not is_int(self.priority):
            raise ValueError(f"priority must be an integer (lower is more urgent), got {self.priority!r}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        if not _is_sequence(self.prompt_ids):
            raise ValueError(f"prompt_ids must be a sequence of token ids, got {type(self.prompt_ids).__name__}")
        n = len(self.prompt_ids)
        if n == 0:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        self.params.validate(vocab_size)
        if self.score_ids is not None:
            if not _is_sequence(self.score_ids) or len(self.score_ids) == 0:
                raise ValueError(f"score_ids must be a non-empty sequence of token ids (the completion to "
                                 f"score), got {self.score_ids!r}")
            if not all(is_int(t) and 0 <= int(t) < vocab_size for t in self.score_ids):
                raise ValueError(f"score_ids must be integers in [0, {vocab_size})")
            if n + len(self.score_ids) > max_seq_len:
                raise ValueError(f"prompt of {n:,} tokens + score_ids of {len(self.score_ids):,} exceeds "
                                 f"max_seq_len {max_seq_len:,}: shorten prompt_ids or score_ids")
        elif n + self.params.max_new_tokens > max_seq_len:
            raise ValueError(f"prompt of {n:,} tokens + max_new_tokens {self.params.max_new_tokens:,} exceeds "
                             f"max_seq_len {max_seq_len:,}: shorten prompt_ids or lower max_new_tokens")
        if not all(is_int(t) for t in self.prompt_ids):
            raise ValueError(f"prompt_ids must be integers in [0, {vocab_size}), got "
                             f"{next(t for t in self.prompt_ids if not is_int(t))!r}")
        lo, hi = min(int(t) for t in self.prompt_ids), max(int(t) for t in self.prompt_ids)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompt_ids must be integers in [0, {vocab_size}), got range [{lo}, {hi}]")

    def prepared(self, *, max_seq_len: int, vocab_size: int) -> "Request":
        """Validate, then return the copy an engine serves: normalised params with a concrete seed."""
        self.validate(max_seq_len=max_seq_len, vocab_size=vocab_size)
        score_ids = None if self.score_ids is None else tuple(int(t) for t in self.score_ids)
        return Request(prompt_ids=[int(t) for t in self.prompt_ids], params=self.params.normalized(),
                       kind=self.kind, priority=int(self.priority), request_id=self.request_id,
                       score_ids=score_ids)


@dataclasses.dataclass(frozen=True)
class Timings:
    """Seconds, from ``time.perf_counter``. queued: submit → first admission; prefill: time in prefill
    steps; decode: first token → finish; total: submit → finish."""

    submitted_at: float
    admitted_at: float
    first_token_at: float
    finished_at: float

    @property
    def queued(self) -> float:
        return self.admitted_at - self.submitted_at

    @property
    def prefill(self) -> float:
        return self.first_token_at - self.admitted_at

    @property
    def decode(self) -> float:
        return self.finished_at - self.first_token_at

    @property
    def total(self) -> float:
        return self.finished_at - self.submitted_at


@dataclasses.dataclass(frozen=True)
class Result:
    """A finished request. ``logprobs[i]`` is the float32 log-probability of ``token_ids[i]`` under the
    sampling temperature, before top-p/top-k truncation (the behaviour policy of the papers' ratios).

    ``finish_reason``: ``stop`` (a stop token or stop string), ``length`` (``max_new_tokens``), ``abort``
    (``abort()`` or a cancelled future) or ``error``: a host-side failure of this request alone (its
    tokenizer raised, say) or of the device step it was in; ``error`` then holds the message, ``token_ids``
    the tokens made so far and ``text`` is empty. Otherwise ``text == tokenizer.decode(token_ids)`` (empty
    without a tokenizer).

    ``policy_versions``: ``(first, last)`` weight versions (see ``Engine.update_weights``) of the request: the
    version of the first step that computed anything for it (its first prefill chunk) and of the step that
    sampled its last token; ``None`` when no step ran. ``first == last`` means every key/value and every
    token of the response came from that one version, since an update is applied only between two steps
    and versions never decrease. ``seed``: the sampling seed used (drawn when the request asked for None).
    """

    request_id: str
    kind: RequestKind
    prompt_ids: tuple[int, ...]
    token_ids: list[int]
    text: str
    logprobs: np.ndarray
    finish_reason: FinishReason
    timings: Timings
    num_preemptions: int = 0
    error: str | None = None
    policy_versions: tuple[int, int] | None = None
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class EngineEvent:
    """One entry of an engine's event log (``record_events``), in the engine's clock."""

    time: float
    event: str            # submit | admit | first_token | finish | preempt | abort | error
    request_id: str
    kind: RequestKind
