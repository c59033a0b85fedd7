"""Regression tests of the engine defects of issue 15 (items 1-11), through the public API.

Two engines per module: ``real`` serves a tiny Qwen3 on a small configuration, warmed up once (4 shapes);
``scripted`` is an engine whose jitted steps are replaced by a script (``Script``: the token each request
samples next is fixed by the test), so that host-side behaviour (stop strings, errors, versions, aborts)
is tested exactly and without compiling anything.
"""
import asyncio
import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopd.models.decoder import CausalLM
from micro_models import SMALL, micro_config
from jaxopd.rollout.thinking import ThinkingBudget, submit_budgeted
from jaxopd.sampler import Engine, EngineConfig, Request, SamplingParams, SimulatedEngine
from jaxopd.sampler.buckets import Buckets

CFG = micro_config(SMALL, vocab_size=64)
MODEL_SEED = 0      # the `model` fixture (conftest): CausalLM(CFG) from this seed
# decode (4 rows, 4 pages); prefill (1, 16), (1, 32), (2, 16): four compilations in all
REAL = EngineConfig(max_slots=4, page_size=16, num_pages=32, max_seq_len=64, prefill_chunk=32,
                    max_prefill_tokens=32, max_prefill_rows=4, eos_token_ids=())
SCRIPTED = EngineConfig(max_slots=8, page_size=4, num_pages=1024, max_seq_len=512, prefill_chunk=16,
                        max_prefill_tokens=64, eos_token_ids=())
POISON = 999          # a token id the test tokenizers refuse to decode
FILLER = 23           # what a script emits after its last scripted token ("x")


# ------------------------------------------------------------------------------------------------ helpers
class CharTokenizer:
    """Token t < 26 is one letter ("a" + t); ``words`` maps other ids to longer strings; POISON raises."""

    def __init__(self, words=None):
        self.words = dict(words or {})

    def decode(self, ids):
        out = []
        for t in ids:
            t = int(t)
            if t == POISON:
                raise RuntimeError(f"cannot decode token {POISON}")
            out.append(self.words.get(t, chr(ord("a") + t % 26)))
        return "".join(out)

    def encode(self, text):
        return [ord(c) - ord("a") for c in text]


class Script:
    """Stands in for the executor's jitted steps. A request whose prompt starts with ``key`` (registered with
    ``set``) samples ``tokens[i]`` as its i-th output token (``FILLER`` past the end), whatever the batch or
    preemptions. ``hook(kind)``, if set, runs on the engine thread before every step."""

    def __init__(self, engine):
        self.engine = engine
        self.outputs: dict[int, tuple[int, list[int]]] = {}
        self.page_key: dict[int, int] = {}
        self.hook = None
        self.steps = 0
        engine.executor.prefill = self.prefill
        engine.executor.decode = self.decode

    def set(self, key: int, prompt_len: int, tokens) -> list[int]:
        self.outputs[key] = (prompt_len, [int(t) for t in tokens])
        return [key] + [1] * (prompt_len - 1)

    def _token(self, key: int, position: int) -> int:
        prompt_len, tokens = self.outputs[key]
        index = position - prompt_len
        return tokens[index] if 0 <= index < len(tokens) else FILLER   # index < 0: a chunk inside the prompt

    def prefill(self, batch):
        self.steps += 1
        if self.hook:
            self.hook("prefill")
        out = np.zeros(batch.tokens.shape[0], np.int64)
        for i in range(batch.tokens.shape[0]):
            if batch.lengths[i] == 0:
                continue
            if batch.starts[i] == 0:
                self.page_key[int(batch.page_table[i, 0])] = int(batch.tokens[i, 0])
            key = self.page_key[int(batch.page_table[i, 0])]
            out[i] = self._token(key, int(batch.starts[i] + batch.lengths[i]))
        return out, np.zeros(len(out), np.float32)

    def decode(self, batch):
        self.steps += 1
        if self.hook:
            self.hook("decode")
        out = np.zeros(batch.tokens.shape[0], np.int64)
        for i in range(batch.tokens.shape[0]):
            if batch.active[i]:
                out[i] = self._token(self.page_key[int(batch.page_table[i, 0])], int(batch.positions[i]) + 1)
        return out, np.zeros(len(out), np.float32)


@pytest.fixture(scope="module")
def real(model):
    engine = Engine(model, REAL).start()
    engine.warmup()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def scripted_engine(model):
    engine = Engine(model, SCRIPTED, tokenizer=CharTokenizer())
    script = Script(engine)
    engine.start()
    yield engine, script
    engine.stop()


@pytest.fixture
def scripted(scripted_engine):
    """The scripted engine and its script, reset after the test (tokenizer, hook)."""
    engine, script = scripted_engine
    tokenizer = engine.tokenizer
    yield engine, script
    script.hook = None
    engine.tokenizer = tokenizer
    assert engine.wait_idle(10)


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from jaxopd.tokenizer import Qwen3Tokenizer
    return Qwen3Tokenizer()


def params(n, **kw):
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_new_tokens=n, **kw)


def assert_engine_serves(engine, script=None, key=60):
    """The engine thread is alive and a fresh request completes."""
    assert engine._thread is not None and engine._thread.is_alive()
    prompt = script.set(key, 3, [4, 5, 6]) if script else [1, 2, 3]
    result = engine.submit(Request(prompt, params(3))).result(timeout=60)
    assert result.finish_reason == "length" and len(result.token_ids) == 3
    assert engine.wait_idle(10)


# ------------------------------------------------------------------------------ 1. host-side errors
def test_decode_error_at_finish_fails_only_its_request(scripted):
    engine, script = scripted
    bad = engine.submit(Request(script.set(1, 3, [3, 4, POISON, 5]), params(6)))
    good = [engine.submit(Request(script.set(k, 3, [k, k + 1]), params(6))) for k in (2, 3)]
    result = bad.result(timeout=10)
    assert result.finish_reason == "error" and f"cannot decode token {POISON}" in result.error
    assert result.token_ids == [3, 4, POISON, 5, FILLER, FILLER] and result.text == ""
    for future in good:
        r = future.result(timeout=10)
        assert r.finish_reason == "length" and r.error is None and r.text == CharTokenizer().decode(r.token_ids)
    assert engine.wait_idle(10)
    assert_engine_serves(engine, script)


def test_stop_string_check_error_fails_only_its_request(scripted):
    engine, script = scripted
    bad = engine.submit(Request(script.set(1, 3, [3, POISON, 5]), params(8, stop_strings=("zz",))))
    stopping = engine.submit(Request(script.set(2, 3, [0, 1, 2, 3]), params(8, stop_strings=("cd",))))
    plain = engine.submit(Request(script.set(3, 3, [4, 4]), params(8, stop_strings=("zz",))))
    r = bad.result(timeout=10)
    assert r.finish_reason == "error" and "cannot decode" in r.error and r.token_ids == [3, POISON]
    r = stopping.result(timeout=10)
    assert r.finish_reason == "stop" and r.text == "abcd"
    assert plain.result(timeout=10).finish_reason == "length"
    assert_engine_serves(engine, script)


def test_error_while_aborting_fails_only_that_request(scripted):
    engine, script = scripted
    script.hook = lambda kind: time.sleep(0.002)
    future = engine.submit(Request(script.set(1, 3, [3, POISON]), params(400), request_id="poisoned"))
    while script.steps < 5 or not engine.scheduler.running:
        time.sleep(0.005)
    engine.abort("poisoned")
    r = future.result(timeout=10)
    assert r.finish_reason == "error" and "cannot decode" in r.error and len(r.token_ids) < 400
    script.hook = None
    assert engine.wait_idle(10) and engine.scheduler.allocator.num_used == 0
    assert_engine_serves(engine, script)


def test_failed_step_fails_its_requests_with_error_results(scripted):
    engine, script = scripted
    failures = []

    def hook(kind):
        if kind == "decode" and not failures:
            failures.append(kind)
            raise RuntimeError("device lost")
    script.hook = hook
    future = engine.submit(Request(script.set(1, 3, [3, 4]), params(5)))
    r = future.result(timeout=10)
    assert r.finish_reason == "error" and "device lost" in r.error
    assert_engine_serves(engine, script)


def test_failure_while_admitting_fails_that_request_instead_of_spinning(scripted, monkeypatch):
    """A step that fails before anything runs (here: in admission) used to repeat forever, logging each time."""
    engine, script = scripted
    scheduler = engine.scheduler
    original = scheduler.admit
    calls = []

    def admit(now):
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("admission bug")
        return original(now)
    monkeypatch.setattr(scheduler, "admit", admit)
    r = engine.submit(Request(script.set(1, 3, [3, 4]), params(5))).result(timeout=10)
    assert r.finish_reason == "error" and "admission bug" in r.error
    assert len(calls) < 5
    monkeypatch.setattr(scheduler, "admit", original)
    assert_engine_serves(engine, script)


def test_padding_ids_of_a_random_qwen3_never_break_requests(scripted, qwen_tokenizer):
    """The README setup: a random 151,936-row model samples ids 151,669..151,935 with the built-in tokenizer."""
    engine, script = scripted
    engine.tokenizer = qwen_tokenizer
    rng = np.random.default_rng(0)
    futures = []
    action = qwen_tokenizer.encode("go east</action>")
    for key in range(1, 13):
        padding = rng.integers(151_669, 151_936, size=10).tolist()
        tokens = padding[:5] + (action if key % 2 else []) + padding[5:]
        futures.append(engine.submit(Request(script.set(key, 4, tokens),
                                             params(20, stop_strings=("</action>",)))))
    for key, future in enumerate(futures, start=1):
        r = future.result(timeout=10)
        assert r.error is None and r.finish_reason == ("stop" if key % 2 else "length")
        assert r.text == qwen_tokenizer.decode(r.token_ids)
    assert qwen_tokenizer.decode(padding) == ""
    assert engine.wait_idle(10)


# ------------------------------------------------------------------------------ 2. validation at submit
BAD_PARAMS = [
    (dict(seed=1.5), "seed"), (dict(seed="7"), "seed"), (dict(seed=True), "seed"), (dict(seed=-1), "seed"),
    (dict(seed=2 ** 32), "seed"),
    (dict(top_k=2 ** 40), "top_k"), (dict(top_k=65), "top_k"), (dict(top_k=True), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(stop_token_ids=None), "stop_token_ids"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids="ab"), "stop_token_ids"), (dict(stop_token_ids=(1.5,)), "stop_token_ids"),
    (dict(stop_token_ids=(64,)), "stop_token_ids"), (dict(stop_token_ids=(True,)), "stop_token_ids"),
    (dict(stop_strings="zc"), "stop_strings"), (dict(stop_strings=None), "stop_strings"),
    (dict(stop_strings=("",)), "stop_strings"), (dict(stop_strings=(5,)), "stop_strings"),
    (dict(temperature="1"), "temperature"), (dict(temperature=None), "temperature"),
    (dict(temperature=True), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p="0.9"), "top_p"), (dict(top_p=True), "top_p"),
    (dict(max_new_tokens=True), "max_new_tokens"), (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(min_new_tokens=True), "min_new_tokens"), (dict(min_new_tokens=1.5), "min_new_tokens"),
]


@pytest.mark.parametrize("bad,field", BAD_PARAMS,
                         ids=[f"{k}={v!r}" for (d, _) in BAD_PARAMS for k, v in d.items()])
def test_every_sampling_field_is_checked_at_submit(scripted, bad, field):
    engine, script = scripted
    fields = dict(max_new_tokens=4, temperature=1.0, stop_strings=("q",))
    fields.update(bad)
    with pytest.raises(ValueError, match=field):
        engine.submit(Request([1, 2], SamplingParams(**fields)))
    assert_engine_serves(engine, script)


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt_ids=[1.5]), "prompt_ids"), (dict(prompt_ids=[True]), "prompt_ids"),
    (dict(prompt_ids="abc"), "prompt_ids"), (dict(prompt_ids=[2 ** 70]), "prompt_ids"),
    (dict(priority="high"), "priority"),
    (dict(priority=True), "priority"), (dict(params={"max_new_tokens": 3}), "params"),
])
def test_request_fields_are_checked_at_submit(scripted, kwargs, field):
    engine, _ = scripted
    fields = dict(prompt_ids=[1, 2], params=params(3))
    fields.update(kwargs)
    with pytest.raises(ValueError, match=field):
        engine.submit(Request(**fields))


def test_bare_stop_string_is_rejected_with_a_clear_message(scripted):
    engine, _ = scripted
    with pytest.raises(ValueError, match=r"not the bare string 'zc'.*\('zc',\)|\('zc',\).*bare string"):
        engine.submit(Request([1], params(3, stop_strings="zc")))


def test_numpy_scalars_and_arrays_are_accepted(scripted):
    engine, script = scripted
    p = SamplingParams(max_new_tokens=np.int64(4), min_new_tokens=np.int32(1), temperature=np.float32(0.0),
                       top_p=np.float64(1.0), top_k=np.int32(3), stop_token_ids=np.array([62, 63]),
                       stop_strings=["zz"], seed=np.uint32(5))
    r = engine.submit(Request(np.array(script.set(1, 3, [4, 63, 5])), p)).result(timeout=10)
    assert r.finish_reason == "stop" and r.token_ids == [4, 63] and r.seed == 5


# ------------------------------------------------------------------------------ 3. update_weights / max_concurrency
def test_last_of_two_rapid_updates_always_wins(real):
    states = [nnx.split(CausalLM(CFG, rngs=nnx.Rngs(seed)))[1] for seed in (11, 12)]
    original = real.executor.state
    try:
        for trial in range(300):
            first, last = states[trial % 2], states[1 - trial % 2]
            real.update_weights(first)
            real.update_weights(last)
            assert real.wait_idle(10)
            served = jax.tree.leaves(real.executor.state)
            assert all(a is b for a, b in zip(served, jax.tree.leaves(last))), f"stale weights in trial {trial}"
            assert real._served_version == real.policy_version
    finally:
        real.update_weights(original)
        assert real.wait_idle(10)


def test_max_concurrency_reads_back_at_once_and_last_set_wins(real):
    try:
        for trial in range(200):
            real.max_concurrency = 1
            real.max_concurrency = 2 + trial % 3
            assert real.max_concurrency == 2 + trial % 3
            assert real.wait_idle(10) and real.scheduler.max_concurrency == 2 + trial % 3
        real.max_concurrency = np.int64(2)
        assert real.max_concurrency == 2
        for bad in (2.5, True, None, "2", 0, 5, 2.0):
            with pytest.raises(ValueError, match="max_concurrency"):
                real.max_concurrency = bad
        assert real.max_concurrency == 2
    finally:
        real.max_concurrency = 4


# ------------------------------------------------------------------------------ 4. update_weights validation
def _with_leaf(state, path_part, fn):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: fn(x) if path_part in jax.tree_util.keystr(p) else x, state)


def test_update_weights_checks_the_state_against_the_served_model(real, model):
    state = nnx.split(model)[1]
    wider = nnx.split(CausalLM(dataclasses.replace(CFG, hidden_size=48), rngs=nnx.Rngs(0)))[1]
    deeper = nnx.split(CausalLM(dataclasses.replace(CFG, num_layers=3), rngs=nnx.Rngs(0)))[1]
    untied = nnx.split(CausalLM(dataclasses.replace(CFG, tie_word_embeddings=False), rngs=nnx.Rngs(0)))[1]
    cases = [
        (wider, r"shape \[64, 48\] at \['embedding_vd'\]"),
        (_with_leaf(state, "q_norm", lambda x: x.astype(jnp.bfloat16)),
         r"dtype bfloat16 at \['layers'\]\[0\]\['attn'\]\['q_norm'\]"),
        (_with_leaf(state, "k_weight", lambda x: x[..., :8]),
         r"shape \[32, 1, 8\] at \['layers'\]\[0\]\['attn'\]\['k_weight_dkh'\]"),
        (deeper, r"\['layers'\]\[1\]"),
        (untied, "untied output head"),
        (model, "not the CausalLM module"),
        ({"embedding_vd": np.zeros((64, 32), np.float32)}, "nnx.State"),
    ]
    leaves_before = jax.tree.leaves(real.executor.state)
    version = real.policy_version
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            real.update_weights(bad)
    assert real.policy_version == version
    assert all(a is b for a, b in zip(jax.tree.leaves(real.executor.state), leaves_before))
    assert_engine_serves(real)


# ------------------------------------------------------------------------------ 5. policy versions
def test_results_record_the_versions_they_ran_under(scripted, model):
    engine, script = scripted
    state = nnx.split(model)[1]
    v = engine.policy_version
    steps = []

    def hook(kind):
        steps.append(kind)
        if len(steps) == 4:
            engine.update_weights(state)        # from the engine thread, mid-request
    script.hook = hook
    straddling = engine.submit(Request(script.set(1, 3, []), params(12))).result(timeout=10)
    assert straddling.policy_versions == (v, v + 1) and engine.policy_version == v + 1
    script.hook = None
    after = engine.submit(Request(script.set(2, 3, []), params(4))).result(timeout=10)
    assert after.policy_versions == (v + 1, v + 1)
    engine.update_weights(state, version=v + 10)
    assert engine.policy_version == v + 10
    assert engine.submit(Request(script.set(3, 3, []), params(2))).result(timeout=10).policy_versions == (v + 10,) * 2
    for bad in (v + 9, -1, True, "12", 1.5):
        with pytest.raises(ValueError, match="version"):
            engine.update_weights(state, version=bad)
    assert engine.policy_version == v + 10


def test_first_version_is_that_of_the_first_prefill_chunk(scripted, model):
    engine, script = scripted
    state = nnx.split(model)[1]
    v = engine.policy_version
    calls = []

    def hook(kind):
        calls.append(kind)
        if len(calls) == 1:
            engine.update_weights(state)        # after the first of three prompt chunks
    script.hook = hook
    r = engine.submit(Request(script.set(1, 40, []), params(1))).result(timeout=10)   # chunks of 16 tokens
    assert calls[:3] == ["prefill"] * 3 and r.policy_versions == (v, v + 1)


def test_simulated_engine_records_versions_too():
    engine = SimulatedEngine({"full": 4.0})
    future = engine.submit(Request([1], SamplingParams(max_new_tokens=2), request_id="a"))
    engine.wait_idle()
    engine.update_weights(None)
    late = engine.submit(Request([1], SamplingParams(max_new_tokens=2), request_id="b"))
    engine.wait_idle()
    assert future.result().policy_versions == (0, 0) and late.result().policy_versions == (1, 1)
    engine.update_weights(None, version=7)
    with pytest.raises(ValueError, match="never decrease"):
        engine.update_weights(None, version=3)


# ------------------------------------------------------------------------------ 6. no recompilation after warmup
class RecordingSteps:
    """Replaces the jitted steps with recorders of the padded shapes (no compilation at all)."""

    def __init__(self, engine):
        self.prefill_shapes, self.decode_shapes = [], []
        engine.executor.prefill = self.prefill
        engine.executor.decode = self.decode

    def prefill(self, batch):
        self.prefill_shapes.append(batch.tokens.shape)
        return np.zeros(batch.tokens.shape[0], np.int32), np.zeros(batch.tokens.shape[0], np.float32)

    def decode(self, batch):
        self.decode_shapes.append(batch.page_table.shape)
        return np.zeros(batch.tokens.shape[0], np.int32), np.zeros(batch.tokens.shape[0], np.float32)


@pytest.mark.slow  # heavier than the README's test run allows (run in CI: pytest -m slow)
@pytest.mark.parametrize("length_step", [None, 128], ids=["powers-of-two", "length-step-128"])
def test_default_config_uses_only_warmed_up_shapes(model, length_step):
    """Default ``EngineConfig``: 5 prompts of 40 tokens, 5 of 300 (old code: padded (16, 512) was used but
    never warmed up, as 16 × 512 > max_prefill_tokens) and a random mix use only shapes warm-up compiled; so does
    the finer padding of ``prefill_length_step``."""
    config = EngineConfig(prefill_length_step=length_step)
    engine = Engine(model, config)
    steps = RecordingSteps(engine)
    engine.warmup()
    warmed_prefill, warmed_decode = set(steps.prefill_shapes), set(steps.decode_shapes)
    steps.prefill_shapes.clear()
    steps.decode_shapes.clear()
    rng = np.random.default_rng(0)
    workloads = [[40] * 5, [300] * 5, rng.integers(1, 2000, size=40).tolist()]
    with engine:
        for lengths in workloads:
            engine.generate([Request([1] * n, SamplingParams(max_new_tokens=2)) for n in lengths])
    assert steps.prefill_shapes and steps.decode_shapes
    assert set(steps.prefill_shapes) <= warmed_prefill, set(steps.prefill_shapes) - warmed_prefill
    assert set(steps.decode_shapes) <= warmed_decode
    for rows, length in steps.prefill_shapes:         # the padded batch respects the prefill budget
        assert rows == 1 or rows * length <= config.max_prefill_tokens


@pytest.mark.parametrize("length_step", [None, 64, 100])
def test_buckets_shapes_are_the_image_of_the_padding_functions(length_step):
    buckets = Buckets.make(max_slots=64, max_seq_len=4096, page_size=16, prefill_chunk=512,
                           max_prefill_tokens=4096, max_prefill_rows=16, length_step=length_step)
    reachable = {buckets.prefill_shape(r, n) for r in range(1, 17) for n in range(1, 513)
                 if buckets.prefill_fits(r, n)}
    assert reachable == set(buckets.prefill_shapes())
    assert {buckets.decode_shape(r, p) for r in range(1, 65) for p in range(1, 257)} == set(buckets.decode_shapes())


def test_a_length_step_pads_less():
    """Powers of two pad a 600-token chunk to 1,024 and 2 rows to 4; a step of 128 pads them to 640 and 2."""
    coarse, fine = (Buckets.make(max_slots=16, max_seq_len=1104, page_size=16, prefill_chunk=1024,
                                 max_prefill_tokens=8192, max_prefill_rows=4, length_step=step) for step in (None, 128))
    assert coarse.prefill_lengths == (16, 32, 64, 128, 256, 512, 1024) and coarse.prefill_rows == (1, 4)
    assert fine.prefill_lengths == (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024)
    assert fine.prefill_rows == (1, 2, 4)
    assert coarse.prefill_shape(2, 600) == (4, 1024) and fine.prefill_shape(2, 600) == (2, 640)
    assert fine.prefill_shape(1, 1000) == (1, 1024) and fine.prefill_shape(3, 129) == (4, 256)
    with pytest.raises(ValueError, match="prefill_length_step must be a positive int"):
        EngineConfig(prefill_length_step=0).validate()


def test_no_recompilation_when_the_padded_batch_would_exceed_the_budget(real, model):
    """Two prompts of 20 tokens admitted together: 20 + 12 real tokens fit max_prefill_tokens = 32, but the
    padded batch (2, 32) does not; the old scheduler ran it and compiled a shape warm-up had skipped."""
    engine = Engine(model, REAL)
    engine.warmup()
    before = engine.compiled_count()
    futures = [engine.submit(Request(list(range(1, 21)), params(3))) for _ in range(2)]   # queued before start
    with engine:
        results = [f.result(timeout=120) for f in futures]
    assert [r.finish_reason for r in results] == ["length", "length"]
    assert engine.compiled_count() == before


# ------------------------------------------------------------------------------ 7. stop strings and min_new_tokens
ABCD = [0, 1, 2, 3]
X = [23]


@pytest.mark.parametrize("tokens,min_new,max_new,expected_len,reason", [
    (ABCD + X * 20, 8, 12, 12, "length"),               # "abcd" ended before min: never stops the request
    (ABCD + X * 20, 12, 12, 12, "length"),              # min = max: all 12 tokens, and all of their text
    (ABCD + X * 2 + ABCD + X * 20, 8, 20, 10, "stop"),  # a later occurrence ending after min stops it
    (X * 3 + [0, 1] + [2, 3] + X * 9, 6, 16, 7, "stop"),  # "ab" before min, "cd" after: ends after min
    (X * 2 + ABCD + X * 9, 0, 16, 6, "stop"),           # no min: first occurrence
])
def test_stop_strings_respect_min_new_tokens_and_text_is_the_decoded_tokens(
        scripted, tokens, min_new, max_new, expected_len, reason):
    engine, script = scripted
    r = engine.submit(Request(script.set(1, 3, tokens), params(max_new, min_new_tokens=min_new,
                                                              stop_strings=("abcd",)))).result(timeout=10)
    assert (r.finish_reason, len(r.token_ids)) == (reason, expected_len)
    assert r.token_ids == (tokens + X * max_new)[:expected_len]
    assert r.text == CharTokenizer().decode(r.token_ids)


def test_text_after_the_stop_string_in_the_last_token_is_kept(scripted):
    engine, script = scripted
    engine.tokenizer = CharTokenizer({40: "d. And", 41: "then"})
    r = engine.submit(Request(script.set(1, 3, [0, 1, 2, 40, 41]), params(10, stop_strings=("cd.",)))).result(10)
    assert r.finish_reason == "stop" and r.token_ids == [0, 1, 2, 40] and r.text == "abcd. And"


# ------------------------------------------------------------------------------ 8. multi-token characters
def test_stop_string_of_multi_token_characters(scripted, qwen_tokenizer):
    engine, script = scripted
    engine.tokenizer = qwen_tokenizer
    stop = "\U0001FAE0" * 9                                        # "🫠" × 9
    assert len(qwen_tokenizer.encode(stop)) == 27
    ids = qwen_tokenizer.encode("Done: " + stop + " and more text after it")
    n = next(n for n in range(1, len(ids) + 1) if stop in qwen_tokenizer.decode(ids[:n]))
    r = engine.submit(Request(script.set(1, 3, ids), params(60, stop_strings=(stop,)))).result(timeout=10)
    assert r.finish_reason == "stop" and r.token_ids == ids[:n]
    assert r.text == qwen_tokenizer.decode(ids[:n]) and r.text.endswith(stop)
    # split over the min_new_tokens boundary: still found, at the same token
    r = engine.submit(Request(script.set(2, 3, ids), params(60, min_new_tokens=n - 3,
                                                            stop_strings=(stop,)))).result(timeout=10)
    assert r.finish_reason == "stop" and len(r.token_ids) == n


# ------------------------------------------------------------------------------ 9. warmup vs the engine loop
def test_warmup_while_requests_run_never_touches_donated_buffers(real):
    errors = []

    def warm():
        try:
            for _ in range(3):
                real.warmup()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    thread = threading.Thread(target=warm)
    requests = [Request([1, 2, 3, i % 50 + 1], SamplingParams(max_new_tokens=4, temperature=1.0, seed=i))
                for i in range(40)]
    thread.start()
    futures = []
    for request in requests:
        futures.append(real.submit(request))
        time.sleep(0.002)
    thread.join(120)
    results = [f.result(timeout=120) for f in futures]
    assert not errors
    assert all(r.finish_reason == "length" and r.error is None for r in results)
    again = real.generate([dataclasses.replace(r) for r in requests])        # same seeds: same tokens
    assert [r.token_ids for r in again] == [r.token_ids for r in results]


# ------------------------------------------------------------------------------ 10. lifecycle
def test_submit_after_stop_raises_and_start_serves_again(model):
    engine = Engine(model, SCRIPTED, tokenizer=CharTokenizer())
    script = Script(engine)
    engine.start()
    engine.stop()
    with pytest.raises(RuntimeError, match="engine is stopped"):
        engine.submit(Request([1], params(2)))
    engine.start()
    assert_engine_serves(engine, script)
    engine.stop()
    simulated = SimulatedEngine({"full": 1.0})
    simulated.stop()
    with pytest.raises(RuntimeError, match="engine is stopped"):
        simulated.submit(Request([1], params(2)))


def _slow(script):
    script.hook = lambda kind: time.sleep(0.005)


def test_cancelling_a_future_aborts_its_request(scripted):
    engine, script = scripted
    _slow(script)
    generated = engine.stats["generated_tokens"]
    future = engine.submit(Request(script.set(1, 3, []), params(480)))
    while engine.stats["generated_tokens"] < generated + 3:
        time.sleep(0.005)
    assert future.cancel()
    assert engine.wait_idle(3)                       # 480 tokens at 5 ms each would take 2.4 s more
    assert engine.stats["generated_tokens"] - generated < 200
    assert engine.scheduler.allocator.num_used == 0


def test_asyncio_timeout_aborts_the_request(scripted):
    engine, script = scripted
    _slow(script)
    generated = engine.stats["generated_tokens"]

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.submit_async(Request(script.set(1, 3, []), params(480))), 0.05)
    asyncio.run(main())
    assert engine.wait_idle(3)
    assert engine.stats["generated_tokens"] - generated < 200


def test_simulated_engine_cancel_aborts():
    engine = SimulatedEngine({"full": 4.0})
    future = engine.submit(Request([1], SamplingParams(max_new_tokens=2), request_id="c"))
    assert future.cancel()
    assert engine.wait_idle() and [e.event for e in engine.events] == ["submit", "abort"]


def test_budgeted_response_can_be_aborted_and_is_checked_at_submission(scripted):
    engine, script = scripted
    budget = ThinkingBudget(first_stage_tokens=300, total_tokens=400, second_stage_max_tokens=50)
    tokenizer = engine.tokenizer
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        submit_budgeted(engine, tokenizer, [1] * 150, params(1), budget)      # 150 + 400 > 512
    assert engine.wait_idle(1) and not engine.scheduler.has_work()
    _slow(script)
    handle = submit_budgeted(engine, tokenizer, script.set(1, 3, []), params(1), budget, request_id="think-1")
    assert handle.request_id == "think-1"
    while engine.stats["generated_tokens"] == 0 or not engine.scheduler.running:
        time.sleep(0.005)
    handle.abort()
    response = handle.result(timeout=5)
    assert response.stages[-1].finish_reason == "abort" and len(response.token_ids) < 300
    assert engine.wait_idle(3)
    cancelled = submit_budgeted(engine, tokenizer, script.set(2, 3, []), params(1), budget)
    time.sleep(0.02)
    assert cancelled.cancel() and engine.wait_idle(3)
    by_id = submit_budgeted(engine, tokenizer, script.set(3, 3, []), params(1), budget, request_id="think-3")
    time.sleep(0.02)
    engine.abort("think-3")                          # the first stage answers to the given id
    assert by_id.result(timeout=5).stages[-1].finish_reason == "abort"


# ------------------------------------------------------------------------------ 11. seeds
def test_default_seed_is_fresh_per_request_and_explicit_seeds_reproduce(real):
    assert SamplingParams(max_new_tokens=1).seed is None
    sampled = real.generate([Request([5, 6, 7], SamplingParams(max_new_tokens=6, temperature=1.0))
                             for _ in range(8)])
    assert len({tuple(r.token_ids) for r in sampled}) > 1
    assert len({r.seed for r in sampled}) == 8 and all(0 <= r.seed < 2 ** 32 for r in sampled)
    replay = real.submit(Request([5, 6, 7], SamplingParams(max_new_tokens=6, temperature=1.0,
                                                           seed=sampled[0].seed))).result(timeout=60)
    assert replay.token_ids == sampled[0].token_ids
    fixed = real.generate([Request([5, 6, 7], SamplingParams(max_new_tokens=6, temperature=1.0, seed=7))
                           for _ in range(2)])
    assert fixed[0].token_ids == fixed[1].token_ids and fixed[0].seed == 7
