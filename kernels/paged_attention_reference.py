"""The reference paged-attention backends: a pure-jnp gather over the page table, then the dense masked GQA
softmax of ``jaxopd_kernels.dense``.

Owns two page layouts behind the ``AttentionBackend`` interface: ``reference``
(``[num_pages, page_size, kv_heads, head_dim]``, the executor's layout so far) and ``reference-hnd``
(``[kv_heads, num_pages, page_size, head_dim]``, the layout of JAX's Pallas GPU/TPU decode kernels), each
with its KV write and gather. Both run on CPU, GPU and TPU, give identical results, and are the numerical
reference that faster kernels are tested against.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxopd_kernels.dense import grouped_attention


def write_kv_pages(pages: jax.Array, values: jax.Array, page_ids: jax.Array, offsets: jax.Array) -> jax.Array:
    """Scatter ``values`` ``[B, T, K, H]`` into ``pages`` ``[num_pages, page_size, K, H]`` at
    (``page_ids`` ``[B, T]``, ``offsets`` ``[B, T]``). Padding tokens should target the null page 0."""
    k, h = values.shape[-2:]
    return pages.at[page_ids.reshape(-1), offsets.reshape(-1)].set(
        values.reshape(-1, k, h).astype(pages.dtype), mode="promise_in_bounds")


def _attend_gathered(q: jax.Array, keys: jax.Array, values: jax.Array, q_positions: jax.Array) -> jax.Array:
    """``q`` ``[B, T, N, H]`` over gathered ``keys``/``values`` ``[B, S, K, H]``; query ``(b, t)`` sees
    positions ``s <= q_positions[b, t]``."""
    visible = jnp.arange(keys.shape[1])[None, None, :] <= q_positions[:, :, None]          # [B, T, S]
    return grouped_attention(q, keys, values, visible)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                              q_positions: jax.Array) -> jax.Array:
    """Attention of ``q`` ``[B, T, N, H]`` over the first ``P * page_size`` cached positions of each row.

    Pages ``[num_pages, page_size, K, H]``. Position ``i`` of row ``b`` lives in page
    ``page_table[b, i // page_size]`` at offset ``i % page_size``; query ``(b, t)`` sees positions
    ``<= q_positions[b, t]``. Scores and softmax in float32.
    """
    b, _, _, h = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    window = page_table.shape[1] * page_size
    keys = k_pages[page_table].reshape(b, window, kv_heads, h)
    values = v_pages[page_table].reshape(b, window, kv_heads, h)
    return _attend_gathered(q, keys, values, q_positions)


class _GatherThenAttend:
    """Prefill and decode attention of a backend whose ``gather_kv`` gives the logical keys and values."""

    def prefill_attention(self, q, layer_cache, page_table, q_positions):
        keys, values = self.gather_kv(layer_cache, page_table)
        return _attend_gathered(q, keys, values, q_positions)

    def decode_attention(self, q, layer_cache, page_table, lengths):
        return self.prefill_attention(q[:, None], layer_cache, page_table, (lengths - 1)[:, None])[:, 0]


@dataclasses.dataclass(frozen=True)
class ReferenceBackend(_GatherThenAttend):
    """Pages ``[num_pages, page_size, kv_heads, head_dim]`` per layer: a row's tokens are contiguous."""

    name: str = "reference"
    layout: str = "pages, page_size, kv_heads, head_dim"
    decode_in_place: bool = False

    def init_layer_cache(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: Any):
        shape = (num_pages, page_size, kv_heads, head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def page_size(self, layer_cache) -> int:
        return layer_cache[0].shape[1]

    def write(self, layer_cache, k, v, page_ids, offsets):
        k_pages, v_pages = layer_cache
        return write_kv_pages(k_pages, k, page_ids, offsets), write_kv_pages(v_pages, v, page_ids, offsets)

    def gather_kv(self, layer_cache, page_table):
        k_pages, v_pages = layer_cache
        b, p = page_table.shape
        page_size, kv_heads, h = k_pages.shape[1:]
        return (k_pages[page_table].reshape(b, p * page_size, kv_heads, h),
                v_pages[page_table].reshape(b, p * page_size, kv_heads, h))

    def prefill_attention(self, q, layer_cache, page_table, q_positions):
        return paged_attention_reference(q, *layer_cache, page_table, q_positions)


@dataclasses.dataclass(frozen=True)
class HeadsFirstReferenceBackend(_GatherThenAttend):
    """Pages ``[kv_heads, num_pages, page_size, head_dim]`` per layer (the Pallas decode kernels' layout),
    gathered back to the logical ``[B, S, kv_heads, head_dim]`` view; results equal ``reference``'s exactly."""

    name: str = "reference-hnd"
    layout: str = "kv_heads, pages, page_size, head_dim"
    decode_in_place: bool = False

    def init_layer_cache(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: Any):
        shape = (kv_heads, num_pages, page_size, head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def page_size(self, layer_cache) -> int:
        return layer_cache[0].shape[2]

    @staticmethod
    def _write(pages, values, page_ids, offsets):
        k, h = values.shape[-2:]
        heads_first = values.reshape(-1, k, h).swapaxes(0, 1).astype(pages.dtype)        # [K, B*T, H]
        return pages.at[:, page_ids.reshape(-1), offsets.reshape(-1)].set(heads_first, mode="promise_in_bounds")

    def write(self, layer_cache, k, v, page_ids, offsets):
        k_pages, v_pages = layer_cache
        return self._write(k_pages, k, page_ids, offsets), self._write(v_pages, v, page_ids, offsets)

    def gather_kv(self, layer_cache, page_table):
        def gather(pages):
            kv_heads, _, page_size, h = pages.shape
            rows = pages[:, page_table]                                                  # [K, B, P, ps, H]
            return jnp.moveaxis(rows, 0, 3).reshape(page_table.shape[0], -1, kv_heads, h)
        k_pages, v_pages = layer_cache
        return gather(k_pages), gather(v_pages)


__all__ = ["ReferenceBackend", "HeadsFirstReferenceBackend", "write_kv_pages", "paged_attention_reference"]
