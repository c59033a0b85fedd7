"""The one tempered log-softmax: what the sampler reports, what the train step and the dense sampler compute,
and the training temperature taken from the rollout's own sampling params."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopd.models.logprobs import ROLLOUT_TEMPERATURE, tempered_log_softmax, token_log_probs
from jaxopd.sampler import SamplingParams
from jaxopd.sampler.sampling import sample_tokens
from jaxopd.train.step import LossConfig

LOGITS = jnp.asarray(np.random.default_rng(0).normal(size=(4, 37)) * 3, jnp.float32)


def test_scalar_and_per_row_temperatures_and_greedy():
    for t in (0.5, 1.0, 1.7):
        expected = jax.nn.log_softmax(LOGITS / t, axis=-1)
        np.testing.assert_array_equal(tempered_log_softmax(LOGITS, t), expected)                  # static
        np.testing.assert_allclose(tempered_log_softmax(LOGITS, jnp.float32(t)), expected, atol=1e-6)  # traced
    per_row = jnp.array([0.0, 0.5, 1.0, 2.0])                                     # row 0 greedy: plain softmax
    expected = jax.nn.log_softmax(LOGITS / jnp.array([1.0, 0.5, 1.0, 2.0])[:, None], axis=-1)
    np.testing.assert_array_equal(tempered_log_softmax(LOGITS, per_row), expected)
    np.testing.assert_array_equal(tempered_log_softmax(LOGITS, 0.0), jax.nn.log_softmax(LOGITS, axis=-1))
    assert tempered_log_softmax(LOGITS.astype(jnp.bfloat16), 1.0).dtype == jnp.float32
    np.testing.assert_array_equal(jax.jit(tempered_log_softmax)(LOGITS, per_row), expected)
    np.testing.assert_array_equal(tempered_log_softmax(LOGITS[None], per_row[None]), expected[None])   # [B, T, V]


def test_token_log_probs_and_the_sampler_report_the_same_numbers():
    temperature = jnp.array([0.0, 0.7, 1.0, 1.3])
    tokens, reported = sample_tokens(LOGITS, temperature, jnp.ones(4), jnp.zeros(4, jnp.int32),
                                     jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.int32))
    np.testing.assert_array_equal(reported, token_log_probs(LOGITS, tokens, temperature))
    np.testing.assert_allclose(token_log_probs(LOGITS, tokens, 0.7)[1], reported[1], atol=1e-6)


def test_training_temperature_is_the_rollout_temperature():
    assert SamplingParams(max_new_tokens=1).temperature == LossConfig().temperature == ROLLOUT_TEMPERATURE
    fast, full = SamplingParams(max_new_tokens=8, temperature=0.6), SamplingParams(max_new_tokens=64, temperature=0.6)
    config = LossConfig.for_rollout(fast, full, kind="sti-opd", clip_eps=0.1)
    assert config.temperature == 0.6 and config.kind == "sti-opd" and config.clip_eps == 0.1
    assert LossConfig.for_rollout(SamplingParams(max_new_tokens=1, temperature=0.0)).temperature == 1.0   # greedy
    with pytest.raises(ValueError, match="different temperatures"):
        LossConfig.for_rollout(fast, SamplingParams(max_new_tokens=1, temperature=1.0))
    with pytest.raises(TypeError, match="takes the temperature"):
        LossConfig.for_rollout(fast, temperature=1.0)
