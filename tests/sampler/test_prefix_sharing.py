"""Prefix sharing: the allocator's chain-hash prefix cache, and engines with sharing on against sharing off
(same tokens, log-probs within 1e-5), with same-step arrivals, page-aligned prompts (copy-on-write of the
last page), multi-turn extension, preemption, abort, weight updates; every page comes back."""
import time

import numpy as np
import pytest
from flax import nnx

from jaxopd.models.decoder import CausalLM
from micro_models import MEDIUM, micro_config
from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams
from jaxopd.sampler.allocator import OutOfPages, PageAllocator, page_hashes

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

VOCAB = 512
CFG = micro_config(MEDIUM, vocab_size=VOCAB)
MODEL_SEED = 9      # the `model` fixture (conftest): CausalLM(CFG) from this seed
ENGINE = EngineConfig(max_slots=8, page_size=8, num_pages=256, max_seq_len=160, prefill_chunk=32,
                      max_prefill_tokens=128, eos_token_ids=())
TOL = 1e-5


def config(**changes):
    return EngineConfig(**{**ENGINE.__dict__, **changes})


def test_allocator_prefix_cache():
    alloc = PageAllocator(5)
    h = page_hashes(list(range(16)), 8)
    assert len(h) == 2 and h == page_hashes(list(range(20)), 8) and page_hashes(list(range(8)), 8) == h[:1]
    assert page_hashes(list(range(16)), 8, start=1, parent=h[0]) == h[1:]
    a, b = alloc.allocate(2)
    alloc.register(a, h[0])
    alloc.register(b, h[1])
    assert alloc.cached_prefix(h) == [a, b] and alloc.num_cached == 2
    alloc.release([a, b])                              # retained: reusable, still free, still cached
    assert alloc.num_free == 4 and alloc.num_used == 0 and alloc.lookup(h[0]) == a
    assert alloc.share([a]) == [a] and alloc.refcount(a) == 1 and alloc.num_free == 3
    fresh = alloc.allocate(3)                          # 2 never-cached pages, then evicts b (LRU)
    assert b in fresh and alloc.lookup(h[1]) is None and alloc.lookup(h[0]) == a
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    alloc.release(fresh + [a])
    alloc.clear_prefix_cache()
    assert alloc.num_cached == 0 and alloc.num_free == 4
    with pytest.raises(ValueError):
        alloc.share([a])                               # no longer cached


def run(model, cfg, waves):
    """Submit each wave at once, wait for it; return results and the engine's stats."""
    with Engine(model, cfg) as engine:
        results = []
        for wave in waves:
            futures = [engine.submit(r) for r in wave]
            results += [f.result(120) for f in futures]
        assert engine.wait_idle(30) and engine.scheduler.allocator.num_used == 0   # every page came back
        return results, dict(engine.stats)


def assert_same(a, b):
    worst = 0.0
    for x, y in zip(a, b):
        assert x.finish_reason == y.finish_reason and x.token_ids == y.token_ids, (x.request_id, y.request_id)
        if len(x.logprobs):
            worst = max(worst, float(np.max(np.abs(x.logprobs - y.logprobs))))
    assert worst <= TOL
    return worst


def request(prompt, new, i, kind="full"):
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new, temperature=0.0 if i % 2 else 0.9, seed=100 + i)
    return Request(list(prompt), params, kind=kind)


def waves(seed):
    rng = np.random.default_rng(seed)
    context = rng.integers(0, VOCAB, 40).tolist()     # 5 full pages: page-aligned prompt (copy-on-write)
    long_context = rng.integers(0, VOCAB, 70).tolist()  # > prefill_chunk: prefilled in 3 chunks
    first = [request(context, 6, 0, "fast"), request(context, 20, 1, "full")]                  # fast + full
    first += [request(context, 8, 2 + i, "candidate") for i in range(4)]                        # N candidates
    first += [request(long_context, 5, 6), request(long_context + [3, 4], 7, 7)]
    second = [request(context + rng.integers(0, VOCAB, 13).tolist(), 9, 8 + i) for i in range(3)]  # next turn
    second += [request(long_context, 4, 11), request(rng.integers(0, VOCAB, 30).tolist(), 5, 12)]
    second += [Request.scoring(context, rng.integers(0, VOCAB, 17).tolist())]
    return [first, second]


def test_sharing_is_exact_against_no_sharing(model):
    w = waves(1)
    shared, stats = run(model, config(prefix_sharing=True), w)
    private, stats_off = run(model, config(prefix_sharing=False), w)
    worst = assert_same(shared, private)
    print(f"\nprefix sharing: {stats['shared_pages']} pages, {stats['prefill_tokens_saved']} prefill tokens "
          f"saved; max |dlogprob| vs no sharing {worst:.1e}")
    assert stats_off["shared_pages"] == 0 and stats_off["prefill_tokens_saved"] == 0
    assert stats["shared_pages"] >= 20 and stats["prefill_tokens_saved"] == 8 * stats["shared_pages"]


def test_sharing_with_preemption_and_abort(model):
    rng = np.random.default_rng(4)
    context = rng.integers(0, VOCAB, 36).tolist()
    reqs = [request(context + rng.integers(0, VOCAB, int(rng.integers(0, 9))).tolist(), 60, i) for i in range(8)]
    small = dict(num_pages=48)                        # 47 pages for 8 sequences of up to 13 pages: preemption
    outcome = {}
    for sharing in (True, False):
        with Engine(model, config(prefix_sharing=sharing, **small)) as engine:
            doomed = Request(list(context), SamplingParams(max_new_tokens=60, seed=5), request_id=f"doomed-{sharing}")
            doomed_future = engine.submit(doomed)
            futures = [engine.submit(r) for r in reqs]
            engine.abort(doomed.request_id)
            assert doomed_future.result(60).finish_reason == "abort"
            results = [f.result(300) for f in futures]
            assert engine.wait_idle(30) and engine.scheduler.allocator.num_used == 0   # every page came back
            outcome[sharing] = results, dict(engine.stats)
    assert_same(outcome[True][0], outcome[False][0])
    stats = outcome[True][1]
    assert stats["preemptions"] > 0 and stats["shared_pages"] > 0


def test_abort_mid_decode_releases_shared_pages(model):
    rng = np.random.default_rng(5)
    context = rng.integers(0, VOCAB, 50).tolist()
    reqs = [request(context, 100, i) for i in range(4)]
    with Engine(model, config()) as engine:
        futures = [engine.submit(r) for r in reqs]
        for _ in range(2000):                           # the followers share the leader's 6 pages
            if engine.stats["shared_pages"] >= 18 and engine.stats["generated_tokens"] >= 8:
                break
            time.sleep(0.01)
        engine.abort(reqs[0].request_id)                # the leader, whose pages the others hold
        engine.abort(reqs[2].request_id)
        results = [f.result(300) for f in futures]
        assert engine.wait_idle(30) and engine.scheduler.allocator.num_used == 0
    assert [r.finish_reason for r in results] == ["abort", "length", "abort", "length"]
    alone, _ = run(model, config(prefix_sharing=False), [[reqs[1], reqs[3]]])
    assert_same([results[1], results[3]], alone)


def test_weight_update_clears_the_prefix_cache(model):
    rng = np.random.default_rng(6)
    context = rng.integers(0, VOCAB, 40).tolist()
    other = CausalLM(CFG, rngs=nnx.Rngs(10))
    with Engine(model, config()) as engine:
        engine.submit(request(context, 4, 0)).result(60)
        engine.update_weights(nnx.state(other))
        after = engine.submit(request(context, 12, 1)).result(60)
        assert engine.stats["shared_pages"] == 0          # nothing computed with the old weights is reused
        again = engine.submit(request(context, 12, 1)).result(60)
        assert engine.stats["shared_pages"] == 4
    fresh, _ = run(other, config(prefix_sharing=False), [[request(context, 12, 1)]])
    assert_same([after, again], fresh * 2)


def test_main_job_prefix_sharing_flag():
    from jaxopd_experiments.actfirst_alfworld import (PRESETS, build_parser, departures_from_paper, options_from_args,
                                                      sharing_summary)
    parse = build_parser().parse_args
    assert options_from_args(parse(["--preset", "cpu", "--out", "x"])).prefix_sharing is True
    off = options_from_args(parse(["--preset", "cpu", "--prefix-sharing", "off", "--out", "x"]))
    assert off.prefix_sharing is False
    with pytest.raises(SystemExit):
        parse(["--prefix-sharing", "maybe"])
    engine_line = [d for d in departures_from_paper(PRESETS["paper"], model_name="x", paper_architecture=True,
                                                    random_weights=False, policies=("fifo",), contexts_source={},
                                                    backend="gpu", prefix_sharing=True) if d.startswith("engine")]
    assert "prefix sharing on" in engine_line[0]
    assert sharing_summary({}) is None                    # a results.json from before the flag
    assert sharing_summary({"prefix_sharing": {"enabled": False, "scan": {}}}) == "Prefix sharing: off"
    line = sharing_summary({"prefix_sharing": {"enabled": True, "scan": {
        "fifo": {"shared_pages": 1200, "prefill_tokens_saved": 19200}}}})
    assert line == "Prefix sharing: on — fifo: 1,200 pages, 19,200 prefill tokens saved"
