"""The attention-backend interface: what the sampler's executor asks of a paged-KV kernel.

Owns ``AttentionBackend``, the one object a kernel provides. It owns the KV cache of one layer: its page
layout (``init_layer_cache`` builds it, ``page_size`` reads it back), the write of new keys/values into their
pages (``write``, for prefill chunks and decode tokens alike), the attention of prefill chunks
(``prefill_attention``) and of single decode tokens (``decode_attention``), and a logical view of a row's
cached keys/values (``gather_kv``, for tests and debugging). The executor treats a layer cache as an opaque
pytree, so a kernel may lay its pages out as it likes: the reference uses
``[num_pages, page_size, kv_heads, head_dim]``, JAX's Pallas GPU and TPU decode kernels
``[kv_heads, num_pages, page_size, head_dim]``.

Backends are passed to ``jax.jit`` as static arguments: they must be hashable and compare equal when they
compute the same thing (a frozen dataclass does both), so engines over the same backend share compilations.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

LayerCache = Any
"""One layer's KV pages, in whatever pytree and layout the backend chose (the reference: ``(k_pages, v_pages)``)."""


@runtime_checkable
class AttentionBackend(Protocol):
    """A paged-KV attention kernel and the page layout it reads.

    Coordinates are logical: position ``i`` of row ``b`` lives in page ``page_table[b, i // page_size]`` at
    offset ``i % page_size``; page 0 is the null page that padding writes to and nothing reads unmasked.
    Shapes: ``q`` ``[B, T, num_heads, H]`` (prefill) or ``[B, num_heads, H]`` (decode); new ``k``/``v``
    ``[B, T, kv_heads, H]``; ``page_table`` ``[B, P]``. GQA: query head ``n`` uses kv head ``n // (N // K)``.
    """

    name: str
    layout: str   # the page array's axes, e.g. "pages, page_size, kv_heads, head_dim"
    # decode reads each row's pages in place, up to its length (a Pallas kernel), rather than gathering the whole
    # page window: a decode row padded to the full window then costs nothing (the engine's mixed steps rely on it)
    decode_in_place: bool

    def init_layer_cache(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                         dtype: Any) -> LayerCache:
        """Zeroed pages of one layer (keys and values)."""
        ...

    def page_size(self, layer_cache: LayerCache) -> int:
        """Tokens per page of ``layer_cache`` (a static shape, usable while tracing)."""
        ...

    def write(self, layer_cache: LayerCache, k: jax.Array, v: jax.Array, page_ids: jax.Array,
              offsets: jax.Array) -> LayerCache:
        """Store ``k``/``v`` ``[B, T, kv_heads, H]`` at (``page_ids``, ``offsets``) ``[B, T]``; returns the cache."""
        ...

    def gather_kv(self, layer_cache: LayerCache, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values ``[B, P * page_size, kv_heads, H]`` of each row's pages, in position order."""
        ...

    def prefill_attention(self, q: jax.Array, layer_cache: LayerCache, page_table: jax.Array,
                          q_positions: jax.Array) -> jax.Array:
        """Attention of ``q`` ``[B, T, N, H]``; query ``(b, t)`` sees cached positions ``<= q_positions[b, t]``."""
        ...

    def decode_attention(self, q: jax.Array, layer_cache: LayerCache, page_table: jax.Array,
                         lengths: jax.Array) -> jax.Array:
        """Attention of one query per row ``q`` ``[B, N, H]`` over its first ``lengths[b]`` cached positions
        (the Pallas paged-attention signature); returns ``[B, N, H]``."""
        ...


__all__ = ["AttentionBackend", "LayerCache"]
