"""``EngineConfig.scan_layers``: the decoder layers of every step as one ``jax.lax.scan`` over a stacked copy of
their parameters, the layers' KV caches one page pool (``executor.LayerScan``). A candidate for the GPU decode
step's fixed cost; here, on CPU, its outputs must be the unrolled engine's: the same tokens, finish reasons and
text, log-probs and scores to float rounding, through prefill chunks, decode, mixed steps, scoring, preemption,
weight updates, and the in-place Pallas kernel (interpret mode). The preemption, Pallas and bfloat16 cases are
marked ``slow`` (about 30-50 s each here: every shape compiles twice)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine_requests import CharTokenizer, request_mix
from jaxopd.models.decoder import CausalLM
from micro_models import TWO_LAYER, micro_config
from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams
from jaxopd.sampler.executor import LayerScan

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

VOCAB = 64
CFG = micro_config(TWO_LAYER, vocab_size=VOCAB)
MODEL_SEED = 3      # the `model` fixture (conftest): CausalLM(CFG) from this seed
# few buckets: every shape compiles twice (unrolled and scanned) on a 2-core machine
BASE = EngineConfig(max_slots=4, page_size=8, num_pages=64, max_seq_len=64, prefill_chunk=16,
                    max_prefill_tokens=32, max_prefill_rows=2, eos_token_ids=(5,), attention_backend="reference")
LOGPROB_TOL = 1e-5


def run(model, config, reqs, *, update=None, warm=False):
    """Results of ``reqs``; ``warm``: after ``warmup``, and nothing may compile afterwards; ``update``: a state
    applied with ``update_weights`` before they are submitted."""
    with Engine(model, config, tokenizer=CharTokenizer()) as engine:
        if warm:
            engine.warmup()
        compiled = engine.compiled_count()
        if update is not None:
            engine.update_weights(update)
        results = engine.generate(reqs)
        if warm:
            assert engine.compiled_count() == compiled, "a step compiled after warm-up"
        stats = dict(engine.stats)
    return results, stats


def assert_same(unrolled, scanned):
    worst = 0.0
    for x, y in zip(unrolled, scanned, strict=True):
        assert x.request_id == y.request_id
        assert x.token_ids == y.token_ids, x.request_id
        assert (x.finish_reason, x.text, x.error) == (y.finish_reason, y.text, y.error), x.request_id
        if len(x.logprobs):
            worst = max(worst, float(np.max(np.abs(np.asarray(x.logprobs) - np.asarray(y.logprobs)))))
    assert worst <= LOGPROB_TOL, worst


def greedy(n, seed, max_new=20, max_prompt=40):
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(0, VOCAB, size=int(rng.integers(2, max_prompt))).tolist(),
                    SamplingParams(max_new_tokens=max_new, min_new_tokens=max_new, temperature=0.0),
                    request_id=f"g{i}") for i in range(n)]


def test_greedy_tokens_and_logprobs_equal_the_unrolled_layers(model):
    """Warmed up: the scanned engine's warm-up compiles every shape its steps take."""
    reqs = greedy(6, seed=1)
    unrolled, _ = run(model, BASE, reqs)
    scanned, stats = run(model, dataclasses.replace(BASE, scan_layers=True), reqs, warm=True)
    assert_same(unrolled, scanned)
    assert stats["decode_steps"] > 0 and all(len(r.token_ids) == 20 for r in scanned)


@pytest.mark.parametrize("config", [
    dataclasses.replace(BASE, mixed_steps=False),
    dataclasses.replace(BASE, mixed_steps=True),
    pytest.param(dataclasses.replace(BASE, num_pages=20, prefix_sharing=False),    # preemption: recomputed pages
                 marks=pytest.mark.slow),
], ids=["separate", "mixed", "preemption"])
def test_request_mix_with_scores_equals_the_unrolled_layers(model, config):
    """Sampled and greedy requests, stops of every kind, long prompts in several chunks and score requests."""
    reqs = request_mix(14, seed=config.num_pages, vocab=VOCAB, max_prompt=30, max_new=30, score_every=4)
    unrolled, _ = run(model, config, reqs)
    scanned, stats = run(model, dataclasses.replace(config, scan_layers=True), reqs)
    assert_same(unrolled, scanned)
    assert stats["scored_tokens"] > 0
    if config.mixed_steps:
        assert stats["mixed_steps"] > 0
    if config.num_pages == 20:
        assert stats["preemptions"] > 0


def test_weight_update_restacks_the_layers(model):
    """``update_weights`` swaps in new weights: the scanned engine must serve them, not its stacked copy of the
    old ones."""
    other = nnx.state(CausalLM(CFG, rngs=nnx.Rngs(4)))
    reqs = greedy(3, seed=2, max_new=8)
    unrolled, _ = run(model, BASE, reqs, update=other)
    scanned, _ = run(model, dataclasses.replace(BASE, scan_layers=True), reqs, update=other)
    assert_same(unrolled, scanned)
    before, _ = run(model, dataclasses.replace(BASE, scan_layers=True), reqs)
    assert max(float(np.max(np.abs(np.asarray(x.logprobs) - np.asarray(y.logprobs))))
               for x, y in zip(before, scanned)) > 1e-3


@pytest.mark.slow
def test_scan_on_the_pallas_kernel_in_interpret_mode(model):
    """``pallas-gpu`` (Pallas interpret mode on CPU) over the layers' one page pool, its page ids shifted per
    layer, gives the reference backend's unrolled outputs."""
    config = dataclasses.replace(BASE, attention_backend="pallas-gpu", max_slots=2, num_pages=24, max_seq_len=32,
                                 scoring=False)
    reqs = greedy(2, seed=3, max_new=4, max_prompt=20)
    unrolled, _ = run(model, dataclasses.replace(config, attention_backend="reference", mixed_steps=False), reqs)
    scanned, _ = run(model, dataclasses.replace(config, scan_layers=True), reqs)
    assert_same(unrolled, scanned)


def test_layer_scan_splits_the_state(model):
    """The stacked leaves are the layers' leaves in layer order; the rest are the embedding and the final norm;
    the cache is one pool of num_layers * num_pages pages."""
    with Engine(model, dataclasses.replace(BASE, scan_layers=True)) as engine:
        executor = engine.executor
        outer, stacked = executor._state_leaves
        layer_leaves = [jax.tree.leaves(nnx.state(layer)) for layer in model.layers]
        assert len(stacked) == len(layer_leaves[0])
        for j, leaf in enumerate(stacked):
            assert leaf.shape == (CFG.num_layers, *layer_leaves[0][j].shape)
            for i in range(CFG.num_layers):
                np.testing.assert_array_equal(np.asarray(leaf[i]), np.asarray(layer_leaves[i][j]))
        assert len(outer) == 2            # tied embedding, final norm
        k_pages, _ = executor.kv
        assert k_pages.shape[0] == CFG.num_layers * BASE.num_pages
        assert isinstance(executor._static.scan, LayerScan)
        assert hash(executor._static) == hash(executor._static)


def test_scan_layers_must_be_a_bool():
    with pytest.raises(ValueError, match="scan_layers"):
        dataclasses.replace(BASE, scan_layers="yes").validate()


@pytest.mark.slow
def test_untied_bf16_model():
    """An untied head (the head leaf outside the layers) in bfloat16: greedy tokens equal."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=False, dtype="bfloat16", param_dtype="bfloat16")
    untied = CausalLM(cfg, rngs=nnx.Rngs(5))
    reqs = greedy(3, seed=4, max_new=10)
    unrolled, _ = run(untied, BASE, reqs)
    scanned, _ = run(untied, dataclasses.replace(BASE, scan_layers=True), reqs)
    assert [r.token_ids for r in unrolled] == [r.token_ids for r in scanned]
    worst = max(float(np.max(np.abs(np.asarray(x.logprobs) - np.asarray(y.logprobs))))
                for x, y in zip(unrolled, scanned))
    assert worst <= 2e-2, worst
    assert jnp.dtype(jax.tree.leaves(untied)[0].dtype) == jnp.bfloat16
