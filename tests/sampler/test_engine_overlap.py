"""The overlapped engine (issue 16: step k+1 dispatched before step k is processed) against the synchronous one
(``EngineConfig(overlap=False)``), token by token: same tokens, log-probs (bit for bit), finish reasons, text
and policy versions, over stops (tokens, strings, ``min_new_tokens``), lengths, admissions of more requests
than slots, prefill interleaving, preemption, aborts and weight updates."""
import dataclasses
import time

import numpy as np
import pytest
from flax import nnx

from jaxopd.models.decoder import CausalLM
from micro_models import SMALL, micro_config
from engine_requests import CharTokenizer, request_mix
from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

VOCAB = 64
CFG = micro_config(SMALL, vocab_size=VOCAB)
MODEL_SEED = 7      # the `model` fixture (conftest): CausalLM(CFG) from this seed
BASE = EngineConfig(max_slots=8, page_size=4, num_pages=256, max_seq_len=128, prefill_chunk=16,
                    max_prefill_tokens=64, max_prefill_rows=4, eos_token_ids=(5,))


def requests(n, seed):
    return request_mix(n, seed, vocab=VOCAB)


def run(model, config, reqs):
    with Engine(model, config, tokenizer=CharTokenizer()) as engine:
        results = engine.generate(reqs)
        stats = dict(engine.stats)
        assert engine.scheduler.allocator.num_used == 0 or config.prefix_sharing
    return results, stats


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.request_id == y.request_id
        assert x.token_ids == y.token_ids, x.request_id
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
        assert (x.finish_reason, x.text, x.policy_versions, x.error) == \
            (y.finish_reason, y.text, y.policy_versions, y.error), x.request_id


@pytest.mark.parametrize("config", [
    BASE,
    dataclasses.replace(BASE, num_pages=40),                      # preemption
    dataclasses.replace(BASE, max_slots=3, policy="fast-first"),   # admissions wait for finishing rows
], ids=["plain", "preemption", "few-slots"])
def test_overlapped_engine_matches_synchronous_token_by_token(model, config):
    reqs = requests(24, seed=config.num_pages + config.max_slots)
    sync, sync_stats = run(model, dataclasses.replace(config, overlap=False), reqs)
    overlapped, stats = run(model, config, reqs)
    assert_same(sync, overlapped)
    reasons = {r.finish_reason for r in sync}
    assert {"stop", "length"} <= reasons
    assert stats["generated_tokens"] == sync_stats["generated_tokens"]
    if config.num_pages == 40:
        assert sync_stats["preemptions"] > 0 and stats["preemptions"] > 0


def test_steady_state_overlaps_and_drops_the_token_after_a_stop(model):
    """Long steady runs overlap (more decode steps dispatched than the synchronous engine's only when a row
    stopped with the next step in flight), and the dropped token is never returned."""
    reqs = [Request([1, 2, 3], SamplingParams(max_new_tokens=50, temperature=1.0, seed=s, stop_token_ids=(9,)))
            for s in range(6)]
    sync, sync_stats = run(model, dataclasses.replace(BASE, overlap=False), reqs)
    overlapped, stats = run(model, BASE, reqs)
    assert_same(sync, overlapped)
    assert stats["decode_steps"] >= sync_stats["decode_steps"]


def test_abort_and_weight_update_mid_run(model):
    """An abort returns a prefix of the synchronous output; a weight update applies between steps and the
    versions recorded are those of the weights that produced the tokens."""
    state = nnx.split(model)[1]
    req = Request([4, 5, 6], SamplingParams(max_new_tokens=120, temperature=1.0, seed=3), request_id="long")
    config = dataclasses.replace(BASE, eos_token_ids=())
    full, _ = run(model, dataclasses.replace(config, overlap=False), [req])
    with Engine(model, config, tokenizer=CharTokenizer()) as engine:
        engine.warmup()
        future = engine.submit(req)
        while engine.stats["decode_steps"] < 10 and not future.done():
            time.sleep(0.0005)
        engine.update_weights(state)                 # same weights: the tokens must not change
        while engine.stats["decode_steps"] < 30 and not future.done():
            time.sleep(0.0005)
        engine.abort("long")
        r = future.result(timeout=60)
    assert r.finish_reason == "abort" and 10 <= len(r.token_ids) < 120
    assert r.token_ids == full[0].token_ids[:len(r.token_ids)]
    np.testing.assert_array_equal(r.logprobs, full[0].logprobs[:len(r.token_ids)])
    assert r.policy_versions == (0, 1)


def test_overlapped_steps_compile_nothing_after_warmup():
    """The overlapped decode feeds the previous step's tokens from the device: a call signature of its own,
    which warm-up must compile too (it did not, and every row bucket compiled twice more during serving)."""
    from flax import nnx

    from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams

    cfg = micro_config(SMALL, vocab_size=256, max_position_embeddings=4096)
    config = EngineConfig(max_slots=16, page_size=16, num_pages=16 * 7 + 1, max_seq_len=112, prefill_chunk=16,
                          max_prefill_tokens=16 * 64, max_prefill_rows=64, eos_token_ids=(), overlap=True)
    with Engine(CausalLM(cfg, rngs=nnx.Rngs(3)), config) as engine:
        engine.warmup()
        compiled = engine.compiled_count()
        for batch in (1, 8, 16):
            requests = [Request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_new_tokens=40, min_new_tokens=40, seed=i))
                        for i in range(batch)]
            assert all(len(r.token_ids) == 40 for r in engine.generate(requests))
        assert engine.compiled_count() == compiled
