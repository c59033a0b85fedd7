"""The sampler's device side: the paged KV cache and the jitted prefill / decode / sampling functions.

Owns the page pools (one ``[num_pages, page_size, kv_heads, head_dim]`` pair per layer, donated through
every call so updates are in place) and the shape buckets. Every call is a pure function of padded
arrays; which buckets exist is fixed at construction, so nothing compiles after ``warmup``.
"""
from __future__ import annotations

import dataclasses
import functools
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
def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection with full avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def counter_uniform(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """A uniform in [0, 1) per (seed, position): a stateless counter-based hash (Philox-style use, murmur
    mixing). Cheap to compile and run, and independent of batch composition, unlike a split key stream."""
    seeds = seeds.astype(jnp.uint32)
    positions = positions.astype(jnp.uint32)
    mixed = _fmix32(_fmix32(seeds * jnp.uint32(0x9E3779B9) + jnp.uint32(0x7F4A7C15)) ^ (positions + jnp.uint32(1)))
    mixed = _fmix32(mixed + seeds)
    return (mixed >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def _block_size(vocab: int) -> int:
    """Block width for two-level scans: a divisor of the vocabulary near its square root when one exists
    (151,936 = 128 × 1,187), so blocking is a free reshape; otherwise 512 with padding."""
    if vocab <= 2048:
        return vocab
    divisors = [d for d in range(256, 2049) if vocab % d == 0]
    return min(divisors, key=lambda d: abs(d * d - vocab)) if divisors else 512


def _blocked(x: jax.Array, fill: float) -> jax.Array:
    """``[R, V]`` → ``[R, num_blocks, block]`` (a reshape; padded with ``fill`` only if no divisor fits)."""
    rows, vocab = x.shape
    block = _block_size(vocab)
    nb = -(-vocab // block)
    if nb * block != vocab:
        x = jnp.pad(x, ((0, 0), (0, nb * block - vocab)), constant_values=fill)
    return x.reshape(rows, nb, block)


def _last_positive(x: jax.Array) -> jax.Array:
    """Index of the last entry > 0 along the last axis (0 if none)."""
    n = x.shape[-1]
    return n - 1 - jnp.argmax(x[..., ::-1] > 0, axis=-1)


def blocked_argmax(x: jax.Array) -> jax.Array:
    """``argmax`` over the last axis (first maximum), via block maxima: XLA's CPU argmax over a 151,936-wide
    row is an order of magnitude slower than a max-reduction."""
    xb = _blocked(x, -jnp.inf)
    block = jnp.argmax(jnp.max(xb, axis=-1), axis=-1)
    inner = jnp.take_along_axis(xb, block[:, None, None], axis=1)[:, 0]
    return block * xb.shape[-1] + jnp.argmax(inner, axis=-1)


def inverse_cdf_sample(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Token ``i`` with ``cdf[i-1] <= u·total < cdf[i]`` for unnormalised ``probs`` ``[R, V]``, ``u`` in [0, 1).

    Two levels (block sums, then one block) instead of a cumulative sum over the whole vocabulary: faster and
    more accurate in float32. Zero-probability tokens are never returned.
    """
    pb = _blocked(probs, 0.0)
    block_sums = jnp.sum(pb, axis=-1)
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    target = u * block_cdf[:, -1]
    block = jnp.sum(block_cdf <= target[:, None], axis=-1)
    block = jnp.minimum(block, _last_positive(block_sums))
    before = jnp.take_along_axis(block_cdf - block_sums, block[:, None], axis=1)[:, 0]
    inner = jnp.take_along_axis(pb, block[:, None, None], axis=1)[:, 0]
    index = jnp.sum(jnp.cumsum(inner, axis=-1) <= (target - before)[:, None], axis=-1)
    index = jnp.minimum(index, _last_positive(inner))
    return block * pb.shape[-1] + index


def _bisect_threshold(logp: jax.Array, enough, iterations: int = 32) -> jax.Array:
    """Largest ``t`` (per row) with ``enough(logp >= t)`` true, by bisection in log-probability space:
    ``iterations`` masked reductions instead of a sort of the vocabulary."""
    lo = jnp.min(jnp.where(jnp.isfinite(logp), logp, 0.0), axis=-1) - 1.0     # enough(all) holds
    hi = jnp.max(logp, axis=-1)                                                # the mode always qualifies

    def body(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        ok = enough(logp >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jax.lax.fori_loop(0, iterations, body, (lo, hi))
    return jnp.where(enough(logp >= hi[:, None]), hi, lo)


def truncate_top_k_top_p(logp: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Unnormalised probabilities kept by top-k (``k > 0``) and top-p (``p < 1``): the smallest set of most
    likely tokens holding at least ``top_p`` of the mass, intersected with the ``k`` most likely."""
    probs = jnp.exp(logp)
    k_threshold = _bisect_threshold(logp, lambda keep: jnp.sum(keep, axis=-1) >= top_k)
    p_threshold = _bisect_threshold(logp, lambda keep: jnp.sum(jnp.where(keep, probs, 0.0), axis=-1) >= top_p)
    threshold = jnp.maximum(jnp.where(top_k > 0, k_threshold, -jnp.inf),
                            jnp.where(top_p < 1.0, p_threshold, -jnp.inf))
    return jnp.where(logp >= threshold[:, None], probs, 0.0)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array,
                  seeds: jax.Array, sample_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row; return (tokens, log-probabilities).

    The reported log-probability is log softmax(logits / temperature) at the sampled token, before top-p /
    top-k truncation (the behaviour log-probability of the OPD ratios); for greedy rows (temperature 0) it is
    the plain log softmax. The random draw of a row depends only on its seed and the position of the token
    it samples, never on the batch it shares: inverse-CDF sampling with one counter-based uniform
    ``counter_uniform(seed, position)``.
    """
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logp = jax.nn.log_softmax(scaled, axis=-1)
    needs_truncation = jnp.any((top_k > 0) | (top_p < 1.0))
    probs = jax.lax.cond(needs_truncation, lambda lp: truncate_top_k_top_p(lp, top_k, top_p), jnp.exp, logp)
    sampled = inverse_cdf_sample(probs, counter_uniform(seeds, sample_positions))
    argmax = jax.lax.cond(jnp.any(greedy), blocked_argmax, lambda x: jnp.zeros(x.shape[0], jnp.int32), logits)
    tokens = jnp.where(greedy, argmax, sampled).astype(jnp.int32)
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
# Jitted steps: module-level, so engines over the same model graph and page geometry share compilations
# ----------------------------------------------------------------------------------------------------------
def _paged_attend(attention, page_table, positions, write_pages, write_offsets):
    def attend(layer_index, q, k, v, layer_cache):
        del layer_index
        k_pages, v_pages = layer_cache
        k_pages = kernels.write_kv_pages(k_pages, k, write_pages, write_offsets)
        v_pages = kernels.write_kv_pages(v_pages, v, write_pages, write_offsets)
        return attention(q, k_pages, v_pages, page_table, positions), (k_pages, v_pages)
    return attend


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def decode_step(graphdef, backend: str, state, kv, head_dv, tokens, positions, page_table, active,
                temperature, top_p, top_k, seeds):
    """One token for every row: write its KV at ``positions``, attend over the row's pages, sample."""
    model = nnx.merge(graphdef, state)
    page_size = kv[0][0].shape[1]
    rows = jnp.arange(tokens.shape[0])
    page_index = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
    write_pages = jnp.where(active, page_table[rows, page_index], NULL_PAGE)[:, None]
    write_offsets = jnp.where(active, positions % page_size, 0)[:, None]
    attend = _paged_attend(kernels.get_backend(backend), page_table, positions[:, None], write_pages, write_offsets)
    hidden, kv = model.hidden_states(tokens[:, None], positions[:, None], attend, kv)
    logits = model.logits(hidden[:, 0], head_dv)
    next_tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, seeds, positions + 1)
    return kv, next_tokens, logprobs


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def prefill_step(graphdef, backend: str, state, kv, head_dv, tokens, starts, lengths, page_table,
                 temperature, top_p, top_k, seeds):
    """One prompt chunk per row: write its KV, attend causally over everything cached, sample after the
    chunk's last real token (used only when the chunk completes the prompt)."""
    model = nnx.merge(graphdef, state)
    page_size = kv[0][0].shape[1]
    offsets = jnp.arange(tokens.shape[1])[None, :]
    positions = starts[:, None] + offsets
    valid = offsets < lengths[:, None]
    page_index = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
    write_pages = jnp.where(valid, jnp.take_along_axis(page_table, page_index, axis=1), NULL_PAGE)
    write_offsets = jnp.where(valid, positions % page_size, 0)
    attend = _paged_attend(kernels.get_backend(backend), page_table, positions, write_pages, write_offsets)
    hidden, kv = model.hidden_states(tokens, positions, attend, kv)
    last = jnp.maximum(lengths - 1, 0)
    logits = model.logits(hidden[jnp.arange(tokens.shape[0]), last], head_dv)
    next_tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, seeds, starts + lengths)
    return kv, next_tokens, logprobs


@jax.jit
def _transposed_embedding(state):
    return jnp.transpose(state["embedding_vd"][...])


def compiled_count() -> int:
    """Entries in the step functions' jit caches (a test asserts this stops growing after warm-up)."""
    return decode_step._cache_size() + prefill_step._cache_size()


# ----------------------------------------------------------------------------------------------------------
# The executor
# ----------------------------------------------------------------------------------------------------------
class Executor:
    """Holds the model state and the KV pages; runs the jitted prefill and decode steps on host batches."""

    def __init__(self, model: Qwen3, *, num_pages: int, page_size: int, buckets: Buckets,
                 attention_backend: str = "reference"):
        cfg = model.config
        self.config = cfg
        self.page_size = page_size
        self.buckets = buckets
        self.backend = attention_backend
        kernels.get_backend(attention_backend)   # fail early on an unknown name
        self.graphdef, self.state = nnx.split(model)
        self.head_dv = None
        self._materialize_head = cfg.tie_word_embeddings and jax.default_backend() == "cpu"
        self.set_state(self.state)
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = jnp.dtype(cfg.dtype)
        self.kv = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]

    def decode(self, batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray]:
        s = batch.sampling
        self.kv, tokens, logprobs = decode_step(
            self.graphdef, self.backend, self.state, self.kv, self.head_dv, batch.tokens, batch.positions,
            batch.page_table, batch.active, s.temperature, s.top_p, s.top_k, s.seeds)
        return np.asarray(tokens), np.asarray(logprobs)

    def prefill(self, batch: PrefillBatch) -> tuple[np.ndarray, np.ndarray]:
        s = batch.sampling
        self.kv, tokens, logprobs = prefill_step(
            self.graphdef, self.backend, self.state, self.kv, self.head_dv, batch.tokens, batch.starts,
            batch.lengths, batch.page_table, s.temperature, s.top_p, s.top_k, s.seeds)
        return np.asarray(tokens), np.asarray(logprobs)

    def set_state(self, state: Any) -> None:
        """Swap in new weights (same structure, shapes and dtypes: no recompilation). On CPU a tied model
        also keeps a ``[D, V]`` copy of its embedding for the logits matmul."""
        self.state = state
        if self._materialize_head:
            self.head_dv = _transposed_embedding(state)

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
