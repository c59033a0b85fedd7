"""JAX's Pallas TPU paged-attention kernels behind this project's conventions, and the ``pallas-tpu`` and
``pallas-tpu-ragged`` backends: the decode kernel over the ``[kv_heads, num_pages, page_size, head_dim]``
layout, and the ragged kernel (mixed prefill + decode) over the combined
``[num_pages, page_size, 2 * kv_heads, head_dim]`` layout, which this module owns with its KV write.

What the wrappers fix up. Decode (``jax.experimental.pallas.ops.tpu.paged_attention``): the kernel
applies no softmax scale, so q is scaled by ``1/sqrt(head_dim)`` here, in float32 and passed as float32
(the kernel computes in float32 anyway); the kernel rounds K and V to bfloat16 as it loads them, so pages
should be stored in bfloat16 (a float32 cache gets only bfloat16 accuracy, for twice the HBM traffic);
``pages_per_seq`` is padded with page 0 to a multiple of ``pages_per_compute_block``; rows of length 0
give zeros. Ragged (``...ops.tpu.ragged_paged_attention``, where this JAX has it): the
scale is its ``sm_scale`` argument; a padded ``[B, T]`` batch whose positions run contiguously per row
(prefill chunks, and decode with T = 1) maps to it with ``kv_len = last position + 1`` and ``q_len = T``.

Both compile only on TPU. On CPU the decode kernel runs in TPU interpret mode (``interpret=True`` wraps
the call in ``pltpu.force_tpu_interpret_mode``); the ragged kernel does not (JAX 0.10's TPU interpreter
cannot follow its ref reshapes), so its wrapper takes ``kernel=`` and the tests pass JAX's own
``ref_ragged_paged_attention`` there. Prefill in the heads-first layout falls back to the gather attention
of ``reference-hnd``; decode is the hot path.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxopd_kernels.paged_attention_reference import HeadsFirstReferenceBackend
from jaxopd_kernels.pallas_gpu import write_kv_heads_first


def _tpu_interpret_context(interpret: bool):
    """The TPU interpreter's context when asked for, else nothing."""
    if not interpret:
        return contextlib.nullcontext()
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.force_tpu_interpret_mode()


def _decode_kernel() -> Callable:
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    return paged_attention


def ragged_kernel_available() -> bool:
    """Whether this JAX ships the ragged (mixed prefill + decode) TPU kernel."""
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _ragged_kernel() -> Callable:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    return ragged_paged_attention


# ----------------------------------------------------------------------------------------------------------
# Decode over the heads-first layout
# ----------------------------------------------------------------------------------------------------------
def default_pages_per_compute_block(page_size: int, pages_per_seq: int) -> int:
    """Pages per kernel block: about 128 keys (one MXU pass), never more pages than a sequence has."""
    return max(1, min(pages_per_seq, max(1, 128 // page_size)))


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                           page_table: jax.Array, *, pages_per_compute_block: int | None = None,
                           sm_scale: float | None = None, megacore_mode: str | None = None,
                           inline_seq_dim: bool = True, interpret: bool = False,
                           kernel: Callable | None = None) -> jax.Array:
    """One query token per sequence on JAX's TPU paged-attention kernel.

    ``q`` ``[B, N, H]``, pages ``[K, P, S, H]`` (bfloat16 preferred), ``lengths`` ``[B]`` (positions
    ``0 .. lengths-1`` visible; 0 gives zeros), ``page_table`` ``[B, pages_per_seq]``. → ``[B, N, H]`` in
    q's dtype. ``kernel`` replaces JAX's kernel (same signature), for tests of this wrapper.
    """
    b, n, h = q.shape
    page_size = k_pages.shape[2]
    pages_per_seq = page_table.shape[1]
    scale = h ** -0.5 if sm_scale is None else float(sm_scale)
    block = pages_per_compute_block or default_pages_per_compute_block(page_size, pages_per_seq)
    padded = math.ceil(pages_per_seq / block) * block
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, padded - pages_per_seq)))
    lengths = lengths.astype(jnp.int32)
    q_scaled = q.astype(jnp.float32) * scale                     # the kernel applies no scale
    call = kernel or _decode_kernel()
    with _tpu_interpret_context(interpret):
        out = call(q_scaled, k_pages, v_pages, lengths, table, pages_per_compute_block=block,
                   megacore_mode=megacore_mode, inline_seq_dim=inline_seq_dim)
    out = jnp.where((lengths > 0)[:, None, None], out, 0.0)
    return out.astype(q.dtype)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                    q_positions: jax.Array, *, interpret: bool = False, **kernel_options) -> jax.Array:
    """The project's backend signature in the heads-first layout: T = 1 runs the TPU decode kernel, longer
    chunks (prefill) the gather fallback."""
    if q.shape[1] == 1:
        out = paged_decode_attention(q[:, 0], k_pages, v_pages, q_positions[:, 0] + 1, page_table,
                                     interpret=interpret, **kernel_options)
        return out[:, None]
    return HeadsFirstReferenceBackend().prefill_attention(q, (k_pages, v_pages), page_table, q_positions)


# ----------------------------------------------------------------------------------------------------------
# Ragged (mixed prefill + decode) over the combined layout
# ----------------------------------------------------------------------------------------------------------
def init_pages_combined(num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                        dtype=jnp.bfloat16) -> jax.Array:
    """An empty pool for the ragged kernel: ``[num_pages, page_size, 2 * kv_heads, head_dim]``, key head k
    at ``2k`` and value head k at ``2k + 1``."""
    return jnp.zeros((num_pages, page_size, 2 * kv_heads, head_dim), dtype)


def write_kv_combined(kv_pages: jax.Array, keys: jax.Array, values: jax.Array, page_ids: jax.Array,
                      offsets: jax.Array) -> jax.Array:
    """Scatter ``keys``/``values`` ``[B, T, K, H]`` into combined pages at (``page_ids``, ``offsets``)
    ``[B, T]``. Padding tokens should target the null page 0."""
    k, h = keys.shape[-2:]
    interleaved = jnp.stack([keys, values], axis=-2).reshape(-1, 2 * k, h)          # k0 v0 k1 v1 ...
    return kv_pages.at[page_ids.reshape(-1), offsets.reshape(-1)].set(
        interleaved.astype(kv_pages.dtype), mode="promise_in_bounds")


def split_combined(kv_pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Combined pages → heads-first ``(k_pages, v_pages)`` ``[K, P, S, H]`` (for tests and conversion)."""
    return (jnp.transpose(kv_pages[:, :, 0::2], (2, 0, 1, 3)), jnp.transpose(kv_pages[:, :, 1::2], (2, 0, 1, 3)))


def ragged_attention_tokens(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_table: jax.Array,
                            cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float | None = None,
                            interpret: bool = False, kernel: Callable | None = None,
                            **kernel_options) -> jax.Array:
    """JAX's ragged kernel as it is: ``q`` ``[tokens, N, H]`` concatenated per sequence (``cu_q_lens``),
    sequence i's queries are the last ``q_len`` of its ``kv_lens[i]`` cached positions. Scale defaults to
    ``1/sqrt(H)``; q is cast to the pages' dtype."""
    h = q.shape[-1]
    scale = h ** -0.5 if sm_scale is None else float(sm_scale)
    call = kernel or _ragged_kernel()
    with _tpu_interpret_context(interpret):
        out = call(q.astype(kv_pages.dtype), kv_pages, kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
                   cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32), sm_scale=scale, **kernel_options)
    return out.astype(q.dtype)


def ragged_attention(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, q_positions: jax.Array, *,
                     sm_scale: float | None = None, interpret: bool = False, kernel: Callable | None = None,
                     **kernel_options) -> jax.Array:
    """The project's signature on the ragged kernel: ``q`` ``[B, T, N, H]``, ``q_positions`` ``[B, T]`` with
    ``q_positions[b, t] = q_positions[b, 0] + t`` (prefill chunks, padding included; decode is T = 1).
    Query ``(b, t)`` sees cached positions ``<= q_positions[b, t]``. → ``[B, T, N, H]``."""
    b, t, n, h = q.shape
    kv_lens = q_positions[:, -1].astype(jnp.int32) + 1
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32) * t
    out = ragged_attention_tokens(q.reshape(b * t, n, h), kv_pages, kv_lens, page_table, cu_q_lens,
                                  jnp.array([b], jnp.int32), sm_scale=sm_scale, interpret=interpret,
                                  kernel=kernel, **kernel_options)
    return out.reshape(b, t, n, h)


# ----------------------------------------------------------------------------------------------------------
# The backend objects
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PallasTpuBackend(HeadsFirstReferenceBackend):
    """``pallas-tpu``: pages ``[kv_heads, num_pages, page_size, head_dim]`` (cache, write, ``gather_kv`` and the
    prefill gather fallback as ``reference-hnd``), decode on JAX's TPU paged-attention kernel. Store the cache
    in bfloat16 (the kernel rounds K/V to it). ``interpret=None`` uses the TPU interpreter unless on a TPU."""

    name: str = "pallas-tpu"
    layout: str = "kv_heads, pages, page_size, head_dim"
    decode_in_place: bool = True
    pages_per_compute_block: int | None = None
    megacore_mode: str | None = None
    interpret: bool | None = None
    kernel: Callable | None = None       # a stand-in for JAX's kernel (tests)

    def _interpret(self) -> bool:
        return jax.default_backend() != "tpu" if self.interpret is None else self.interpret

    def decode_attention(self, q, layer_cache, page_table, lengths):
        k_pages, v_pages = layer_cache
        return paged_decode_attention(q, k_pages, v_pages, lengths, page_table,
                                      pages_per_compute_block=self.pages_per_compute_block,
                                      megacore_mode=self.megacore_mode, interpret=self._interpret(),
                                      kernel=self.kernel)


@dataclasses.dataclass(frozen=True)
class PallasTpuRaggedBackend:
    """``pallas-tpu-ragged``: one combined pool per layer ``[num_pages, page_size, 2 * kv_heads, head_dim]``
    (K and V heads interleaved), prefill and decode both on JAX's ragged TPU kernel. The kernel runs on TPU
    only (not in JAX 0.10's TPU interpreter); ``kernel`` replaces it (tests pass JAX's
    ``ref_ragged_paged_attention``)."""

    name: str = "pallas-tpu-ragged"
    layout: str = "pages, page_size, 2 * kv_heads (k, v interleaved), head_dim"
    decode_in_place: bool = True
    num_kv_pages_per_block: int | None = None
    num_queries_per_block: int | None = None
    interpret: bool = False
    kernel: Callable | None = None

    def init_layer_cache(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: Any):
        return init_pages_combined(num_pages, page_size, kv_heads, head_dim, dtype)

    def page_size(self, layer_cache) -> int:
        return layer_cache.shape[1]

    def write(self, layer_cache, k, v, page_ids, offsets):
        return write_kv_combined(layer_cache, k, v, page_ids, offsets)

    def gather_kv(self, layer_cache, page_table):
        k_pages, v_pages = split_combined(layer_cache)
        return HeadsFirstReferenceBackend().gather_kv((k_pages, v_pages), page_table)

    def _options(self) -> dict:
        options = dict(interpret=self.interpret, kernel=self.kernel)
        if self.num_kv_pages_per_block is not None and self.num_queries_per_block is not None:
            options.update(num_kv_pages_per_block=self.num_kv_pages_per_block,
                           num_queries_per_block=self.num_queries_per_block)
        return options

    def prefill_attention(self, q, layer_cache, page_table, q_positions):
        return ragged_attention(q, layer_cache, page_table, q_positions, **self._options())

    def decode_attention(self, q, layer_cache, page_table, lengths):
        lengths = lengths.astype(jnp.int32)
        out = ragged_attention(q[:, None], layer_cache, page_table, (jnp.maximum(lengths, 1) - 1)[:, None],
                               **self._options())[:, 0]
        return jnp.where((lengths > 0)[:, None, None], out, jnp.zeros_like(out))


__all__ = ["write_kv_heads_first", "paged_decode_attention", "paged_attention", "default_pages_per_compute_block",
           "ragged_kernel_available", "init_pages_combined", "write_kv_combined", "split_combined",
           "ragged_attention_tokens", "ragged_attention", "PallasTpuBackend", "PallasTpuRaggedBackend"]
