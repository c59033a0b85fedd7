"""The Pallas paged-attention kernels (kernels/pallas_gpu.py, kernels/pallas_tpu.py) against a dense
attention computed here in float64 over each row's own key/value sequence.

Pages are filled from those sequences in numpy through a shuffled page table, so the oracle shares no code
with the page machinery. On CPU the kernels run in Pallas interpret mode (the GPU kernel in the generic
interpreter, JAX's TPU decode kernel in the TPU interpreter); on a GPU the same GPU-kernel tests compile
for real (``interpret=False``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopd_kernels import registry as kernels
from jaxopd_kernels import pallas_gpu, pallas_tpu
from jaxopd_kernels.pallas_gpu import write_kv_heads_first

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

BACKEND = jax.default_backend()
INTERPRET = BACKEND != "gpu"          # compile the GPU kernel for real on a GPU; interpret elsewhere
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
HEAD_DIM = 128
KV_HEADS = 8
PAGE_SIZE = 16


# ----------------------------------------------------------------------------------------------------------
# The oracle and the data
# ----------------------------------------------------------------------------------------------------------
def dense_attention(q, keys, values, limits):
    """``q`` [B, T, N, H], ``keys``/``values`` [B, W, K, H], ``limits`` [B, T] (query (b, t) sees key
    positions < limits[b, t]); float64 softmax with scale 1/sqrt(H); a row that sees nothing gives zeros."""
    q, keys, values = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, keys, values))
    b, t, n, h = q.shape
    kv_heads = keys.shape[2]
    group = n // kv_heads
    out = np.zeros((b, t, n, h))
    for row in range(b):
        for step in range(t):
            visible = int(limits[row, step])
            if visible == 0:
                continue
            for head in range(n):
                k = keys[row, :visible, head // group]
                v = values[row, :visible, head // group]
                scores = k @ q[row, step, head] / np.sqrt(h)
                probs = np.exp(scores - scores.max())
                out[row, step, head] = probs @ v / probs.sum()
    return out


def make_cache(rng, batch, pages_per_seq, dtype, *, spare_pages=3):
    """Dense per-row K/V sequences and the same data in a heads-first page pool behind a shuffled page
    table (page 0 is the null page, never handed out; spare pages hold noise)."""
    window = pages_per_seq * PAGE_SIZE
    keys = rng.standard_normal((batch, window, KV_HEADS, HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal((batch, window, KV_HEADS, HEAD_DIM)).astype(np.float32)
    num_pages = 1 + batch * pages_per_seq + spare_pages
    page_table = (1 + rng.permutation(num_pages - 1)[:batch * pages_per_seq]).reshape(batch, pages_per_seq)
    k_pages = rng.standard_normal((KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)).astype(np.float32)
    v_pages = rng.standard_normal((KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)).astype(np.float32)
    k_pages[:, 0] = 0.0
    v_pages[:, 0] = 0.0
    for row in range(batch):
        for slot, page in enumerate(page_table[row]):
            span = slice(slot * PAGE_SIZE, (slot + 1) * PAGE_SIZE)
            k_pages[:, page] = keys[row, span].transpose(1, 0, 2)
            v_pages[:, page] = values[row, span].transpose(1, 0, 2)
    cast = lambda x: jnp.asarray(x, dtype)                                   # noqa: E731
    # The oracle sees exactly the (rounded) values the kernel reads.
    return (cast(keys), cast(values), cast(k_pages), cast(v_pages), jnp.asarray(page_table, jnp.int32))


def decode_lengths(window):
    """0, one token, around the first page boundary, the middle, the full window."""
    return np.array([0, 1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, window // 2 + 3, window - 1, window],
                    np.int32)


def max_error(out, expected):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert not np.isnan(out).any()
    return float(np.abs(out - expected).max())


# ----------------------------------------------------------------------------------------------------------
# Pallas GPU kernel: decode
# ----------------------------------------------------------------------------------------------------------
def _check_gpu_decode(heads, dtype_name, k_splits, pages_per_seq, *, pages_per_block=8, seed=0):
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed)
    lengths = decode_lengths(pages_per_seq * PAGE_SIZE)
    keys, values, k_pages, v_pages, page_table = make_cache(rng, len(lengths), pages_per_seq, dtype)
    q = jnp.asarray(rng.standard_normal((len(lengths), heads, HEAD_DIM)), dtype)
    out = pallas_gpu.paged_decode_attention(q, k_pages, v_pages, jnp.asarray(lengths), page_table,
                                            k_splits=k_splits, pages_per_block=pages_per_block,
                                            interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = dense_attention(q[:, None], keys, values, lengths[:, None])[:, 0]
    error = max_error(out, expected)
    assert error <= TOLERANCE[dtype_name], error
    assert np.all(np.asarray(out[0], np.float32) == 0.0)                          # length 0 → zeros
    return error


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads", [16, 32])
@pytest.mark.parametrize("k_splits", [1, 2])
def test_gpu_decode_matches_dense(heads, dtype_name, k_splits):
    _check_gpu_decode(heads, dtype_name, k_splits, pages_per_seq=4)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_gpu_decode_uneven_splits(dtype_name):
    """pages_per_seq = 6 is no multiple of 4 splits: the wrapper pads the table with the null page."""
    _check_gpu_decode(16, dtype_name, k_splits=4, pages_per_seq=6, pages_per_block=2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads", [16, 32])
@pytest.mark.parametrize("k_splits", [1, 4, 8])
def test_gpu_decode_longer_windows(heads, dtype_name, k_splits):
    _check_gpu_decode(heads, dtype_name, k_splits, pages_per_seq=32, seed=1)


def test_merge_splits_is_a_log_sum_exp_merge():
    """Two halves of one softmax, merged, equal the whole; a row no split saw stays zero."""
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((2, 10))
    values = rng.standard_normal((10, 4))
    parts, lses = [], []
    for half in (slice(0, 6), slice(6, 10)):
        s = scores[:, half]
        parts.append(np.exp(s - s.max(-1, keepdims=True)) @ values[half]
                     / np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True))
        lses.append(np.log(np.exp(s).sum(-1)))
    o = jnp.asarray(np.stack(parts))[None]                                          # [1, splits, rows, H]
    lse = jnp.asarray(np.stack(lses))[None]
    o = jnp.concatenate([o, jnp.zeros_like(o)], axis=0)
    lse = jnp.concatenate([lse, jnp.full_like(lse, -jnp.inf)], axis=0)
    merged = np.asarray(pallas_gpu.merge_splits(o.astype(jnp.float32), lse.astype(jnp.float32)))
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    whole = probs @ values / probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(merged[0], whole, atol=1e-5)
    assert np.all(merged[1] == 0.0)


# ----------------------------------------------------------------------------------------------------------
# Pallas GPU kernel: prefill chunks, and the backend signature
# ----------------------------------------------------------------------------------------------------------
def _prefill_case(rng, dtype, heads, pages_per_seq, chunk):
    window = pages_per_seq * PAGE_SIZE
    starts = np.array([0, 5, PAGE_SIZE, window - chunk], np.int32)
    keys, values, k_pages, v_pages, page_table = make_cache(rng, len(starts), pages_per_seq, dtype)
    q = jnp.asarray(rng.standard_normal((len(starts), chunk, heads, HEAD_DIM)), dtype)
    positions = starts[:, None] + np.arange(chunk, dtype=np.int32)[None, :]
    expected = dense_attention(q, keys, values, positions + 1)
    return q, k_pages, v_pages, page_table, positions, expected


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,k_splits", [(16, 1), (32, 2)])
def test_gpu_prefill_matches_dense(heads, dtype_name, k_splits):
    dtype = DTYPES[dtype_name]
    q, k_pages, v_pages, page_table, positions, expected = _prefill_case(
        np.random.default_rng(4), dtype, heads, pages_per_seq=4, chunk=8)
    out = pallas_gpu.paged_prefill_attention(q, k_pages, v_pages, page_table, jnp.asarray(positions),
                                             k_splits=k_splits, block_rows=16, interpret=INTERPRET)
    error = max_error(out, expected)
    assert error <= TOLERANCE[dtype_name], error


def test_gpu_backend_signature_routes_decode_and_prefill():
    """The functional ``paged_attention(q [B,T,N,H], ..., q_positions)``: T = 1 is decode (length = position + 1)."""
    rng = np.random.default_rng(6)
    keys, values, k_pages, v_pages, page_table = make_cache(rng, 2, 4, jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 1, 16, HEAD_DIM)), jnp.float32)
    positions = np.array([[9], [63]], np.int32)
    out = pallas_gpu.paged_attention(q, k_pages, v_pages, page_table, jnp.asarray(positions),
                                     interpret=INTERPRET)
    assert max_error(out, dense_attention(q, keys, values, positions + 1)) <= 1e-5


# ----------------------------------------------------------------------------------------------------------
# KV write for the heads-first layout
# ----------------------------------------------------------------------------------------------------------
def test_write_kv_heads_first_then_decode():
    """Tokens written through a shuffled page table land where the kernel reads them."""
    rng = np.random.default_rng(7)
    batch, pages_per_seq, steps = 2, 3, 40
    num_pages = 1 + batch * pages_per_seq
    page_table = (1 + rng.permutation(num_pages - 1)).reshape(batch, pages_per_seq).astype(np.int32)
    keys = rng.standard_normal((batch, steps, KV_HEADS, HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal((batch, steps, KV_HEADS, HEAD_DIM)).astype(np.float32)
    positions = np.broadcast_to(np.arange(steps), (batch, steps))
    page_ids = np.take_along_axis(page_table, positions // PAGE_SIZE, axis=1)
    offsets = positions % PAGE_SIZE
    k_pages = jnp.zeros((KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM), jnp.float32)
    v_pages = jnp.zeros_like(k_pages)
    k_pages = write_kv_heads_first(k_pages, jnp.asarray(keys), jnp.asarray(page_ids), jnp.asarray(offsets))
    v_pages = write_kv_heads_first(v_pages, jnp.asarray(values), jnp.asarray(page_ids), jnp.asarray(offsets))
    np.testing.assert_array_equal(np.asarray(k_pages)[3, page_table[1, 2], 7], keys[1, 2 * PAGE_SIZE + 7, 3])
    q = jnp.asarray(rng.standard_normal((batch, 16, HEAD_DIM)), jnp.float32)
    lengths = np.array([steps, 17], np.int32)
    out = pallas_gpu.paged_decode_attention(q, k_pages, v_pages, jnp.asarray(lengths), jnp.asarray(page_table),
                                            interpret=INTERPRET)
    assert max_error(out, dense_attention(q[:, None], keys, values, lengths[:, None])[:, 0]) <= 1e-5


# ----------------------------------------------------------------------------------------------------------
# Pallas TPU: JAX's decode kernel in the TPU interpreter; the ragged wrapper on JAX's ragged reference
# ----------------------------------------------------------------------------------------------------------
needs_tpu_interpreter = pytest.mark.skipif(BACKEND not in ("cpu", "tpu"),
                                           reason="TPU kernels run on TPU, or interpreted on CPU")
TPU_INTERPRET = BACKEND == "cpu"
# The TPU kernel rounds K and V to bfloat16 as it loads them: float32 pages get bfloat16 accuracy.
TPU_TOLERANCE = 2e-2


@needs_tpu_interpreter
@pytest.mark.parametrize("heads,dtype_name", [(16, "float32"), (32, "bfloat16")])
def test_tpu_decode_matches_dense(heads, dtype_name):
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(8)
    lengths = decode_lengths(4 * PAGE_SIZE)[[0, 1, 3, 5, 7]]
    keys, values, k_pages, v_pages, page_table = make_cache(rng, len(lengths), 4, dtype)
    q = jnp.asarray(rng.standard_normal((len(lengths), heads, HEAD_DIM)), dtype)
    out = pallas_tpu.paged_decode_attention(q, k_pages, v_pages, jnp.asarray(lengths), page_table,
                                            pages_per_compute_block=2, interpret=TPU_INTERPRET)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = dense_attention(q[:, None], keys, values, lengths[:, None])[:, 0]
    error = max_error(out, expected)
    assert error <= TPU_TOLERANCE, error
    assert np.all(np.asarray(out[0], np.float32) == 0.0)


def test_tpu_decode_wrapper_scales_pads_and_zeroes():
    """With a stand-in kernel (JAX's TPU kernel applies no scale): q arrives pre-scaled in float32, the page
    table is padded to whole compute blocks, length-0 rows come back as zeros."""
    seen = {}

    def fake_kernel(q, k_pages, v_pages, lengths, page_indices, *, pages_per_compute_block, **_):
        seen.update(q=q, table=page_indices, block=pages_per_compute_block)
        return jnp.ones_like(q)

    q = jnp.full((2, 16, HEAD_DIM), 2.0, jnp.bfloat16)
    pages = jnp.zeros((KV_HEADS, 8, PAGE_SIZE, HEAD_DIM), jnp.bfloat16)
    out = pallas_tpu.paged_decode_attention(q, pages, pages, jnp.array([0, 5], jnp.int32),
                                            jnp.ones((2, 3), jnp.int32), pages_per_compute_block=2,
                                            kernel=fake_kernel)
    assert seen["q"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(seen["q"]), 2.0 / np.sqrt(HEAD_DIM), rtol=1e-6)
    assert seen["table"].shape == (2, 4) and int(seen["table"][0, 3]) == 0 and seen["block"] == 2
    assert out.dtype == jnp.bfloat16
    assert np.all(np.asarray(out[0], np.float32) == 0.0) and np.all(np.asarray(out[1], np.float32) == 1.0)


needs_ragged = pytest.mark.skipif(not pallas_tpu.ragged_kernel_available(), reason="no ragged TPU kernel")


@functools.lru_cache(maxsize=None)
def _ragged_reference():
    """JAX's ragged reference, in full float32 (its einsums would run in TF32 on a GPU)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    def reference(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return ref_ragged_paged_attention(*args, **kwargs)
    return reference


def _combined_cache(rng, batch, pages_per_seq, dtype):
    keys, values, k_pages, v_pages, page_table = make_cache(rng, batch, pages_per_seq, dtype)
    kv_pages = jnp.stack([jnp.transpose(k_pages, (1, 2, 0, 3)), jnp.transpose(v_pages, (1, 2, 0, 3))],
                         axis=3).reshape(k_pages.shape[1], PAGE_SIZE, 2 * KV_HEADS, HEAD_DIM)
    return keys, values, kv_pages, page_table


@needs_ragged
@pytest.mark.parametrize("heads", [16, pytest.param(32, marks=pytest.mark.slow)])
def test_ragged_wrapper_prefill_and_decode(heads):
    """Padded [B, T] batches (prefill chunks; decode as T = 1) through the ragged wrapper, JAX's ragged
    reference standing in for the TPU-only kernel."""
    rng = np.random.default_rng(9)
    keys, values, kv_pages, page_table = _combined_cache(rng, 4, 4, jnp.float32)
    k_back, v_back = pallas_tpu.split_combined(kv_pages)
    assert k_back.shape == (KV_HEADS, kv_pages.shape[0], PAGE_SIZE, HEAD_DIM)
    for chunk, starts in ((8, [0, 5, 16, 56]), (1, [0, 17, 40, 63])):
        q = jnp.asarray(rng.standard_normal((4, chunk, heads, HEAD_DIM)), jnp.float32)
        positions = np.asarray(starts, np.int32)[:, None] + np.arange(chunk, dtype=np.int32)[None]
        out = pallas_tpu.ragged_attention(q, kv_pages, page_table, jnp.asarray(positions),
                                          kernel=_ragged_reference())
        assert max_error(out, dense_attention(q, keys, values, positions + 1)) <= 1e-5


@needs_ragged
def test_ragged_tokens_mixed_batch_and_combined_write():
    """One ragged call for a decode row (1 token) and a prefill row (5 tokens), on a cache written with
    ``write_kv_combined``."""
    rng = np.random.default_rng(10)
    num_pages, pages_per_seq = 9, 4
    page_table = (1 + rng.permutation(num_pages - 1)).reshape(2, pages_per_seq).astype(np.int32)
    kv_lens = np.array([30, 21], np.int32)
    keys = rng.standard_normal((2, 64, KV_HEADS, HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal((2, 64, KV_HEADS, HEAD_DIM)).astype(np.float32)
    positions = np.broadcast_to(np.arange(64), (2, 64))
    page_ids = np.take_along_axis(page_table, positions // PAGE_SIZE, axis=1)
    kv_pages = pallas_tpu.write_kv_combined(
        pallas_tpu.init_pages_combined(num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, jnp.float32),
        jnp.asarray(keys), jnp.asarray(values), jnp.asarray(page_ids), jnp.asarray(positions % PAGE_SIZE))
    q = jnp.asarray(rng.standard_normal((6, 16, HEAD_DIM)), jnp.float32)
    out = pallas_tpu.ragged_attention_tokens(q, kv_pages, jnp.asarray(kv_lens), jnp.asarray(page_table),
                                             jnp.array([0, 1, 6], jnp.int32), jnp.array([2], jnp.int32),
                                             kernel=_ragged_reference())
    expected_decode = dense_attention(q[None, :1], keys[:1], values[:1], np.array([[30]]))[0]
    expected_prefill = dense_attention(q[None, 1:], keys[1:], values[1:], np.arange(17, 22)[None] )[0]
    assert max_error(out[:1], expected_decode) <= 1e-5
    assert max_error(out[1:], expected_prefill) <= 1e-5


# ----------------------------------------------------------------------------------------------------------
# The backend objects behind kernels.AttentionBackend
# ----------------------------------------------------------------------------------------------------------
BACKENDS = {
    "pallas-gpu": (lambda: pallas_gpu.PallasGpuBackend(interpret=INTERPRET), 1e-5),
    "pallas-gpu-split2": (lambda: pallas_gpu.PallasGpuBackend(k_splits=2, interpret=INTERPRET), 1e-5),
    "pallas-tpu": (lambda: pallas_tpu.PallasTpuBackend(pages_per_compute_block=2, interpret=TPU_INTERPRET),
                   TPU_TOLERANCE),
    "pallas-tpu-ragged": (lambda: pallas_tpu.PallasTpuRaggedBackend(kernel=_ragged_reference()), 1e-5),
}


@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_object_writes_gathers_and_attends(name):
    """Through the seam: write two chunks through a shuffled page table, read them back with ``gather_kv``,
    then prefill (a chunk) and decode (one token per row) against the oracle."""
    if name.startswith("pallas-tpu") and BACKEND not in ("cpu", "tpu"):
        pytest.skip("TPU kernels run on TPU, or interpreted on CPU")
    if name == "pallas-tpu-ragged" and not pallas_tpu.ragged_kernel_available():
        pytest.skip("no ragged TPU kernel in this JAX")
    make, tolerance = BACKENDS[name]
    backend = make()
    assert isinstance(backend, kernels.AttentionBackend)
    assert backend == make() and hash(backend) == hash(make())
    rng = np.random.default_rng(11)
    batch, pages_per_seq, heads = 3, 4, 16
    window = pages_per_seq * PAGE_SIZE
    num_pages = 1 + batch * pages_per_seq + 2
    page_table = (1 + rng.permutation(num_pages - 1)[:batch * pages_per_seq]).reshape(batch, pages_per_seq)
    page_table = page_table.astype(np.int32)
    lengths = np.array([window, 21, 1], np.int32)
    keys = rng.standard_normal((batch, window, KV_HEADS, HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal((batch, window, KV_HEADS, HEAD_DIM)).astype(np.float32)
    cache = backend.init_layer_cache(num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, jnp.float32)
    assert backend.page_size(cache) == PAGE_SIZE
    for start, stop in ((0, 24), (24, window)):                                  # two prefill chunks
        positions = np.broadcast_to(np.arange(start, stop), (batch, stop - start))
        valid = positions < lengths[:, None]
        page_ids = np.where(valid, np.take_along_axis(page_table, positions // PAGE_SIZE, axis=1), 0)
        offsets = np.where(valid, positions % PAGE_SIZE, 0)
        cache = backend.write(cache, jnp.asarray(keys[:, start:stop]), jnp.asarray(values[:, start:stop]),
                              jnp.asarray(page_ids), jnp.asarray(offsets))
    got_k, got_v = backend.gather_kv(cache, jnp.asarray(page_table))
    for row, length in enumerate(lengths):
        np.testing.assert_array_equal(np.asarray(got_k)[row, :length], keys[row, :length])
        np.testing.assert_array_equal(np.asarray(got_v)[row, :length], values[row, :length])

    chunk = 8                                                                    # prefill: each row's last chunk
    starts = np.maximum(lengths - chunk, 0)
    positions = starts[:, None] + np.arange(chunk, dtype=np.int32)[None]
    q = jnp.asarray(rng.standard_normal((batch, chunk, heads, HEAD_DIM)), jnp.float32)
    out = backend.prefill_attention(q, cache, jnp.asarray(page_table), jnp.asarray(positions))
    real = positions < lengths[:, None]                                          # padding queries are ignored
    expected = dense_attention(q, keys, values, positions + 1)
    error = float(np.abs(np.asarray(out, np.float64) - expected)[real].max())
    prefill_tolerance = 1e-5 if name == "pallas-tpu" else tolerance              # pallas-tpu prefill: the gather
    assert error <= prefill_tolerance, error

    q = jnp.asarray(rng.standard_normal((batch, heads, HEAD_DIM)), jnp.float32)
    out = backend.decode_attention(q, cache, jnp.asarray(page_table), jnp.asarray(lengths))
    assert out.shape == q.shape
    assert max_error(out, dense_attention(q[:, None], keys, values, lengths[:, None])[:, 0]) <= tolerance


def test_auto_k_splits_fills_the_gpu_at_small_batch_only():
    assert pallas_gpu.auto_k_splits(1, 8, 64, 8) == 8              # 1 row, 1024 tokens: 8 splits of 8 pages
    assert pallas_gpu.auto_k_splits(4, 8, 64, 8) == 8
    assert pallas_gpu.auto_k_splits(16, 8, 64, 8) == 4
    assert pallas_gpu.auto_k_splits(32, 8, 64, 8) == 2
    assert pallas_gpu.auto_k_splits(64, 8, 64, 8) == 1
    assert pallas_gpu.auto_k_splits(256, 8, 64, 8) == 1
    assert pallas_gpu.auto_k_splits(1, 8, 8, 8) == 1               # a split never holds less than one block


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_gpu_kernel_lowers_to_triton_without_a_gpu(dtype_name):
    """The non-interpreted decode (with k-splits) and prefill kernels pass Pallas' Triton lowering for CUDA,
    which runs without a GPU: it catches what Triton refuses (shapes that are no power of two, unsupported
    primitives) in CI. Compiling the Triton IR to GPU code still needs a GPU."""
    from jax import export
    dtype = DTYPES[dtype_name]
    pages = jax.ShapeDtypeStruct((KV_HEADS, 64, PAGE_SIZE, HEAD_DIM), dtype)
    table = jax.ShapeDtypeStruct((4, 12), jnp.int32)

    def decode(q, k_pages, v_pages, lengths, page_table):
        return pallas_gpu.paged_decode_attention(q, k_pages, v_pages, lengths, page_table, k_splits=4)

    def prefill(q, k_pages, v_pages, page_table, positions):
        return pallas_gpu.paged_prefill_attention(q, k_pages, v_pages, page_table, positions)

    triton_ok = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    cases = ((decode, (jax.ShapeDtypeStruct((4, 32, HEAD_DIM), dtype), pages, pages,
                       jax.ShapeDtypeStruct((4,), jnp.int32), table)),
             (prefill, (jax.ShapeDtypeStruct((4, 16, 16, HEAD_DIM), dtype), pages, pages, table,
                        jax.ShapeDtypeStruct((4, 16), jnp.int32))))
    for fn, args in cases:
        exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=triton_ok)(*args)
        assert "xla.gpu.triton" in exported.mlir_module()


@pytest.mark.parametrize("name", ["pallas-gpu", pytest.param("pallas-tpu", marks=pytest.mark.slow)])
def test_engine_on_pallas_backend_matches_reference(name):
    """The whole sampler (prefill chunks, decode, page allocation) on a Pallas backend: same greedy and sampled
    tokens as ``reference``; log-probs within float32 noise (pallas-tpu: its bfloat16 K/V rounding)."""
    if name == "pallas-tpu" and BACKEND not in ("cpu", "tpu"):
        pytest.skip("TPU kernels run on TPU, or interpreted on CPU")
    from flax import nnx

    from engine_requests import fixed_length_requests
    from jaxopd.models.decoder import CausalLM
    from jaxopd.sampler import Engine, EngineConfig
    from micro_models import TWO_LAYER, micro_config

    if name not in kernels.available_backends():
        kernels.register_backend({"pallas-gpu": pallas_gpu.PallasGpuBackend,
                                  "pallas-tpu": pallas_tpu.PallasTpuBackend}[name]())
    # head_dim 16 and 16-token pages: a TPU kernel's tiles
    model = CausalLM(micro_config(TWO_LAYER, vocab_size=128), rngs=nnx.Rngs(0))
    outputs = {}
    for backend in ("reference", name):
        config = EngineConfig(max_slots=4, page_size=16, num_pages=24, max_seq_len=64, prefill_chunk=32,
                              max_prefill_tokens=64, eos_token_ids=(), attention_backend=backend)
        with Engine(model, config) as engine:
            outputs[backend] = engine.generate(fixed_length_requests(3, vocab=128, new_tokens=8))
    for ref, got in zip(outputs["reference"], outputs[name]):
        assert ref.token_ids == got.token_ids
        # on a GPU the reference's float32 einsums may run in TF32: only the CPU bound is tight
        tolerance = 1e-5 if name == "pallas-gpu" and BACKEND == "cpu" else 2e-3
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=tolerance)
