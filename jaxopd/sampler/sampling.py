"""Token sampling on the device: the counter RNG, the two-level vocabulary scans and ``sample_tokens``.

Owns how one token per row is drawn from float32 logits (temperature, top-k, top-p, greedy), the reported
behaviour log-probability (``jaxopd.models.logprobs.tempered_log_softmax`` at the sampled token, before
truncation), the stateless counter-based uniform that makes a row's draw independent of its batch, and the
host-side per-row sampling arrays the executor passes in. Pure functions of arrays, jit-friendly.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxopd.models.logprobs import tempered_log_softmax


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

    The reported log-probability is ``tempered_log_softmax(logits, temperature)`` at the sampled token, before
    top-p / top-k truncation (the behaviour log-probability of the OPD ratios); for greedy rows (temperature 0)
    it is the plain log softmax. The random draw of a row depends only on its seed and the position of the token
    it samples, never on the batch it shares: inverse-CDF sampling with one counter-based uniform
    ``counter_uniform(seed, position)``.
    """
    greedy = temperature <= 0.0
    logp = tempered_log_softmax(logits, temperature)
    needs_truncation = jnp.any((top_k > 0) | (top_p < 1.0))
    probs = jax.lax.cond(needs_truncation, lambda lp: truncate_top_k_top_p(lp, top_k, top_p), jnp.exp, logp)
    sampled = inverse_cdf_sample(probs, counter_uniform(seeds, sample_positions))
    argmax = jax.lax.cond(jnp.any(greedy), blocked_argmax, lambda x: jnp.zeros(x.shape[0], jnp.int32), logits)
    tokens = jnp.where(greedy, argmax, sampled).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=1)[:, 0]


@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling parameters of one padded batch, on the host (padding rows: temperature 1, no truncation)."""

    temperature: np.ndarray   # float32 [R]
    top_p: np.ndarray         # float32 [R]
    top_k: np.ndarray         # int32 [R]
    seeds: np.ndarray         # uint32 [R]

    @classmethod
    def empty(cls, rows: int) -> "SamplingArrays":
        return cls(np.ones(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32),
                   np.zeros(rows, np.uint32))


__all__ = ["counter_uniform", "blocked_argmax", "inverse_cdf_sample", "truncate_top_k_top_p", "sample_tokens",
           "SamplingArrays"]
