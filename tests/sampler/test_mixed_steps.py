"""Mixed steps (issue 12, item 5): prompt chunks and decode rows in one device step (``executor.mixed_step``)
against the engine that runs them as separate prefill and decode steps. Sampling is keyed on (seed, position),
so a request's tokens do not depend on which step computed them: the two engines must give the same tokens,
finish reasons, text and scores, with log-probs equal to float rounding (the batch composition differs)."""
import dataclasses

import numpy as np
import pytest

from jaxopd_kernels import registry as kernels
from micro_models import TWO_LAYER, micro_config
from engine_requests import CharTokenizer, request_mix
from jaxopd.sampler import Engine, EngineConfig

pytestmark = pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)

VOCAB = 64
CFG = micro_config(TWO_LAYER, vocab_size=VOCAB)
MODEL_SEED = 11      # the `model` fixture (conftest): CausalLM(CFG) from this seed
BASE = EngineConfig(max_slots=8, page_size=4, num_pages=256, max_seq_len=128, prefill_chunk=16,
                    max_prefill_tokens=64, max_prefill_rows=4, eos_token_ids=(5,), attention_backend="reference")
LOGPROB_TOL = 1e-5


def requests(n, seed, score_every=0, max_new=40):
    """Staggered prompt and output lengths (prompts keep arriving while other rows decode), long prompts that take
    several chunks, stops of every kind, and every ``score_every``-th one a score request."""
    return request_mix(n, seed, vocab=VOCAB, max_prompt=50, max_new=max_new, min_new_below=8,
                       seed_base=200, score_every=score_every)


def run(model, config, reqs):
    with Engine(model, config, tokenizer=CharTokenizer()) as engine:
        engine.warmup()
        compiled = engine.compiled_count()
        results = engine.generate(reqs)
        assert engine.compiled_count() == compiled, "a step compiled after warm-up"
        stats = dict(engine.stats)
        if not config.prefix_sharing:
            assert engine.scheduler.allocator.num_used == 0
    return results, stats


def assert_equivalent(separate, mixed):
    assert [r.request_id for r in separate] == [r.request_id for r in mixed]
    worst = 0.0
    for x, y in zip(separate, mixed):
        assert x.token_ids == y.token_ids, x.request_id
        assert (x.finish_reason, x.text, x.error) == (y.finish_reason, y.text, y.error), x.request_id
        if len(x.logprobs):
            worst = max(worst, float(np.max(np.abs(x.logprobs - y.logprobs))))
    assert worst <= LOGPROB_TOL, worst
    return worst


def device_calls(stats):
    """Jitted calls of a run: a mixed step counts once for its prefill and decode halves."""
    return stats["prefill_steps"] + stats["decode_steps"] - stats["mixed_steps"]


@pytest.mark.parametrize("config", [
    BASE,
    dataclasses.replace(BASE, num_pages=40, prefix_sharing=False),   # preemption inside mixed steps
    dataclasses.replace(BASE, max_slots=3, policy="fast-first"),      # admissions wait for finishing rows
    dataclasses.replace(BASE, overlap=False),
], ids=["plain", "preemption", "few-slots", "synchronous"])
def test_mixed_engine_matches_separate_steps(model, config):
    reqs = requests(24, seed=config.num_pages + config.max_slots)
    separate, s_stats = run(model, dataclasses.replace(config, mixed_steps=False), reqs)
    mixed, m_stats = run(model, dataclasses.replace(config, mixed_steps=True), reqs)
    assert_equivalent(separate, mixed)
    assert s_stats["mixed_steps"] == 0 and m_stats["mixed_steps"] > 0
    assert device_calls(m_stats) < device_calls(s_stats)
    assert {"stop", "length"} <= {r.finish_reason for r in separate}
    if config.num_pages == 40:
        assert m_stats["preemptions"] > 0


def test_score_requests_beside_mixed_steps(model):
    """Scoring chunks run in their own step beside a mixed step; their log-probs are those of the separate
    engine, and the generation requests around them are unchanged."""
    reqs = requests(20, seed=5, score_every=3)
    separate, _ = run(model, dataclasses.replace(BASE, mixed_steps=False), reqs)
    mixed, stats = run(model, dataclasses.replace(BASE, mixed_steps=True), reqs)
    assert_equivalent(separate, mixed)
    assert stats["mixed_steps"] > 0 and stats["scored_tokens"] > 0
    assert any(r.request_id.startswith("s") and len(r.logprobs) for r in mixed)


def test_mixed_steps_on_the_in_place_kernel(model):
    """``pallas-gpu`` (Pallas interpret mode here) reads pages in place, so mixed steps are on by default; its
    outputs equal the reference backend's separate steps."""
    config = dataclasses.replace(BASE, attention_backend="pallas-gpu", max_slots=4, num_pages=96, max_seq_len=64)
    assert config.uses_mixed_steps
    reqs = requests(10, seed=9, max_new=10)
    separate, _ = run(model, dataclasses.replace(config, attention_backend="reference", mixed_steps=False), reqs)
    mixed, stats = run(model, config, reqs)
    assert stats["mixed_steps"] > 0
    assert_equivalent(separate, mixed)


def test_mixed_steps_default_follows_the_backend():
    for name in kernels.available_backends():
        config = dataclasses.replace(BASE, attention_backend=name)
        assert config.uses_mixed_steps == kernels.get_backend(name).decode_in_place, name
    assert not dataclasses.replace(BASE, attention_backend="reference").uses_mixed_steps
    assert dataclasses.replace(BASE, attention_backend="reference", mixed_steps=True).uses_mixed_steps
    assert not dataclasses.replace(BASE, attention_backend="pallas-gpu", mixed_steps=False).uses_mixed_steps
    with pytest.raises(ValueError, match="mixed_steps"):
        dataclasses.replace(BASE, mixed_steps="yes").validate()


def test_warmup_compiles_one_mixed_shape_per_prefill_shape(model):
    with Engine(model, dataclasses.replace(BASE, mixed_steps=False, scoring=False)) as plain:
        n_plain = plain.warmup()
    with Engine(model, dataclasses.replace(BASE, mixed_steps=True, scoring=False)) as mixed:
        n_mixed = mixed.warmup()
        assert n_mixed - n_plain == len(mixed.buckets.prefill_shapes())


def test_main_job_mixed_steps_flag():
    from jaxopd_experiments.actfirst_alfworld import (PRESETS, build_parser, departures_from_paper, engine_config_for,
                                                      options_from_args)
    from jaxopd_experiments.actfirst_alfworld.protocol import TaskContext

    parse = build_parser().parse_args
    modes = {flag: options_from_args(parse(["--preset", "cpu", "--mixed-steps", flag, "--out", "x"])).mixed_steps
             for flag in ("auto", "on", "off")}
    assert modes == {"auto": None, "on": True, "off": False}
    assert options_from_args(parse(["--preset", "cpu", "--out", "x"])).mixed_steps is None
    with pytest.raises(SystemExit):
        parse(["--mixed-steps", "maybe"])
    context = TaskContext(index=0, context_id="c0", task_type="pick", full_prompt_ids=(1,) * 40,
                          fast_prompt_ids=(1,) * 30)
    for mixed in (None, True, False):
        config = engine_config_for(PRESETS["cpu"], [context], "fifo", mixed_steps=mixed)
        assert config.mixed_steps is mixed
    line = [d for d in departures_from_paper(PRESETS["paper"], model_name="x", paper_architecture=True,
                                             random_weights=False, policies=("fifo",), contexts_source={},
                                             backend="gpu", mixed_steps=True) if d.startswith("engine")][0]
    assert "mixed prefill + decode steps on" in line
