"""The attention-backend seam: every registered backend owns its page layout, writes keys/values where the
page table says, and attends exactly as the dense ``grouped_attention`` over the same keys/values; the
heads-first layout gives the reference's numbers bit for bit, also inside the engine."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopd_kernels import registry as kernels
from jaxopd_kernels.dense import grouped_attention

NUM_PAGES, PAGE_SIZE, KV_HEADS, HEADS, HEAD_DIM = 16, 4, 2, 4, 8
PAGE_TABLE = np.array([[3, 7, 1, 12], [5, 2, 9, 0], [14, 0, 0, 0]], np.int32)   # row 1 has 3 pages, row 2 one
LENGTHS = np.array([15, 10, 3])                                                    # tokens cached per row


def _sequences(seed=0):
    rng = np.random.default_rng(seed)
    shape = (3, PAGE_TABLE.shape[1] * PAGE_SIZE, KV_HEADS, HEAD_DIM)
    return (jnp.asarray(rng.normal(size=shape), jnp.float32), jnp.asarray(rng.normal(size=shape), jnp.float32),
            jnp.asarray(rng.normal(size=(3, shape[1], HEADS, HEAD_DIM)), jnp.float32))


def _write_prefix(backend, keys, values, start, stop):
    """Write positions [start, stop) of every row (past a row's length: padding, to the null page)."""
    cache = backend.init_layer_cache(NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, jnp.float32)
    positions = np.arange(start, stop)[None, :].repeat(3, 0)
    valid = positions < LENGTHS[:, None]
    page_ids = np.where(valid, np.take_along_axis(PAGE_TABLE, positions // PAGE_SIZE, 1), 0)
    offsets = np.where(valid, positions % PAGE_SIZE, 0)
    return backend.write(cache, keys[:, start:stop], values[:, start:stop], jnp.asarray(page_ids),
                         jnp.asarray(offsets))


def _filled_cache(backend, keys, values):
    cache = _write_prefix(backend, keys, values, 0, 9)                        # a first prefill chunk
    positions = np.arange(9, 16)[None, :].repeat(3, 0)                        # then the rest
    valid = positions < LENGTHS[:, None]
    page_ids = np.where(valid, np.take_along_axis(PAGE_TABLE, positions // PAGE_SIZE, 1), 0)
    offsets = np.where(valid, positions % PAGE_SIZE, 0)
    return backend.write(cache, keys[:, 9:], values[:, 9:], jnp.asarray(page_ids), jnp.asarray(offsets))


@pytest.mark.parametrize("name", ["reference", "reference-hnd"])
def test_backend_writes_gathers_and_attends_like_dense_attention(name):
    backend = kernels.get_backend(name)
    assert isinstance(backend, kernels.AttentionBackend)
    assert backend == kernels.get_backend(name) and hash(backend) == hash(kernels.get_backend(name))
    keys, values, q = _sequences()
    cache = _filled_cache(backend, keys, values)
    assert backend.page_size(cache) == PAGE_SIZE
    got_k, got_v = backend.gather_kv(cache, jnp.asarray(PAGE_TABLE))
    for row, length in enumerate(LENGTHS):
        np.testing.assert_array_equal(got_k[row, :length], keys[row, :length])
        np.testing.assert_array_equal(got_v[row, :length], values[row, :length])
    # prefill: every position of each row attends causally over its own prefix
    positions = jnp.asarray(np.minimum(np.arange(16)[None, :], LENGTHS[:, None] - 1))
    out = backend.prefill_attention(q, cache, jnp.asarray(PAGE_TABLE), positions)
    causal = np.arange(16)[None, None, :] <= np.asarray(positions)[:, :, None]
    np.testing.assert_allclose(out, grouped_attention(q, keys, values, jnp.asarray(causal)), atol=1e-6)
    # decode: the last query of each row over its whole length
    last = q[jnp.arange(3), LENGTHS - 1]
    out = backend.decode_attention(last, cache, jnp.asarray(PAGE_TABLE), jnp.asarray(LENGTHS))
    visible = np.arange(16)[None, None, :] < LENGTHS[:, None, None]
    np.testing.assert_allclose(out, grouped_attention(last[:, None], keys, values, jnp.asarray(visible))[:, 0],
                               atol=1e-6)


def test_heads_first_layout_is_the_reference_transposed_and_gives_identical_results():
    reference, heads_first = kernels.get_backend("reference"), kernels.get_backend("reference-hnd")
    assert reference.layout.startswith("pages") and heads_first.layout.startswith("kv_heads")
    keys, values, q = _sequences(1)
    ref_cache, hnd_cache = _filled_cache(reference, keys, values), _filled_cache(heads_first, keys, values)
    assert ref_cache[0].shape == (NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    assert hnd_cache[0].shape == (KV_HEADS, NUM_PAGES, PAGE_SIZE, HEAD_DIM)
    for ref_pages, hnd_pages in zip(ref_cache, hnd_cache):
        np.testing.assert_array_equal(np.moveaxis(np.asarray(hnd_pages), 0, 2)[1:], np.asarray(ref_pages)[1:])
    # queries see only written positions: the null page 0 takes every padding write, and on a GPU the order of
    # duplicate scatter indices (so its content) is unspecified and differs between layouts
    table = jnp.asarray(PAGE_TABLE)
    positions = jnp.asarray(np.minimum(np.arange(16)[None, :] % 11, LENGTHS[:, None] - 1))
    np.testing.assert_array_equal(reference.prefill_attention(q, ref_cache, table, positions),
                                  heads_first.prefill_attention(q, hnd_cache, table, positions))
    np.testing.assert_array_equal(reference.decode_attention(q[:, 0], ref_cache, table, jnp.asarray(LENGTHS)),
                                  heads_first.decode_attention(q[:, 0], hnd_cache, table, jnp.asarray(LENGTHS)))


def test_registry_rejects_unknown_names_and_non_backends():
    with pytest.raises(ValueError, match="unknown paged-attention backend 'nope'"):
        kernels.get_backend("nope")
    with pytest.raises(TypeError, match="AttentionBackend"):
        kernels.register_backend(object())
    assert {"reference", "reference-hnd"} <= set(kernels.available_backends())


def test_kernels_import_nothing_of_jaxopd():
    code = "import sys, kernels; bad = [m for m in sys.modules if m.split('.')[0] == 'jaxopd']; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
def test_engine_gives_identical_outputs_on_either_page_layout():
    from engine_requests import fixed_length_requests
    from jaxopd.models.decoder import CausalLM
    from jaxopd.sampler import Engine, EngineConfig
    from micro_models import TWO_LAYER, micro_config

    model = CausalLM(micro_config(TWO_LAYER, vocab_size=128), rngs=nnx.Rngs(0))
    outputs = {}
    for name in ("reference", "reference-hnd"):
        config = EngineConfig(max_slots=4, page_size=8, num_pages=48, max_seq_len=64, prefill_chunk=32,
                              max_prefill_tokens=64, eos_token_ids=(), attention_backend=name)
        with Engine(model, config) as engine:
            results = engine.generate(fixed_length_requests(5, vocab=128, new_tokens=12))
            assert engine.scheduler.allocator.num_used == 0
            layout = jax.tree.leaves(engine.executor.kv)[0].shape
        outputs[name] = [(r.token_ids, r.logprobs.tolist()) for r in results]
        assert layout[0 if name == "reference" else 1] == 48
    assert outputs["reference"] == outputs["reference-hnd"]
