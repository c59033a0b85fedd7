"""The reference paged-attention backend: a pure-jnp gather over the page table, then the model's masked GQA softmax.

Also owns writing new keys/values into their pages. Runs on CPU, GPU and TPU; it is the numerical
reference that faster kernels are tested against.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxopd.models.qwen3 import grouped_attention


def write_kv_pages(pages: jax.Array, values: jax.Array, page_ids: jax.Array, offsets: jax.Array) -> jax.Array:
    """Scatter ``values`` ``[B, T, K, H]`` into ``pages`` ``[num_pages, page_size, K, H]`` at
    (``page_ids`` ``[B, T]``, ``offsets`` ``[B, T]``). Padding tokens should target the null page 0."""
    k, h = values.shape[-2:]
    return pages.at[page_ids.reshape(-1), offsets.reshape(-1)].set(
        values.reshape(-1, k, h).astype(pages.dtype), mode="promise_in_bounds")


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                              q_positions: jax.Array) -> jax.Array:
    """Attention of ``q`` ``[B, T, N, H]`` over the first ``P * page_size`` cached positions of each row.

    Position ``i`` of row ``b`` lives in page ``page_table[b, i // page_size]`` at offset ``i % page_size``;
    query ``(b, t)`` sees positions ``<= q_positions[b, t]``. Scores and softmax in float32 (GQA: query head
    ``n`` uses kv head ``n // (N // K)``, as transformers' ``repeat_kv``).
    """
    b, t, n, h = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    window = page_table.shape[1] * page_size
    keys = k_pages[page_table].reshape(b, window, kv_heads, h)
    values = v_pages[page_table].reshape(b, window, kv_heads, h)
    visible = jnp.arange(window)[None, None, :] <= q_positions[:, :, None]          # [B, T, S]
    return grouped_attention(q, keys, values, visible)
