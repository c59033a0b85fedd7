"""The paged-KV sampler against a dense no-cache recompute: exactness, preemption, determinism,
no recompilation, scheduling policy, bad input, stop conditions, abort, thinking budget."""
import asyncio
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from micro_models import MEDIUM, micro_config
from jaxopd.rollout.thinking import ThinkingBudget, submit_budgeted
from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams
from jaxopd.sampler.allocator import OutOfPages, PageAllocator
from jaxopd.sampler.sampling import counter_uniform, sample_tokens

VOCAB = 512
MAX_SEQ = 400
CFG = micro_config(MEDIUM, vocab_size=VOCAB)
MODEL_SEED = 3      # the `model` fixture (conftest): CausalLM(CFG) from this seed
ENGINE = EngineConfig(max_slots=32, page_size=16, num_pages=1024, max_seq_len=MAX_SEQ, prefill_chunk=128,
                      max_prefill_tokens=512, eos_token_ids=())


@pytest.fixture(scope="module")
def dense_logits(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens):
        return nnx.merge(graphdef, state)(tokens)[0]

    def run(ids):
        buf = np.zeros((1, MAX_SEQ), np.int32)   # one width: one compilation
        buf[0, :len(ids)] = ids
        return np.asarray(forward(state, jnp.asarray(buf)))[:len(ids)]
    return run


def mixed_requests(n, seed, *, max_new=(4, 24)):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(1, 301))).tolist()
        new = int(rng.integers(*max_new))
        greedy = i % 2 == 0
        params = SamplingParams(max_new_tokens=new, min_new_tokens=new, temperature=0.0 if greedy else 0.8,
                                top_p=1.0 if i % 4 else 0.9, seed=1000 + i)
        out.append(Request(prompt, params, kind="fast" if i % 3 == 0 else "full"))
    return out


def assert_matches_dense(requests, results, dense_logits):
    for req, res in zip(requests, results):
        n = len(req.prompt_ids)
        assert len(res.token_ids) == req.params.max_new_tokens
        logits = dense_logits(list(req.prompt_ids) + res.token_ids)
        temperature = req.params.temperature or 1.0
        logp = jax.nn.log_softmax(logits[n - 1:-1] / temperature, axis=-1)
        expected = np.asarray(logp)[np.arange(len(res.token_ids)), res.token_ids]
        np.testing.assert_allclose(res.logprobs, expected, atol=1e-4, rtol=0)
        if req.params.temperature == 0:   # greedy: every token is the dense argmax of its prefix
            assert res.token_ids == np.argmax(logits[n - 1:-1], axis=-1).tolist()


@pytest.mark.parametrize("mixed_steps,length_step", [(False, None), (True, None), (False, 48)],
                         ids=["separate-steps", "mixed-steps", "length-step"])
def test_concurrent_mixed_requests_match_dense_recompute(model, dense_logits, mixed_steps, length_step):
    requests = mixed_requests(28, seed=0)
    config = dataclasses.replace(ENGINE, mixed_steps=mixed_steps, prefill_length_step=length_step)
    with Engine(model, config) as engine:
        results = engine.generate(requests)
        assert engine.stats["prefill_steps"] > 0 and engine.stats["decode_steps"] > 0
        assert (engine.stats["mixed_steps"] > 0) == mixed_steps
        stats = engine.stats
    # every prompt token is prefilled once (no prefix shared here), padded to the buckets
    assert stats["prefill_tokens_saved"] == 0
    assert stats["prefill_tokens"] == sum(len(r.prompt_ids) for r in requests)
    assert stats["prefill_padded_tokens"] >= stats["prefill_tokens"]
    assert {r.kind for r in results} == {"fast", "full"}
    assert max(len(r.prompt_ids) for r in results) > ENGINE.prefill_chunk   # chunked prefill happened
    assert_matches_dense(requests, results, dense_logits)


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
@pytest.mark.parametrize("mixed_steps", [False, True], ids=["separate-steps", "mixed-steps"])
def test_preemption_keeps_outputs_exact(model, dense_logits, mixed_steps):
    small_pool = EngineConfig(max_slots=8, page_size=16, num_pages=60, max_seq_len=MAX_SEQ, prefill_chunk=128,
                              max_prefill_tokens=512, eos_token_ids=(), mixed_steps=mixed_steps)
    requests = mixed_requests(24, seed=1, max_new=(30, 60))
    with Engine(model, small_pool) as engine:
        results = engine.generate(requests)
        assert engine.stats["preemptions"] > 0
        assert engine.scheduler.allocator.num_used == 0       # every page came back
    assert any(r.num_preemptions for r in results)
    assert_matches_dense(requests, results, dense_logits)


def test_same_output_alone_and_in_a_batch(model):
    requests = mixed_requests(12, seed=2)
    with Engine(model, ENGINE) as engine:
        batch = engine.generate(requests)
        again = engine.generate(mixed_requests(12, seed=2))
        alone = engine.generate([mixed_requests(12, seed=2)[0]])[0]
    assert [r.token_ids for r in batch] == [r.token_ids for r in again]   # sampled too: same seed, same batch
    np.testing.assert_allclose(batch[0].logprobs, again[0].logprobs, atol=1e-6)
    assert requests[0].params.temperature == 0 and alone.token_ids == batch[0].token_ids


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
def test_no_recompilation_after_warmup(model):
    rng = np.random.default_rng(5)
    with Engine(model, ENGINE) as engine:
        engine.warmup()
        before = engine.compiled_count()
        futures = []
        for i in range(200):
            prompt = rng.integers(0, VOCAB, size=int(rng.integers(1, 350))).tolist()
            new = int(rng.integers(1, MAX_SEQ - len(prompt) + 1)) if i % 10 == 0 else int(rng.integers(1, 12))
            futures.append(engine.submit(Request(prompt, SamplingParams(max_new_tokens=new, temperature=1.0,
                                                                        top_k=int(i % 3 == 0) * 7, seed=i))))
        results = [f.result() for f in futures]
        assert engine.compiled_count() == before
    assert all(r.finish_reason == "length" for r in results)


def test_fast_first_admits_fast_ahead_of_waiting_full(model):
    full = SamplingParams(max_new_tokens=20, min_new_tokens=20, temperature=0.0)
    fast = SamplingParams(max_new_tokens=4, min_new_tokens=4, temperature=0.0)
    order = {}
    for policy in ("fifo", "fast-first"):
        config = EngineConfig(**{**ENGINE.__dict__, "policy": policy, "record_events": True, "max_slots": 8})
        engine = Engine(model, config)
        engine.max_concurrency = 4
        with engine:
            fulls = [engine.submit(Request([1, 2, 3, i], full, kind="full", request_id=f"full-{i}"))
                     for i in range(8)]
            while sum(e.event == "first_token" for e in list(engine.events)) < 4:   # b_max saturated
                threading.Event().wait(0.005)
            fast_future = engine.submit(Request([4, 5, 6], fast, kind="fast", request_id="fast"))
            [f.result() for f in fulls + [fast_future]]
        admits = [e.request_id for e in engine.events if e.event == "admit"]
        order[policy] = admits
        running = 0
        for e in engine.events:   # the cap holds at every moment
            running += {"admit": 1, "finish": -1}.get(e.event, 0)
            assert running <= 4
    assert order["fifo"] == [f"full-{i}" for i in range(8)] + ["fast"]
    # fast-first: b_max saturated by four full responses; the fast request takes the next free slot,
    # ahead of the four full responses still waiting.
    assert order["fast-first"][:4] == [f"full-{i}" for i in range(4)]
    assert order["fast-first"][4] == "fast"


@pytest.mark.parametrize("request_kwargs,message", [
    (dict(prompt_ids=[], params=SamplingParams(max_new_tokens=4)), "prompt_ids is empty"),
    (dict(prompt_ids=[1] * 390, params=SamplingParams(max_new_tokens=20)),
     "prompt of 390 tokens \\+ max_new_tokens 20 exceeds max_seq_len 400"),
    (dict(prompt_ids=[1], params=SamplingParams(max_new_tokens=0)), "max_new_tokens must be a positive integer"),
    (dict(prompt_ids=[1], params=SamplingParams(max_new_tokens=-3)), "max_new_tokens must be a positive integer"),
    (dict(prompt_ids=[1], params=SamplingParams(max_new_tokens=4, temperature=-0.5)), "temperature must be >= 0"),
    (dict(prompt_ids=[1], params=SamplingParams(max_new_tokens=4, top_p=0.0)), "top_p must be in \\(0, 1\\]"),
    (dict(prompt_ids=[1], params=SamplingParams(max_new_tokens=4, top_p=1.5)), "top_p must be in \\(0, 1\\]"),
    (dict(prompt_ids=[1], params=SamplingParams(max_new_tokens=4, min_new_tokens=9)), "min_new_tokens \\(9\\)"),
    (dict(prompt_ids=[1, VOCAB], params=SamplingParams(max_new_tokens=4)), "prompt_ids must be integers in"),
    (dict(prompt_ids=[1], params=SamplingParams(max_new_tokens=4), kind=""), "kind must be a non-empty string tag"),
])
def test_bad_input_is_rejected_while_others_complete(model, request_kwargs, message):
    good = SamplingParams(max_new_tokens=6, temperature=0.0)
    with Engine(model, ENGINE) as engine:
        before = engine.submit(Request([1, 2, 3], good))
        with pytest.raises(ValueError, match=message):
            engine.submit(Request(**request_kwargs))
        after = engine.submit(Request([3, 2, 1], good))
        assert len(before.result().token_ids) == 6 and len(after.result().token_ids) == 6


class CharTokenizer:
    """Token t decodes to one letter; enough to exercise stop strings."""

    def decode(self, ids):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)

    def encode(self, text):
        return [ord(c) - ord("a") for c in text]


def test_stop_tokens_respect_min_new_tokens_and_stop_strings_are_kept(model):
    with Engine(model, ENGINE, tokenizer=CharTokenizer()) as engine:
        free = engine.submit(Request([7, 8, 9], SamplingParams(max_new_tokens=30, temperature=0.0))).result()
        stop_token = free.token_ids[2]
        first = free.token_ids.index(stop_token)
        stopped = engine.submit(Request([7, 8, 9], SamplingParams(
            max_new_tokens=30, temperature=0.0, stop_token_ids=(stop_token,)))).result()
        assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]
        late = engine.submit(Request([7, 8, 9], SamplingParams(
            max_new_tokens=30, min_new_tokens=first + 2, temperature=0.0, stop_token_ids=(stop_token,)))).result()
        later = [i for i, t in enumerate(free.token_ids) if t == stop_token and i + 1 >= first + 2]
        expected_len = later[0] + 1 if later else 30
        assert late.token_ids == free.token_ids[:expected_len]
        text = CharTokenizer().decode(free.token_ids)
        stop = text[5:7]
        cut = text.index(stop) + len(stop)
        by_string = engine.submit(Request([7, 8, 9], SamplingParams(
            max_new_tokens=30, temperature=0.0, stop_strings=(stop,)))).result()
        assert by_string.finish_reason == "stop"
        assert by_string.text == text[:cut] and by_string.text.endswith(stop)


def test_stop_strings_need_a_tokenizer(model):
    engine = Engine(model, ENGINE)
    with pytest.raises(ValueError, match="stop_strings need an engine created with a tokenizer"):
        engine.submit(Request([1], SamplingParams(max_new_tokens=3, stop_strings=("</action>",))))


def test_abort_frees_pages_and_returns_partial_result(model):
    with Engine(model, ENGINE) as engine:
        long = engine.submit(Request(list(range(50)), SamplingParams(max_new_tokens=300, temperature=1.0),
                                     request_id="long"))
        while engine.stats["generated_tokens"] < 5:
            threading.Event().wait(0.01)
        engine.abort("long")
        result = long.result(timeout=60)
        assert result.finish_reason == "abort" and len(result.token_ids) < 300
        assert engine.wait_idle(10)
        assert engine.scheduler.allocator.num_used == 0


def test_asyncio_submission(model):
    async def main(engine):
        reqs = [Request([1, 2, i], SamplingParams(max_new_tokens=5, temperature=0.0)) for i in range(4)]
        return await asyncio.gather(*(engine.submit_async(r) for r in reqs))

    with Engine(model, ENGINE) as engine:
        results = asyncio.run(main(engine))
    assert [len(r.token_ids) for r in results] == [5] * 4
    assert all(r.timings.total >= r.timings.decode >= 0 and r.timings.queued >= 0 for r in results)


# -------------------------------------------------------------------------------------------- sampling
def test_sampling_distribution_with_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.15, 0.1, 0.05]] * 3))
    n = 20000
    rows = jnp.repeat(logits, n // 3 + 1, axis=0)[:n]
    kinds = np.arange(n) % 3   # 0: plain, 1: top_k=2, 2: top_p=0.8
    top_k = jnp.asarray(np.where(kinds == 1, 2, 0), jnp.int32)
    top_p = jnp.asarray(np.where(kinds == 2, 0.8, 1.0), jnp.float32)
    tokens, logprobs = jax.jit(sample_tokens)(rows, jnp.ones(n), top_p, top_k,
                                              jnp.arange(n, dtype=jnp.uint32), jnp.full(n, 17, jnp.int32))
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    expected = {0: [0.4, 0.3, 0.15, 0.1, 0.05], 1: [4 / 7, 3 / 7, 0, 0, 0],
                2: [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]}
    for kind, probs in expected.items():
        freq = np.bincount(tokens[kinds == kind], minlength=5) / (kinds == kind).sum()
        np.testing.assert_allclose(freq, probs, atol=0.02)
    # reported log-probabilities are before truncation
    np.testing.assert_allclose(logprobs, np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05]))[tokens], atol=1e-5)


def test_temperature_scales_logprobs_and_greedy_is_argmax():
    logits = jnp.array([[2.0, 1.0, 0.5, -1.0]])
    for t in (0.5, 2.0):
        tok, lp = sample_tokens(logits, jnp.array([t]), jnp.ones(1), jnp.zeros(1, jnp.int32),
                                jnp.zeros(1, jnp.uint32), jnp.zeros(1, jnp.int32))
        assert float(lp[0]) == pytest.approx(float(jax.nn.log_softmax(logits[0] / t)[tok[0]]), abs=1e-6)
    tok, _ = sample_tokens(logits, jnp.zeros(1), jnp.ones(1), jnp.zeros(1, jnp.int32),
                           jnp.zeros(1, jnp.uint32), jnp.zeros(1, jnp.int32))
    assert int(tok[0]) == 0


def test_counter_uniform_is_uniform_and_deterministic():
    seeds = jnp.repeat(jnp.arange(100, dtype=jnp.uint32), 100)
    positions = jnp.tile(jnp.arange(100, dtype=jnp.int32), 100)
    u = np.asarray(counter_uniform(seeds, positions))
    assert 0 <= u.min() and u.max() < 1
    hist = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(hist - 1000) < 150)
    assert len(np.unique(u)) > 9990
    np.testing.assert_array_equal(u, np.asarray(counter_uniform(seeds, positions)))


# -------------------------------------------------------------------------------------------- allocator
def test_allocator_reference_counts_and_exhaustion():
    alloc = PageAllocator(6)
    a = alloc.allocate(3)
    assert 0 not in a and alloc.num_free == 2
    alloc.share(a[:2])                       # a second request shares a two-page prefix
    alloc.release(a)                         # the first request finishes
    assert alloc.num_free == 3 and alloc.refcount(a[0]) == 1 and alloc.refcount(a[2]) == 0
    with pytest.raises(OutOfPages):
        alloc.allocate(4)
    assert alloc.num_free == 3               # all or nothing
    alloc.release(a[:2])
    assert alloc.num_free == 5
    with pytest.raises(ValueError, match="released more often than allocated"):
        alloc.release([a[0]])


# -------------------------------------------------------------------------------------------- thinking budget
class ScriptedTokenizer:
    """Tokens are words of a fixed vocabulary so tests can script what 'the model' wrote."""

    WORDS = ["<think>", "</think>", "<action>", "</action>", "x", "\n", "stop", "go"]

    def decode(self, ids):
        return "".join(self.WORDS[int(t)] if int(t) < len(self.WORDS) else "x" for t in ids)

    def encode(self, text):
        out = []
        while text:
            for i, w in enumerate(self.WORDS):
                if text.startswith(w):
                    out.append(i)
                    text = text[len(w):]
                    break
            else:
                out.append(4)   # anything else becomes "x"
                text = text[1:]
        return out


def test_thinking_budget_inserts_early_stop_and_masks_it(model):
    tok = ScriptedTokenizer()
    budget = ThinkingBudget(first_stage_tokens=12, total_tokens=40, second_stage_max_tokens=10)
    with Engine(model, ENGINE) as engine:
        # a random model over 512 ids rarely emits id 1 ("</think>") at the right place: the first stage
        # runs out of budget inside the reasoning, so the early-stop text with </think> is inserted.
        params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=3)
        response = submit_budgeted(engine, tok, [0, 5, 4, 4], params, budget,
                                   early_stop_text=lambda ended: "stop" + ("" if ended else "</think>")).result()
    first, second = response.stages
    assert first.finish_reason == "length" and len(first.token_ids) == 12
    first_text = tok.decode(first.token_ids)
    assert "</think>" not in first_text   # this seed's first stage stops inside the reasoning
    inserted = tok.encode("stop</think>")
    assert response.inserted_text == "stop</think>"
    n1 = len(first.token_ids)
    assert response.token_ids[n1:n1 + len(inserted)] == inserted
    assert response.model_generated.tolist() == [True] * n1 + [False] * len(inserted) + [True] * len(second.token_ids)
    assert len(second.token_ids) == min(10, 40 - n1 - len(inserted))
    assert second.prompt_ids == tuple([0, 5, 4, 4] + first.token_ids + inserted)
    np.testing.assert_array_equal(response.logprobs[n1 + len(inserted):], second.logprobs)


def test_thinking_budget_insertion_rules():
    from jaxopd.rollout.thinking import _insertion
    text = lambda ended: "E" if ended else "E</think>"
    assert _insertion("<think>reasoning", text) == "E</think>"
    assert _insertion("<think>reasoning</think>\n\n", text) == "E"
    assert _insertion("<think>r</think><action>go to", text) == ""
    with pytest.raises(ValueError, match="first_stage_tokens"):
        ThinkingBudget(first_stage_tokens=600, total_tokens=512)


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
def test_two_level_vocabulary_scans_match_plain_ones():
    from jaxopd.sampler.sampling import blocked_argmax, inverse_cdf_sample, truncate_top_k_top_p

    rng = np.random.default_rng(0)
    for vocab in (7, 4099, 151_936):          # single block, padded blocks, divisor blocks
        logits = jnp.asarray(rng.normal(size=(5, vocab)).astype(np.float32) * 3)
        np.testing.assert_array_equal(np.asarray(blocked_argmax(logits)), np.asarray(jnp.argmax(logits, -1)))
        probs = np.asarray(jax.nn.softmax(logits, -1), np.float64)
        probs[:, ::3] = 0.0                     # zero-probability tokens are never drawn
        u = rng.uniform(size=5)
        tokens = np.asarray(inverse_cdf_sample(jnp.asarray(probs, jnp.float32), jnp.asarray(u, jnp.float32)))
        cdf = np.cumsum(probs, -1)
        expected = np.array([np.searchsorted(cdf[r], u[r] * cdf[r, -1], side="right") for r in range(5)])
        assert np.all(np.abs(tokens - expected) <= 1) and np.all(probs[np.arange(5), tokens] > 0)
        logp = jax.nn.log_softmax(logits, -1)
        kept = np.asarray(truncate_top_k_top_p(logp, jnp.array([3, 0, 0, 1, 5]),
                                               jnp.array([1.0, 0.5, 0.95, 1.0, 0.3])) > 0)
        order = np.argsort(-np.asarray(logp), -1)
        sorted_p = np.take_along_axis(np.exp(np.asarray(logp)), order, -1)
        n_p = lambda row, p, sorted_p=sorted_p: int(np.sum(np.cumsum(sorted_p[row]) - sorted_p[row] < p))
        expected_kept = np.array([min(3, vocab), n_p(1, 0.5), n_p(2, 0.95), 1, min(5, n_p(4, 0.3))])
        assert np.all(np.abs(kept.sum(-1) - expected_kept) <= 1)   # float32 mass sums may differ by a token
        assert n_p(2, 0.95) > 1
