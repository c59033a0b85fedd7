"""The policy's tempered log-probabilities: the one place logits become log-probabilities.

Owns ``tempered_log_softmax`` (float32 ``log softmax(logits / temperature)``; temperature 0 means greedy and
gives the plain log-softmax) and ``ROLLOUT_TEMPERATURE``, the temperature of the student's behaviour policy.
The sampler reports each sampled token's log-probability with it, the train step and the teacher scorer
compute the learner's log-probabilities with it, and the dense reference sampler samples with it: one
function, so the behaviour and learner log-probabilities of the OPD ratios cannot drift apart. It lives in
``jaxopd.models`` because every user (``sampler``, ``train``) already sits above the model and none may import
the other.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ROLLOUT_TEMPERATURE = 1.0
"""Default temperature of the student's rollouts, and hence of the train step's log-probabilities (the three
papers sample at 1.0). ``SamplingParams.temperature`` and ``LossConfig.temperature`` both default to it;
``LossConfig.for_rollout(sampling_params)`` takes the training temperature from the rollout's own params."""


def effective_temperature(temperature: float) -> float:
    """The temperature the log-probabilities are taken at: ``temperature``, or 1 for greedy (``<= 0``)."""
    return temperature if temperature > 0 else 1.0


def tempered_log_softmax(logits: jax.Array, temperature: float | jax.Array = ROLLOUT_TEMPERATURE) -> jax.Array:
    """float32 ``log softmax(logits / temperature)`` over the last axis.

    ``temperature``: a scalar, or one per row (shape ``logits.shape[:-1]``). A temperature ``<= 0`` (greedy)
    gives the plain log-softmax, the convention of the sampler's reported log-probabilities.
    """
    logits = logits.astype(jnp.float32)
    if isinstance(temperature, (int, float)):                  # static: no select in the graph
        return jax.nn.log_softmax(logits / effective_temperature(float(temperature)), axis=-1)
    temperature = jnp.asarray(temperature, jnp.float32)
    scale = jnp.where(temperature > 0.0, temperature, 1.0)
    return jax.nn.log_softmax(logits / scale[..., None], axis=-1)


def token_log_probs(logits: jax.Array, targets: jax.Array,
                    temperature: float | jax.Array = ROLLOUT_TEMPERATURE) -> jax.Array:
    """``tempered_log_softmax(logits, temperature)`` at ``targets`` (``logits.shape[:-1]``), in float32."""
    logp = tempered_log_softmax(logits, temperature)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


__all__ = ["ROLLOUT_TEMPERATURE", "effective_temperature", "tempered_log_softmax", "token_log_probs"]
