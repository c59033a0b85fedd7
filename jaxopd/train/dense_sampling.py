"""Reference on-policy sampling without a KV cache, for tests and tiny models.

Owns one jitted loop that appends sampled tokens to fixed-length sequences, re-running the dense forward
over the whole sequence at every step, and returns the tokens with their sampling log-probabilities
(``jaxopd.models.logprobs.tempered_log_softmax``, as the paged sampler and the train step).
The paged sampler (``jaxopd.sampler``) serves real runs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxopd.models.logprobs import ROLLOUT_TEMPERATURE, tempered_log_softmax


@functools.partial(jax.jit, static_argnames=("graphdef", "num_new_tokens", "temperature"))
def sample_dense(graphdef: nnx.GraphDef, params: nnx.State, prompts: jax.Array, key: jax.Array, *,
                 num_new_tokens: int, temperature: float = ROLLOUT_TEMPERATURE) -> tuple[jax.Array, jax.Array]:
    """Samples ``num_new_tokens`` tokens after each prompt at ``temperature`` (full softmax, no top-k/p).

    ``prompts``: ``[B, P]`` int, no padding. Returns ``(tokens [B, P + N], logp [B, P + N])`` where
    ``logp`` holds each sampled token's log-probability under the tempered policy (0 on the prompt).
    """
    if prompts.ndim != 2:
        raise ValueError(f"prompts must be [batch, prompt_length], got shape {prompts.shape}")
    if num_new_tokens < 1 or not temperature > 0:
        raise ValueError(f"need num_new_tokens >= 1 and temperature > 0, got {num_new_tokens}, {temperature}")
    model = nnx.merge(graphdef, params)
    batch, prompt_length = prompts.shape
    length = prompt_length + num_new_tokens
    tokens = jnp.zeros((batch, length), jnp.int32).at[:, :prompt_length].set(prompts.astype(jnp.int32))
    logp = jnp.zeros((batch, length), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

    def step(i, carry):
        tokens, logp = carry
        current = prompt_length + i
        attention_mask = positions < current
        logits = model(tokens, positions, attention_mask)[:, current - 1]
        log_probs = tempered_log_softmax(logits, temperature)
        new = jax.random.categorical(jax.random.fold_in(key, i), log_probs, axis=-1).astype(jnp.int32)
        tokens = tokens.at[:, current].set(new)
        logp = logp.at[:, current].set(jnp.take_along_axis(log_probs, new[:, None], axis=-1)[:, 0])
        return tokens, logp

    return jax.lax.fori_loop(0, num_new_tokens, step, (tokens, logp))


__all__ = ["sample_dense"]
