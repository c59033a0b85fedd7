"""Pallas paged attention for GPUs (Triton lowering) and the ``pallas-gpu`` backend: one kernel that reads
``[kv_heads, num_pages, page_size, head_dim]`` pages (the ``reference-hnd`` layout, whose cache and KV write
the backend shares) in place, for decode and for prefill chunks.

The kernel works on *rows*: a row is one (query token, query head) of one sequence, with its own limit
(it sees cached positions ``< limit``). Decode is one token per sequence (rows = the G query heads of a kv
head, limit = the row's length); a prefill chunk is T tokens (rows = T·G, limit = position + 1), so the
same kernel serves both and never gathers a window into a dense array. Scores, softmax and accumulation
are float32; the softmax scale is applied to the float32 scores inside the kernel.

Grid ``(batch, kv_heads, row_blocks, k_splits)``. Each program owns ``block_rows`` rows of one kv head
and one contiguous split of the page table; it walks its split ``pages_per_block`` pages at a time
(loading page ids, then those pages of K and V straight from the pool), stopping at the last page any
of its rows can see, with an online softmax. It writes its normalised partial output and its
log-sum-exp; the k-splits are merged outside the kernel (flash-decoding). Runs in Pallas interpret mode
on any backend (``interpret=True``) and compiles with Pallas' Triton lowering on NVIDIA GPUs, where
Triton wants powers of two: ``page_size`` and ``head_dim`` must be, rows per block (padded) and keys per
block are, and both are kept >= 16 for Triton's dot.

Written for this project after reading JAX's ``pallas/ops/gpu/paged_attention.py``; it differs in the
per-row limits (prefill), the in-kernel scale, the float32 partials and the length-0 handling.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxopd_kernels.paged_attention_reference import HeadsFirstReferenceBackend

# A finite "minus infinity": masked scores never turn into inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Triton's dot needs every matrix side >= 16: query rows per block and keys per block are kept >= 16.
MIN_TRITON_DOT = 16
# Shared memory a program's pipelined K/V blocks may take (num_stages * 2 * keys * head_dim * itemsize); an
# H100/H200 SM has 227 KiB, and the compiler needs some of it for itself.
SHARED_MEMORY_BUDGET = 192 * 1024


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


# ----------------------------------------------------------------------------------------------------------
# The layout's KV write (shared with the ``reference-hnd`` backend)
# ----------------------------------------------------------------------------------------------------------
def write_kv_heads_first(pages: jax.Array, values: jax.Array, page_ids: jax.Array,
                         offsets: jax.Array) -> jax.Array:
    """Scatter ``values`` ``[B, T, K, H]`` into ``pages`` ``[K, num_pages, page_size, H]`` at
    (``page_ids`` ``[B, T]``, ``offsets`` ``[B, T]``). Padding tokens should target the null page 0."""
    return HeadsFirstReferenceBackend._write(pages, values, page_ids, offsets)


# ----------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------
def _paged_rows_kernel(limits_ref, page_table_ref, q_ref, k_pages_ref, v_pages_ref, o_ref, lse_ref, *,
                       sm_scale: float, pages_per_block: int, num_pages: int):
    """One (sequence, kv head, row block, k-split) program.

    limits_ref [rows] · page_table_ref [pages_per_split] · q_ref [rows, H] · k/v_pages_ref [P, S, H]
    → o_ref [rows, H] (float32, normalised over this split) · lse_ref [rows] (float32; -inf if empty).
    """
    split = pl.program_id(3)
    rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    pages_per_split = page_table_ref.shape[0]
    block_k = pages_per_block * page_size

    q = q_ref[...]
    limits = limits_ref[...]
    first_page = split * pages_per_split
    # The last page any row of this block can see, clipped to this split.
    end_page = jnp.minimum(first_page + pages_per_split, pl.cdiv(jnp.max(limits), page_size))
    num_blocks = jnp.maximum(pl.cdiv(end_page - first_page, pages_per_block), 0)

    def body(j, carry):
        o_prev, m_prev, l_prev = carry
        ids = page_table_ref[pl.ds(j * pages_per_block, pages_per_block)]
        ids = jnp.minimum(jnp.maximum(ids, 0), num_pages - 1)                 # never read out of the pool
        k = k_pages_ref[ids].reshape(block_k, head_dim)
        v = v_pages_ref[ids].reshape(block_k, head_dim)
        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32) * sm_scale      # [rows, block_k]
        first_position = (first_page + j * pages_per_block) * page_size
        positions = first_position + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        visible = positions < limits[:, None]
        scores = jnp.where(visible, scores, MASK_VALUE)
        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        probs = jnp.where(visible, jnp.exp(scores - m_next[:, None]), 0.0)
        l_next = correction * l_prev + probs.sum(axis=-1)
        o_curr = lax.dot_general(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return correction[:, None] * o_prev + o_curr, m_next, l_next

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = lax.fori_loop(0, num_blocks, body, init)
    seen = l > 0.0
    safe_l = jnp.where(seen, l, 1.0)
    o_ref[...] = o / safe_l[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe_l), -jnp.inf)


def merge_splits(o: jax.Array, lse: jax.Array) -> jax.Array:
    """Merge per-split normalised outputs ``o`` ``[..., splits, rows, H]`` with their log-sum-exps
    ``lse`` ``[..., splits, rows]``: weights ``exp(lse - max lse)``; rows no split saw give zeros."""
    top = lse.max(axis=-2, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(lse - top)                                                   # 0 for empty splits
    total = weights.sum(axis=-2)
    out = (weights[..., None] * o).sum(axis=-3)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def _triton_params(num_warps: int, num_stages: int):
    """Triton compiler params (selects the Triton lowering even where Mosaic GPU is the default); None where
    this JAX no longer ships the Triton backend."""
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:
        return None
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_rows", "pages_per_block", "k_splits",
                                             "num_warps", "num_stages", "interpret"))
def paged_attention_rows(q_rows: jax.Array, limits: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         page_table: jax.Array, *, sm_scale: float, block_rows: int = 16,
                         pages_per_block: int = 8, k_splits: int = 1, num_warps: int = 4,
                         num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """The kernel over rows: ``q_rows`` ``[B, K, R, H]`` (rows of kv head k), ``limits`` ``[B, R]`` (row r
    sees positions ``< limits[b, r]``), pages ``[K, P, S, H]``, ``page_table`` ``[B, pages_per_seq]``.
    Returns ``[B, K, R, H]`` float32. Any ``pages_per_seq`` and ``k_splits`` work: the table is padded with
    page 0 up to ``k_splits`` equal splits of whole compute blocks (a padded entry is at most loaded as part
    of a block and masked, since it lies past every limit)."""
    b, kv_heads, rows, head_dim = q_rows.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    if k_pages.shape != v_pages.shape or k_pages.shape[0] != kv_heads or k_pages.shape[3] != head_dim:
        raise ValueError(f"pages {k_pages.shape}/{v_pages.shape} do not match q rows {q_rows.shape}")
    if not interpret and (_next_pow2(page_size) != page_size or _next_pow2(head_dim) != head_dim):
        raise ValueError(f"the Triton lowering needs a power-of-two page_size and head_dim, got {page_size} "
                         f"and {head_dim}")
    pages_per_seq = page_table.shape[1]
    k_splits = max(1, min(k_splits, pages_per_seq))
    raw_split = math.ceil(pages_per_seq / k_splits)
    # Keys per compute block: a power of two (Triton) and >= 16 keys (Triton dot).
    pages_per_block = min(_next_pow2(pages_per_block), _next_pow2(raw_split))
    if not interpret:
        stage_bytes = max(1, num_stages) * 2 * head_dim * jnp.dtype(k_pages.dtype).itemsize
        max_keys = max(1, SHARED_MEMORY_BUDGET // stage_bytes)
        pages_per_block = min(pages_per_block, max(1, 1 << int(math.log2(max(1, max_keys // page_size)))))
    pages_per_block = max(pages_per_block, _next_pow2(math.ceil(MIN_TRITON_DOT / page_size)))
    pages_per_split = math.ceil(raw_split / pages_per_block) * pages_per_block
    padded_pages = pages_per_split * k_splits
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)))
    table = table.reshape(b, k_splits, pages_per_split)

    block_rows = max(MIN_TRITON_DOT, _next_pow2(block_rows))
    padded_rows = math.ceil(rows / block_rows) * block_rows
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    limits = jnp.pad(limits.astype(jnp.int32), ((0, 0), (0, padded_rows - rows)))    # padded rows see nothing
    row_blocks = padded_rows // block_rows

    kernel = functools.partial(_paged_rows_kernel, sm_scale=float(sm_scale), pages_per_block=pages_per_block,
                               num_pages=num_pages)
    pages_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda bi, h, i, s: (h, 0, 0, 0))
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kv_heads, row_blocks, k_splits),
        in_specs=[
            pl.BlockSpec((None, block_rows), lambda bi, h, i, s: (bi, i)),                       # limits
            pl.BlockSpec((None, None, pages_per_split), lambda bi, h, i, s: (bi, s, 0)),         # page table
            pl.BlockSpec((None, None, block_rows, head_dim), lambda bi, h, i, s: (bi, h, i, 0)),  # q rows
            pages_spec,                                                                           # k pages
            pages_spec,                                                                           # v pages
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_rows, head_dim), lambda bi, h, i, s: (bi, h, s, i, 0)),
            pl.BlockSpec((None, None, None, block_rows), lambda bi, h, i, s: (bi, h, s, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kv_heads, k_splits, padded_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((b, kv_heads, k_splits, padded_rows), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else _triton_params(num_warps, num_stages),
        name=f"paged_attention_rows_{block_rows}x{pages_per_block * page_size}",
    )(limits, table, q_rows, k_pages, v_pages)
    if k_splits == 1:
        out = o[:, :, 0]
    else:
        out = merge_splits(o, lse)
    return out[:, :, :rows]


# ----------------------------------------------------------------------------------------------------------
# Decode and prefill entry points
# ----------------------------------------------------------------------------------------------------------
def _rows_of(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[B, T, N, H]`` → ``[B, K, T*G, H]`` (row ``t*G + g`` is token t, query head ``k*G + g``)."""
    b, t, n, h = q.shape
    g = n // kv_heads
    return q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, h)


def _unrows(out: jax.Array, t: int) -> jax.Array:
    """Inverse of ``_rows_of``."""
    b, kv_heads, rows, h = out.shape
    g = rows // t
    return out.reshape(b, kv_heads, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, kv_heads * g, h)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                           page_table: jax.Array, *, k_splits: int = 1, pages_per_block: int = 8,
                           sm_scale: float | None = None, num_warps: int = 4, num_stages: int = 2,
                           interpret: bool = False) -> jax.Array:
    """One query token per sequence. ``q`` ``[B, N, H]``, pages ``[K, P, S, H]``, ``lengths`` ``[B]``
    (cached positions ``0 .. lengths-1`` are visible; 0 gives zeros), ``page_table`` ``[B, pages_per_seq]``.
    GQA: query head ``n`` uses kv head ``n // (N // K)``. Scale defaults to ``1/sqrt(H)``. → ``[B, N, H]``."""
    b, n, h = q.shape
    kv_heads = k_pages.shape[0]
    if n % kv_heads:
        raise ValueError(f"{n} query heads are not a multiple of {kv_heads} kv heads")
    g = n // kv_heads
    rows = _rows_of(q[:, None], kv_heads)                                           # [B, K, G, H]
    limits = jnp.broadcast_to(lengths.astype(jnp.int32)[:, None], (b, g))
    out = paged_attention_rows(rows, limits, k_pages, v_pages, page_table,
                               sm_scale=h ** -0.5 if sm_scale is None else float(sm_scale),
                               block_rows=_next_pow2(g), pages_per_block=pages_per_block, k_splits=k_splits,
                               num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return _unrows(out, 1)[:, 0].astype(q.dtype)


def paged_prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                            q_positions: jax.Array, *, k_splits: int = 1, block_rows: int = 64,
                            pages_per_block: int = 8, sm_scale: float | None = None, num_warps: int = 4,
                            num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """A chunk of T query tokens per sequence (prefill, or decode with T = 1), in place over the pages.
    ``q`` ``[B, T, N, H]``; query ``(b, t)`` sees cached positions ``<= q_positions[b, t]``. → ``[B, T, N, H]``."""
    b, t, n, h = q.shape
    kv_heads = k_pages.shape[0]
    if n % kv_heads:
        raise ValueError(f"{n} query heads are not a multiple of {kv_heads} kv heads")
    g = n // kv_heads
    rows = _rows_of(q, kv_heads)
    limits = jnp.repeat(q_positions.astype(jnp.int32) + 1, g, axis=1)              # [B, T*G]
    block_rows = min(_next_pow2(block_rows), max(MIN_TRITON_DOT, _next_pow2(t * g)))
    out = paged_attention_rows(rows, limits, k_pages, v_pages, page_table,
                               sm_scale=h ** -0.5 if sm_scale is None else float(sm_scale),
                               block_rows=block_rows, pages_per_block=pages_per_block, k_splits=k_splits,
                               num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return _unrows(out, t).astype(q.dtype)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                    q_positions: jax.Array, *, interpret: bool = False, **kernel_options) -> jax.Array:
    """``q`` ``[B, T, N, H]``, query ``(b, t)`` sees cached positions ``<= q_positions[b, t]`` (the old
    functional backend signature): T = 1 runs the decode entry (rows = query heads), longer chunks the prefill
    entry."""
    if q.shape[1] == 1:
        out = paged_decode_attention(q[:, 0], k_pages, v_pages, q_positions[:, 0] + 1, page_table,
                                     interpret=interpret, **kernel_options)
        return out[:, None]
    return paged_prefill_attention(q, k_pages, v_pages, page_table, q_positions, interpret=interpret,
                                   **kernel_options)


# ----------------------------------------------------------------------------------------------------------
# The backend object
# ----------------------------------------------------------------------------------------------------------
def auto_k_splits(batch: int, kv_heads: int, pages_per_seq: int, pages_per_block: int,
                  target_programs: int = 264) -> int:
    """Flash-decoding splits for a decode batch: double them until ``batch * kv_heads * splits`` programs
    reach ``target_programs`` (2 per SM of an H100/H200) or a split would hold less than one compute block."""
    splits = 1
    while batch * kv_heads * splits < target_programs and 2 * splits * pages_per_block <= pages_per_seq:
        splits *= 2
    return splits


@dataclasses.dataclass(frozen=True)
class PallasGpuBackend(HeadsFirstReferenceBackend):
    """``pallas-gpu``: pages ``[kv_heads, num_pages, page_size, head_dim]`` (cache, write and ``gather_kv`` as
    ``reference-hnd``), decode and prefill on the in-place Pallas kernel above. ``k_splits=None`` picks
    splits per decode batch (``auto_k_splits``); ``interpret=None`` interprets unless JAX runs on a GPU."""

    name: str = "pallas-gpu"
    layout: str = "kv_heads, pages, page_size, head_dim"
    decode_in_place: bool = True
    k_splits: int | None = None
    pages_per_block: int = 8
    prefill_block_rows: int = 64
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool | None = None

    def _interpret(self) -> bool:
        return jax.default_backend() != "gpu" if self.interpret is None else self.interpret

    def _options(self) -> dict:
        return dict(pages_per_block=self.pages_per_block, num_warps=self.num_warps, num_stages=self.num_stages,
                    interpret=self._interpret())

    def decode_attention(self, q, layer_cache, page_table, lengths):
        k_pages, v_pages = layer_cache
        splits = self.k_splits or auto_k_splits(q.shape[0], k_pages.shape[0], page_table.shape[1],
                                                self.pages_per_block)
        return paged_decode_attention(q, k_pages, v_pages, lengths, page_table, k_splits=splits, **self._options())

    def prefill_attention(self, q, layer_cache, page_table, q_positions):
        k_pages, v_pages = layer_cache
        return paged_prefill_attention(q, k_pages, v_pages, page_table, q_positions,
                                       k_splits=self.k_splits or 1, block_rows=self.prefill_block_rows,
                                       **self._options())


__all__ = ["MASK_VALUE", "write_kv_heads_first", "paged_attention_rows", "merge_splits", "paged_decode_attention",
           "paged_prefill_attention", "paged_attention", "auto_k_splits", "PallasGpuBackend"]
