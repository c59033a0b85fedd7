"""The sampler's device side: the paged KV cache and the jitted prefill / decode / sampling functions.

Owns the page pools (one ``[num_pages, page_size, kv_heads, head_dim]`` pair per layer, donated through
every call so updates are in place) and the shape buckets. Every call is a pure function of padded
arrays; which buckets exist is fixed at construction, so nothing compiles after ``warmup``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels
from jaxopd.models.qwen3 import Qwen3
from jaxopd.sampler.allocator import NULL_PAGE


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """``lo, 2lo, 4lo, ...`` up to and including ``hi`` (``hi`` itself is always the last bucket)."""
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded shapes of the jitted functions. decode: rows × page-window; prefill: rows × chunk length."""

    decode_rows: tuple[int, ...]
    decode_pages: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    max_pages_per_seq: int

    @classmethod
    def make(cls, *, max_slots: int, max_seq_len: int, page_size: int, prefill_chunk: int,
             max_prefill_tokens: int, max_prefill_rows: int) -> "Buckets":
        max_pages = math.ceil(max_seq_len / page_size)
        lengths = _powers_of_two(16, prefill_chunk) if prefill_chunk >= 16 else (prefill_chunk,)
        max_rows = max(1, min(max_prefill_rows, max_slots, max_prefill_tokens // lengths[0]))
        rows = tuple(sorted({r for r in (1, 4, 16, 64) if r < max_rows} | {max_rows}))
        return cls(decode_rows=_powers_of_two(min(8, max_slots), max_slots),
                   decode_pages=_powers_of_two(min(4, max_pages), max_pages),
                   prefill_rows=rows, prefill_lengths=lengths, max_pages_per_seq=max_pages)

    def prefill_shapes(self, max_prefill_tokens: int) -> list[tuple[int, int]]:
        """(rows, length) pairs that fit the prefill token budget (one row always fits)."""
        return [(r, n) for n in self.prefill_lengths for r in self.prefill_rows
                if r == 1 or r * n <= max_prefill_tokens]


# ----------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------
def sample_tokens(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array,
                  seeds: jax.Array, sample_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row; return (tokens, log-probabilities).

    The reported log-probability is log softmax(logits / temperature) at the sampled token, before top-p /
    top-k truncation (the behaviour log-probability of the OPD ratios); for greedy rows (temperature 0) it is
    the plain log softmax. The random draw of a row depends only on its seed and the position of the token
    it samples, never on the batch it shares: inverse-CDF sampling with one uniform from
    ``fold_in(key(seed), position)``.
    """
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logp = jax.nn.log_softmax(scaled, axis=-1)

    def truncated_probs(logp):
        order = jnp.sort(logp, axis=-1)[:, ::-1]                                   # descending
        vocab = logp.shape[-1]
        kth = jnp.take_along_axis(order, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=1)[:, 0]
        k_threshold = jnp.where(top_k > 0, kth, -jnp.inf)
        sorted_probs = jnp.exp(order)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        n_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
        p_threshold = jnp.take_along_axis(order, (n_keep - 1)[:, None], axis=1)[:, 0]
        threshold = jnp.maximum(k_threshold, jnp.where(top_p < 1.0, p_threshold, -jnp.inf))
        return jnp.where(logp >= threshold[:, None], jnp.exp(logp), 0.0)

    needs_truncation = jnp.any((top_k > 0) | (top_p < 1.0))
    probs = jax.lax.cond(needs_truncation, truncated_probs, jnp.exp, logp)
    cdf = jnp.cumsum(probs, axis=-1)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, sample_positions)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    sampled = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1)
    sampled = jnp.minimum(sampled, logits.shape[-1] - 1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=1)[:, 0]


# ----------------------------------------------------------------------------------------------------------
# Batches passed from the host (numpy, already padded to a bucket)
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SamplingArrays:
    temperature: np.ndarray   # float32 [R]
    top_p: np.ndarray         # float32 [R]
    top_k: np.ndarray         # int32 [R]
    seeds: np.ndarray         # uint32 [R]

    @classmethod
    def empty(cls, rows: int) -> "SamplingArrays":
        return cls(np.ones(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32),
                   np.zeros(rows, np.uint32))


@dataclasses.dataclass
class DecodeBatch:
    tokens: np.ndarray        # int32 [R]: the last token of each sequence
    positions: np.ndarray     # int32 [R]: its position (= tokens already cached)
    page_table: np.ndarray    # int32 [R, P]
    active: np.ndarray        # bool [R]
    sampling: SamplingArrays


@dataclasses.dataclass
class PrefillBatch:
    tokens: np.ndarray        # int32 [R, L]: one chunk per row
    starts: np.ndarray        # int32 [R]: position of the chunk's first token
    lengths: np.ndarray       # int32 [R]: real tokens in the chunk (0 for padding rows)
    page_table: np.ndarray    # int32 [R, max_pages_per_seq]
    sampling: SamplingArrays


# ----------------------------------------------------------------------------------------------------------
# The executor
# ----------------------------------------------------------------------------------------------------------
class Executor:
    """Holds the model state and the KV pages; runs jitted prefill and decode steps."""

    def __init__(self, model: Qwen3, *, num_pages: int, page_size: int, buckets: Buckets,
                 attention_backend: str = "reference"):
        cfg = model.config
        self.config = cfg
        self.page_size = page_size
        self.buckets = buckets
        self.graphdef, self.state = nnx.split(model)
        self._attention = kernels.get_backend(attention_backend)
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = jnp.dtype(cfg.dtype)
        self.kv = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]
        self._decode_fn = jax.jit(self._decode, donate_argnums=(1,))
        self._prefill_fn = jax.jit(self._prefill, donate_argnums=(1,))

    # ------------------------------------------------------------------ traced functions
    def _paged_attend(self, page_table, positions, write_pages, write_offsets):
        def attend(layer_index, q, k, v, layer_cache):
            del layer_index
            k_pages, v_pages = layer_cache
            k_pages = kernels.write_kv_pages(k_pages, k, write_pages, write_offsets)
            v_pages = kernels.write_kv_pages(v_pages, v, write_pages, write_offsets)
            return self._attention(q, k_pages, v_pages, page_table, positions), (k_pages, v_pages)
        return attend

    def _decode(self, state, kv, tokens, positions, page_table, active, temperature, top_p, top_k, seeds):
        model = nnx.merge(self.graphdef, state)
        rows = jnp.arange(tokens.shape[0])
        page_index = jnp.minimum(positions // self.page_size, page_table.shape[1] - 1)
        write_pages = jnp.where(active, page_table[rows, page_index], NULL_PAGE)[:, None]
        write_offsets = jnp.where(active, positions % self.page_size, 0)[:, None]
        attend = self._paged_attend(page_table, positions[:, None], write_pages, write_offsets)
        hidden, kv = model.hidden_states(tokens[:, None], positions[:, None], attend, kv)
        logits = model.logits(hidden[:, 0])
        next_tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, seeds, positions + 1)
        return kv, next_tokens, logprobs

    def _prefill(self, state, kv, tokens, starts, lengths, page_table, temperature, top_p, top_k, seeds):
        model = nnx.merge(self.graphdef, state)
        offsets = jnp.arange(tokens.shape[1])[None, :]
        positions = starts[:, None] + offsets
        valid = offsets < lengths[:, None]
        page_index = jnp.minimum(positions // self.page_size, page_table.shape[1] - 1)
        write_pages = jnp.where(valid, jnp.take_along_axis(page_table, page_index, axis=1), NULL_PAGE)
        write_offsets = jnp.where(valid, positions % self.page_size, 0)
        attend = self._paged_attend(page_table, positions, write_pages, write_offsets)
        hidden, kv = model.hidden_states(tokens, positions, attend, kv)
        last = jnp.maximum(lengths - 1, 0)
        logits = model.logits(hidden[jnp.arange(tokens.shape[0]), last])
        next_tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, seeds, starts + lengths)
        return kv, next_tokens, logprobs

    # ------------------------------------------------------------------ host entry points
    def decode(self, batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray]:
        s = batch.sampling
        self.kv, tokens, logprobs = self._decode_fn(
            self.state, self.kv, batch.tokens, batch.positions, batch.page_table, batch.active,
            s.temperature, s.top_p, s.top_k, s.seeds)
        return np.asarray(tokens), np.asarray(logprobs)

    def prefill(self, batch: PrefillBatch) -> tuple[np.ndarray, np.ndarray]:
        s = batch.sampling
        self.kv, tokens, logprobs = self._prefill_fn(
            self.state, self.kv, batch.tokens, batch.starts, batch.lengths, batch.page_table,
            s.temperature, s.top_p, s.top_k, s.seeds)
        return np.asarray(tokens), np.asarray(logprobs)

    def set_state(self, state: Any) -> None:
        """Swap in new weights (same structure, shapes and dtypes: no recompilation)."""
        self.state = state

    def warmup(self, max_prefill_tokens: int) -> int:
        """Compile every bucket with dummy work that writes only to the null page; returns the count."""
        n = 0
        for rows in self.buckets.decode_rows:
            for pages in self.buckets.decode_pages:
                self.decode(DecodeBatch(np.zeros(rows, np.int32), np.zeros(rows, np.int32),
                                        np.zeros((rows, pages), np.int32), np.zeros(rows, bool),
                                        SamplingArrays.empty(rows)))
                n += 1
        for rows, length in self.buckets.prefill_shapes(max_prefill_tokens):
            self.prefill(PrefillBatch(np.zeros((rows, length), np.int32), np.zeros(rows, np.int32),
                                      np.zeros(rows, np.int32),
                                      np.zeros((rows, self.buckets.max_pages_per_seq), np.int32),
                                      SamplingArrays.empty(rows)))
            n += 1
        jax.block_until_ready(self.kv)
        return n

    def compiled_count(self) -> int:
        """Entries in the jit caches (a test asserts this stops growing after warm-up)."""
        return self._decode_fn._cache_size() + self._prefill_fn._cache_size()
