"""Scoring requests (``Request.scoring``): the paged-cache log-probs of a given completion against a dense
recompute (``DenseTeacherScorer``), prefix-page sharing, no recompilation after warm-up, validation, and the
engine-backed ``EngineTeacherScorer``."""
import numpy as np
import pytest

from micro_models import MEDIUM, micro_config
from jaxopd.rollout.scoring import DenseTeacherScorer, EngineTeacherScorer, TeacherScorer
from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams

VOCAB = 512
CFG = micro_config(MEDIUM, vocab_size=VOCAB)
MODEL_SEED = 5      # the `model` fixture (conftest): CausalLM(CFG) from this seed
ENGINE = EngineConfig(max_slots=8, page_size=8, num_pages=256, max_seq_len=160, prefill_chunk=32,
                      max_prefill_tokens=128, eos_token_ids=())
TOL = 1e-4


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, ENGINE) as eng:
        eng.warmup()
        yield eng


def cases(seed, n=8):
    """(prompt, completion): chunked prompts, page-aligned ones, one-token prompts and completions."""
    rng = np.random.default_rng(seed)
    lengths = [(1, 1), (8, 8), (16, 5), (7, 40), (33, 17), (64, 64), (100, 30), (5, 120)]
    return [(rng.integers(0, VOCAB, p).tolist(), rng.integers(0, VOCAB, c).tolist()) for p, c in lengths[:n]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_score_matches_dense_recompute(model, engine, temperature):
    dense = DenseTeacherScorer(model, temperature=temperature, length_multiple=64)
    futures = [(p, c, engine.submit(Request.scoring(p, c, temperature=temperature))) for p, c in cases(1)]
    worst = 0.0
    for prompt, completion, future in futures:
        result = future.result(120)
        assert result.finish_reason == "length" and result.token_ids == completion
        assert result.prompt_ids == tuple(prompt) and result.kind == "score"
        want = dense.score(prompt, completion)
        worst = max(worst, float(np.max(np.abs(result.logprobs - want))))
    print(f"max |engine score - dense| at T={temperature}: {worst:.2e}")
    assert worst <= TOL
    assert engine.wait_idle(30) and engine.scheduler.allocator.num_used == 0


def test_score_shares_prefix_pages_and_stays_exact(model, engine):
    dense = DenseTeacherScorer(model, length_multiple=64)
    rng = np.random.default_rng(7)
    context = rng.integers(0, VOCAB, 48).tolist()
    completions = [rng.integers(0, VOCAB, n).tolist() for n in (3, 12, 30, 1)]
    engine.submit(Request(context, SamplingParams(max_new_tokens=4, seed=1))).result(60)   # caches 6 pages
    before = dict(engine.stats)
    results = [engine.submit(Request.scoring(context, c)).result(60) for c in completions]
    assert engine.stats["shared_pages"] - before["shared_pages"] == 5 * len(completions)   # (48-1)//8 pages
    assert engine.stats["prefill_tokens_saved"] - before["prefill_tokens_saved"] == 40 * len(completions)
    for completion, result in zip(completions, results):
        assert np.max(np.abs(result.logprobs - dense.score(context, completion))) <= TOL
    assert engine.wait_idle(30) and engine.scheduler.allocator.num_used == 0


def test_no_recompilation_after_warmup(engine):
    compiled = engine.compiled_count()
    rng = np.random.default_rng(11)
    futures = [engine.submit(Request.scoring(rng.integers(0, VOCAB, p).tolist(), rng.integers(0, VOCAB, c).tolist()))
               for p, c in [(3, 2), (50, 90), (120, 40), (9, 9), (31, 1)]]
    futures += [engine.submit(Request(rng.integers(0, VOCAB, 20).tolist(), SamplingParams(max_new_tokens=5)))]
    for f in futures:
        f.result(120)
    assert engine.compiled_count() == compiled


def test_engine_teacher_scorer_matches_dense(model, engine):
    scorer = EngineTeacherScorer(engine)
    assert isinstance(scorer, TeacherScorer)
    dense = DenseTeacherScorer(model, length_multiple=64)
    for prompt, completion in cases(3, n=6):
        got = scorer.score(prompt, completion)
        assert got.dtype == np.float32 and got.shape == (len(completion),)
        assert np.max(np.abs(got - dense.score(prompt, completion))) <= TOL
    assert scorer.score([1, 2, 3], []).shape == (0,)


def test_score_request_validation(model, engine):
    with pytest.raises(ValueError, match="score_ids"):
        engine.submit(Request([1, 2], SamplingParams(max_new_tokens=1), score_ids=[]))
    with pytest.raises(ValueError, match="score_ids"):
        engine.submit(Request.scoring([1, 2], [VOCAB]))
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.submit(Request.scoring([1] * 100, [2] * 61))
    no_scoring = Engine(model, EngineConfig(**{**ENGINE.__dict__, "scoring": False}))
    with pytest.raises(ValueError, match="scoring"):
        no_scoring.submit(Request.scoring([1, 2], [3]))
