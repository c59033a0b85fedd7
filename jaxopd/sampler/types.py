"""Request, result and event types of the sampler: what a caller submits, what comes back, what is logged.

Owns validation of a request against an engine's limits (each bad field raises ``ValueError`` naming it).
A request's ``kind`` is an open tag (``fast``, ``full``, ``teacher``, ``candidate``, ``score``, ...) that
scheduling policies map to priorities; the sampler attaches no other meaning to it. Plain host-side
dataclasses.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Literal, Sequence

import numpy as np

from jaxopd.models.logprobs import ROLLOUT_TEMPERATURE

RequestKind = str
"""An open tag naming what a request is for (any non-empty string): ActFirst's ``fast`` actions and ``full``
responses, STI's ``teacher`` turns, ActionOPD's ``candidate`` actions, ``score`` requests, ..."""
FinishReason = Literal["stop", "length", "abort", "error"]

_request_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to decode one request.

    ``min_new_tokens``: stop tokens and stop strings are ignored until this many tokens exist (the
    speedup benchmark fixes output lengths with ``min_new_tokens == max_new_tokens``).
    ``top_k = 0`` disables top-k; ``top_p = 1`` disables nucleus sampling; ``temperature = 0`` is greedy.
    ``temperature`` defaults to ``ROLLOUT_TEMPERATURE``, the train step's default too.
    Stop strings are matched on the decoded tail and kept in the output.
    """

    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float = ROLLOUT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, (int, np.integer)) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")


@dataclasses.dataclass
class Request:
    """One generation request. ``kind``: an open tag that scheduling policies may rank (see
    ``jaxopd.sampler.scheduler.SchedulingPolicy``); ``priority``: lower is more urgent (vLLM's convention)."""

    prompt_ids: Sequence[int]
    params: SamplingParams
    kind: RequestKind = "full"
    priority: int = 0
    request_id: str = ""

    def __post_init__(self):
        if not self.request_id:
            self.request_id = f"req-{next(_request_counter)}"

    def validate(self, *, max_seq_len: int, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"kind must be a non-empty string tag (fast, full, teacher, ...), got {self.kind!r}")
        n = len(self.prompt_ids)
        if n == 0:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        self.params.validate()
        if n + self.params.max_new_tokens > max_seq_len:
            raise ValueError(f"prompt of {n:,} tokens + max_new_tokens {self.params.max_new_tokens:,} exceeds "
                             f"max_seq_len {max_seq_len:,}")
        ids = np.asarray(self.prompt_ids)
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompt_ids must be integers in [0, {vocab_size}), got range "
                             f"[{ids.min()}, {ids.max()}]")


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
    sampling temperature, before top-p/top-k truncation (the behaviour policy of the papers' ratios)."""

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


@dataclasses.dataclass(frozen=True)
class EngineEvent:
    """One entry of an engine's event log (``record_events``), in the engine's clock."""

    time: float
    event: str            # submit | admit | first_token | finish | preempt | abort
    request_id: str
    kind: RequestKind
