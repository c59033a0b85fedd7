"""Dense grouped-query softmax attention over explicit keys and values.

Owns ``grouped_attention``, the one masked GQA softmax of the project: the model's dense causal attention
(training, scoring) calls it directly, and the reference paged backends call it after gathering a row's pages,
so every attention path shares its numerics. Pure jnp; imports nothing of ``jaxopd``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with GQA. ``q`` ``[B,T,N,H]``, ``k``/``v`` ``[B,S,K,H]``, ``mask`` ``[B,T,S]`` (True = attend).

    Scores and softmax in float32; a query row with no visible key returns zeros. Query head ``n`` uses kv
    head ``n // (N // K)``, as transformers' ``repeat_kv``.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * (h ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)


__all__ = ["grouped_attention"]
