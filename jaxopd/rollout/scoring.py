"""Rollout-time teacher scoring: the teacher's per-token log-probabilities of a proposed completion.

Owns the ``TeacherScorer`` protocol (``score(prompt_ids, completion_ids) -> log-probs at the rollout
temperature``) that STI-OPD's stochastic intervention needs at every turn (STI-OPD Sec. 3.2, Eq. 5), the
adapter that turns any callable into one, and ``DenseTeacherScorer``, a dense no-cache recompute with the
teacher's own weights, and ``EngineTeacherScorer``, which sends ``score`` requests (``Request.scoring``) to a
running sampler engine: they go through its paged cache (sharing prefix pages with the engine's other
requests) on shapes its warm-up compiled.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxopd.models.logprobs import ROLLOUT_TEMPERATURE, token_log_probs
from jaxopd.models.decoder import CausalLM, dense_causal_attend
from jaxopd.sampler.types import Request

__all__ = ["TeacherScorer", "CallableScorer", "as_teacher_scorer", "DenseTeacherScorer", "EngineTeacherScorer",
           "checked_scores"]


@runtime_checkable
class TeacherScorer(Protocol):
    """The teacher's log-probabilities of ``completion_ids`` after ``prompt_ids``.

    Returns a float ``[len(completion_ids)]`` array: entry i is log π_T(completion_i | prompt, completion_<i)
    at the rollout temperature (the temperature the student sampled the completion with), over the full
    vocabulary (no top-p/top-k truncation). Blocking; safe to call from several rollout threads at once.
    """

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> np.ndarray:
        ...


def checked_scores(scores: Any, completion_length: int, where: str = "teacher scorer") -> np.ndarray:
    """``scores`` as a float32 ``[completion_length]`` array of finite log-probabilities (<= 0), else ValueError."""
    scores = np.asarray(scores, np.float32)
    if scores.shape != (completion_length,):
        raise ValueError(f"{where} returned shape {scores.shape}, expected ({completion_length},)")
    if not np.all(np.isfinite(scores)) or np.any(scores > 1e-4):
        raise ValueError(f"{where} returned values that are not finite log-probabilities: "
                         f"min {scores.min() if scores.size else None}, max {scores.max() if scores.size else None}")
    return np.minimum(scores, 0.0)


class CallableScorer:
    """A ``TeacherScorer`` around any ``fn(prompt_ids, completion_ids) -> log-probs``."""

    def __init__(self, fn: Callable[[Sequence[int], Sequence[int]], Any]):
        if not callable(fn):
            raise ValueError(f"CallableScorer needs a callable, got {type(fn).__name__}")
        self.fn = fn

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> np.ndarray:
        return checked_scores(self.fn(list(prompt_ids), list(completion_ids)), len(completion_ids))


def as_teacher_scorer(scorer: Any) -> TeacherScorer:
    """``scorer`` itself when it has a ``score`` method, a ``CallableScorer`` around it when it is callable."""
    if hasattr(scorer, "score") and callable(scorer.score):
        return scorer
    if callable(scorer):
        return CallableScorer(scorer)
    raise ValueError(f"a teacher scorer needs a score(prompt_ids, completion_ids) method or must be callable, "
                     f"got {type(scorer).__name__}")


def _bucket(length: int, multiple: int) -> int:
    """The smallest power-of-two multiple of ``multiple`` that holds ``length`` (few shapes, few compiles)."""
    return multiple * (1 << max(0, math.ceil(math.log2(max(1, math.ceil(length / multiple))))))


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"))
def _completion_log_probs(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, attention_mask: jax.Array,
                          gather_positions: jax.Array, targets: jax.Array, *, temperature: float) -> jax.Array:
    """Log-probs of ``targets`` predicted at ``gather_positions`` of one dense forward over ``tokens`` ``[1, L]``.

    Only the gathered positions go through the vocabulary projection (a full ``[L, V]`` logits array of a
    real vocabulary would dominate memory).
    """
    model = nnx.merge(graphdef, state)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    hidden, _ = model.hidden_states(tokens, positions, dense_causal_attend(positions, attention_mask))
    selected = jnp.take(hidden[0], gather_positions, axis=0)
    return token_log_probs(model.logits(selected), targets, temperature)


class DenseTeacherScorer:
    """Teacher scoring by a dense forward (no KV cache) of prompt + completion with the teacher's weights.

    Sequence and completion lengths are padded to power-of-two buckets (multiples of ``length_multiple`` and
    ``completion_multiple``), so a run compiles a handful of shapes. ``update_weights`` swaps the teacher's
    parameters (a frozen teacher never needs it). The reference for an engine-backed scorer.
    """

    def __init__(self, model: CausalLM, *, temperature: float = ROLLOUT_TEMPERATURE, length_multiple: int = 256,
                 completion_multiple: int = 32, max_seq_len: int | None = None):
        if not temperature > 0:
            raise ValueError(f"the scoring temperature must be > 0 (the rollout's), got {temperature}")
        self.graphdef, self.state = nnx.split(model)
        self.temperature = float(temperature)
        self.length_multiple = int(length_multiple)
        self.completion_multiple = int(completion_multiple)
        self.max_seq_len = max_seq_len
        self.vocab_size = model.config.vocab_size
        self._lock = threading.Lock()

    def update_weights(self, state: nnx.State) -> None:
        with self._lock:
            self.state = state

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> np.ndarray:
        prompt, completion = [int(t) for t in prompt_ids], [int(t) for t in completion_ids]
        if not prompt:
            raise ValueError("DenseTeacherScorer.score: prompt_ids is empty")
        if not completion:
            return np.zeros(0, np.float32)
        ids = prompt + completion
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{min(ids)}, {max(ids)}]")
        length = _bucket(len(ids), self.length_multiple)
        if self.max_seq_len is not None:
            if len(ids) > self.max_seq_len:
                raise ValueError(f"prompt + completion ({len(ids)} tokens) exceed max_seq_len {self.max_seq_len}")
            length = min(length, max(self.max_seq_len, len(ids)))
        width = _bucket(len(completion), self.completion_multiple)
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :len(ids)] = ids
        mask = np.zeros((1, length), bool)
        mask[0, :len(ids)] = True
        gather = np.zeros(width, np.int32)                  # completion token i is predicted at P - 1 + i
        gather[:len(completion)] = np.arange(len(prompt) - 1, len(ids) - 1)
        targets = np.zeros(width, np.int32)
        targets[:len(completion)] = completion
        with self._lock:
            state = self.state
        logp = _completion_log_probs(self.graphdef, state, jnp.asarray(tokens), jnp.asarray(mask),
                                     jnp.asarray(gather), jnp.asarray(targets), temperature=self.temperature)
        return checked_scores(np.asarray(logp)[:len(completion)], len(completion), "DenseTeacherScorer")


class EngineTeacherScorer:
    """Teacher scoring by ``score`` requests to a sampler engine serving the teacher's weights.

    ``engine``: a started ``jaxopd.sampler.Engine`` (or anything with its ``submit``) built with
    ``EngineConfig.scoring=True``; requests wait in its queue until it runs. Each ``score`` call submits one
    ``Request.scoring(prompt, completion, temperature=...)`` and blocks on its result; calls from several
    threads are batched by the engine. Weight updates go through the engine (``engine.update_weights``).
    A request that fails (``finish_reason`` other than ``length``) raises ``RuntimeError``.
    """

    def __init__(self, engine: Any, *, temperature: float = ROLLOUT_TEMPERATURE, kind: str = "score",
                 priority: int = 0, timeout: float | None = None):
        if not temperature > 0:
            raise ValueError(f"the scoring temperature must be > 0 (the rollout's), got {temperature}")
        if not callable(getattr(engine, "submit", None)):
            raise ValueError(f"EngineTeacherScorer needs an engine with submit(), got {type(engine).__name__}")
        self.engine = engine
        self.temperature = float(temperature)
        self.kind = kind
        self.priority = int(priority)
        self.timeout = timeout

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> np.ndarray:
        completion = [int(t) for t in completion_ids]
        if not completion:
            return np.zeros(0, np.float32)
        request = Request.scoring([int(t) for t in prompt_ids], completion, temperature=self.temperature,
                                  kind=self.kind, priority=self.priority)
        result = self.engine.submit(request).result(self.timeout)
        if result.finish_reason != "length":
            raise RuntimeError(f"score request {result.request_id} ended with {result.finish_reason!r}: "
                               f"{result.error}")
        return checked_scores(result.logprobs, len(completion), "EngineTeacherScorer")
